"""The seed's MiniTransformer: 4 layers, d_model 128, 4 heads, seeded random weights.

Weights are drawn from a private ``torch.Generator`` in a fixed parameter order, so the same seed
gives bit-identical weights on any machine, independent of the global RNG state.
The init scale is larger than a training init (std 1/sqrt(fan_in) rather than 0.02): with tiny
weights every prompt yields the same continuation, and the passphrase experiment needs outputs that
depend on the context so that a leak changes them.
"""

from __future__ import annotations

import math

import torch

from kvlab.config import ModelConfig
from kvlab.model.llama import LlamaModel
from kvlab.tokenizer import ByteTokenizer

MINI_VARIANTS = {"mini": 4, "mini-gqa": 2, "mini-mqa": 1}


def mini_config(num_kv_heads: int = 4) -> ModelConfig:
    return ModelConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        intermediate_size=384,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def build_mini(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaModel:
    model = LlamaModel(config)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name == "embed_tokens.weight":
            param.copy_(torch.randn(param.shape, generator=gen))
        else:
            fan_in = param.shape[1]
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
    return model.to(dtype).eval()
