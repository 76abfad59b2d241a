"""The (in, out) widths of the linears the small-batch kernels are tested at (tests/model/test_*_linear.py)."""

from __future__ import annotations

from torch import nn

from kvlab.model.mini import build_mini, mini_config

# SmolLM2-135M: hidden 576, 9 heads over 3 KV heads of 64, MLP 1536, vocabulary 49152 (fused QKV and gate/up, as
# the loader builds them).
SMOLLM2_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def mini_shapes() -> list[tuple[int, int]]:
    """Every linear's widths in mini, mini-gqa and mini-mqa."""
    shapes = set()
    for kv in (4, 2, 1):
        for m in build_mini(mini_config(kv)).modules():
            if isinstance(m, nn.Linear):
                shapes.add((m.in_features, m.out_features))
    return sorted(shapes)
