"""The seam between the decoder and whatever holds K/V.

The decoder computes q, k, v for a flat batch of tokens and hands them to an ``AttentionBackend``;
the backend decides where K/V live (nowhere for the dense reference, the paged pool for the engine)
and returns the attention output. The model never knows which one it is talking to.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the T tokens of this step. Returns [T, H, D]."""
        ...


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat KV heads so that each query head has its group's K/V: [..., Hkv, D] -> [..., H, D]."""
    num_kv = x.shape[-2]
    if num_kv == num_heads:
        return x
    return x.repeat_interleave(num_heads // num_kv, dim=-2)


class DenseCausalAttention:
    """No cache: each sequence of the flat batch attends causally to its own tokens only.

    Sequences are delimited by ``cu_seqlens`` (length batch+1). This is the oracle's attention: it
    holds nothing between calls, so nothing can leak between steps or requests. With ``kv_dtype``, K and V are
    rounded to it first, as a cache of that dtype stores them (the oracle of a bf16 or fp8 cache), and attended
    widened back, as the cache's readers widen them.
    """

    def __init__(self, cu_seqlens: list[int], num_heads: int, kv_dtype: torch.dtype | None = None) -> None:
        self.cu_seqlens = cu_seqlens
        self.num_heads = num_heads
        self.kv_dtype = kv_dtype

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kv_dtype is not None:
            k, v = k.to(self.kv_dtype).to(q.dtype), v.to(self.kv_dtype).to(q.dtype)
        out = torch.empty_like(q)
        for start, end in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:], strict=True):
            qs = q[start:end].transpose(0, 1)  # [H, L, D]
            ks = expand_kv(k[start:end], self.num_heads).transpose(0, 1)
            vs = expand_kv(v[start:end], self.num_heads).transpose(0, 1)
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out[start:end] = o.transpose(0, 1)
        return out
