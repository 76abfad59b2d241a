"""The peers kvlab is measured against, built on the same weights: Hugging Face transformers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvlab.config import ModelConfig
from kvlab.model.llama import LlamaModel


@contextlib.contextmanager
def _no_tqdm_in(module: Any) -> Iterator[None]:
    original = getattr(module, "tqdm", None)
    if original is None:  # a transformers version without the bar
        yield
        return
    module.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        module.tqdm = original


def hf_from_gguf(path: Path) -> Any:
    """A ``transformers.LlamaForCausalLM`` (fp32) from a GGUF file, through transformers' own GGUF path
    (config from metadata, dequantize, un-permute Q/K).

    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` refuses to run without the
    ``accelerate`` package; for Llama it calls exactly ``load_gguf_checkpoint`` and loads the result,
    which is what this does.
    """
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    # transformers wraps this load in a bare tqdm bar ("de-quantizing GGUF tensors") that ignores its own
    # disable_progress_bar() and writes hundreds of carriage-return updates into a piped log; kvlab's commands
    # show their own progress, so the module's tqdm is swapped for a pass-through for this one call.
    with _no_tqdm_in(gguf_utils):
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"GGUF tensors do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if "lm_head.weight" in missing and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("GGUF has no output.weight but the HF config does not tie the embeddings")
    return hf


def hf_config(cfg: ModelConfig) -> Any:
    import transformers

    # rope_theta, not rope_parameters: 4.x only knows the former, and 5.x still takes it through the
    # **kwargs its dataclass-generated signature does not show (it moves it into rope_parameters).
    return transformers.LlamaConfig(  # type: ignore[call-arg]  # 5.x stub omits the legacy kwargs
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=1,
    )


def to_hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """kvlab names -> LlamaForCausalLM names, splitting the fused projections."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            base = "model." + name.removesuffix("qkv_proj.weight")
            for part, w in zip("qkv", t.split([q, kv, kv]), strict=True):
                out[f"{base}{part}_proj.weight"] = w.clone()
        elif name.endswith("gate_up_proj.weight"):
            base = "model." + name.removesuffix("gate_up_proj.weight")
            gate, up = t.chunk(2)
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = gate.clone(), up.clone()
        elif name == "lm_head.weight":
            out[name] = t.clone()
        else:
            out["model." + name] = t.clone()
    return out


def hf_llama_from(model: LlamaModel) -> Any:
    """A ``transformers.LlamaForCausalLM`` holding exactly the weights of a kvlab ``LlamaModel``."""
    import transformers

    hf = transformers.LlamaForCausalLM(hf_config(model.config)).float().eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return hf
