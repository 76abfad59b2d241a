"""Write SmolLM2 in vLLM's W8A8 int8 checkpoint format (compressed-tensors, "int-quantized") from kvlab's own
quantisation, so that vLLM's int8 W8A8 runs the very codes kvlab's ``int8-w8a8`` mode runs.

Run with kvlab's interpreter after ``scripts/peers/vllm.sh`` wrote the fp32 directory:
``python scripts/peers/smollm2_w8a8_dir.py FP32_DIR OUT_DIR``.

- Every linear of the decoder layers: ``weight`` as int8 codes and ``weight_scale`` [N, 1] in fp32, from
  ``kvlab.model.codes.quantize_w8a8`` (symmetric, one scale per output channel). kvlab fuses q/k/v and gate/up; a
  scale per output row makes the fused and the separate codes the same rows, so the split here is exact.
- Activations: dynamic, symmetric, one scale per token (``input_activations`` ``strategy: token``), as kvlab's.
- ``lm_head`` (tied to the embedding), embeddings and norms stay fp32, as in kvlab's mode.
- Tokenizer and the rest of the directory: copied from the fp32 directory.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "actorder": None}
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {**_INT8, "strategy": "channel", "dynamic": False},
            "input_activations": {**_INT8, "strategy": "token", "dynamic": True},
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}


def main(fp32_dir: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    from kvlab.model.codes import quantize_w8a8

    out.mkdir(parents=True, exist_ok=True)
    for f in fp32_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(fp32_dir.glob("*.safetensors")):
        state.update(load_file(shard))
    written: dict[str, torch.Tensor] = {}
    quantised = 0
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            codes = quantize_w8a8(t)
            written[name] = codes.q.contiguous()
            written[f"{module}.weight_scale"] = codes.scale.float().reshape(-1, 1).contiguous()
            quantised += 1
        else:
            written[name] = t.contiguous()
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    print(f"{out}: {quantised} linears as int8 codes with per-channel scales (kvlab's quantize_w8a8)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: smollm2_w8a8_dir.py FP32_DIR OUT_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
