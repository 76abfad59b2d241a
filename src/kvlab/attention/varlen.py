"""Varlen batches: the tokens of several requests concatenated, delimited by ``cu_seqlens``.

``cu_seqlens`` is the prefix sum of per-request token counts: length batch+1, starts at 0,
non-decreasing, last value = total tokens. A zero-length request would show as a repeated value;
the engine never lets one in (docs/architecture.md, "Vocabulary"), and ``check_cu_seqlens`` says so loudly.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise

import torch


class CuSeqlensError(ValueError):
    """cu_seqlens does not describe the flat batch it is meant to delimit."""


def build_cu_seqlens(lengths: Sequence[int]) -> list[int]:
    return [0, *accumulate(lengths)]


def check_cu_seqlens(cu_seqlens: Sequence[int], total_tokens: int, allow_empty: bool = False) -> None:
    if len(cu_seqlens) < 2:
        raise CuSeqlensError(f"cu_seqlens must have length batch+1 >= 2, got {list(cu_seqlens)}")
    if cu_seqlens[0] != 0:
        raise CuSeqlensError(f"cu_seqlens must start at 0, got {cu_seqlens[0]}")
    for i, (a, b) in enumerate(pairwise(cu_seqlens)):
        if b < a:
            raise CuSeqlensError(f"cu_seqlens must be non-decreasing: cu_seqlens[{i + 1}]={b} < {a}")
        if b == a and not allow_empty:
            raise CuSeqlensError(
                f"request {i} of the batch has zero tokens (cu_seqlens[{i}] == cu_seqlens[{i + 1}] == {a}); "
                "an empty request must never enter a batch"
            )
    if cu_seqlens[-1] != total_tokens:
        raise CuSeqlensError(f"cu_seqlens[-1]={cu_seqlens[-1]} must equal the total token count {total_tokens}")


def causal_mask_with_offset(q_positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """[L, ctx] boolean mask: query at absolute position p sees keys 0..p (its cached prefix + itself)."""
    return torch.arange(context_len)[None, :] <= q_positions[:, None]


def causal_bias_with_offset(q_positions: torch.Tensor, context_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``causal_mask_with_offset`` as SDPA's additive mask [L, ctx] (0 = attend, -inf = not): built once a step,
    where a boolean mask would be turned into this very tensor inside SDPA in every layer."""
    allowed = causal_mask_with_offset(q_positions, context_len)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    fresh: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request's chunk of queries q [L, H, D] against its whole context k, v [ctx, Hkv, D].

    ``fresh`` means the chunk is the whole context (no cached prefix), so the plain causal kernel applies.
    Otherwise ``bias`` (``causal_bias_with_offset`` in q's dtype) is the mask, built from ``q_positions`` when
    not given.
    """
    # [1, H, L, D]: SDPA takes its tiled CPU (flash) kernel for 4-D inputs only; given [H, L, D] it falls back
    # to the math path, which materialises every [L, ctx] score matrix (docs/performance.md, "Long context").
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = qh.shape[1] != kh.shape[1]
    if fresh:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        mask = causal_mask_with_offset(q_positions, k.shape[0]) if bias is None else bias
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)
