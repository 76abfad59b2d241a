"""Attention over the paged KV cache.

Each layer first writes the step's K/V at ``slot_mapping``, then every request reads its whole
context back from the pool through its block table. Reading back (rather than using the fresh k, v)
is deliberate: the attention sees exactly what the cache holds, so a leak in the cache shows in the
output, and the sanitizer's view of what was read is the truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.attention.varlen import prefill_attention
from kvlab.kv import KVStorage


@dataclass
class PrefillSegment:
    """One request with more than one query token this step."""

    row_start: int
    row_end: int
    context_slots: torch.Tensor  # [ctx]
    q_positions: torch.Tensor  # [L]
    fresh: bool


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode_rows: torch.Tensor  # [Bd] flat rows of single-token requests
    decode_context_slots: torch.Tensor  # [Bd, max_ctx] (padding points at slot 0, masked)
    decode_mask: torch.Tensor  # [Bd, 1, 1, max_ctx] True = attend
    prefills: list[PrefillSegment]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Batched single-query attention: q [B, H, D], k, v [B, ctx, Hkv, D], mask [B, 1, 1, ctx]."""
    gqa = q.shape[1] != k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa
    )
    return out.squeeze(2)


class PagedAttention:
    """The ``AttentionBackend`` the engine hands the model for one step."""

    def __init__(self, storage: KVStorage, meta: AttentionMetadata) -> None:
        self.storage = storage
        self.meta = meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        self.storage.write(layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        if meta.decode_rows.numel():
            kc, vc = self.storage.gather(layer, meta.decode_context_slots)
            out[meta.decode_rows] = decode_attention(q[meta.decode_rows], kc, vc, meta.decode_mask)
        for seg in meta.prefills:
            kc, vc = self.storage.gather(layer, seg.context_slots)
            out[seg.row_start : seg.row_end] = prefill_attention(
                q[seg.row_start : seg.row_end], kc, vc, seg.q_positions, seg.fresh
            )
        return out
