"""Attention over the paged KV cache.

Each layer first writes the step's K/V at ``slot_mapping``, then every request reads its whole
context back from the pool through its block table. Reading back (rather than using the fresh k, v)
is deliberate: the attention sees exactly what the cache holds, so a leak in the cache shows in the
output, and the sanitizer's view of what was read is the truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.attention.kernels import PagedDecode
from kvlab.attention.varlen import causal_mask_with_offset, prefill_attention
from kvlab.instrument.attention import AttentionCapture
from kvlab.kv import KVStorage


@dataclass
class PrefillSegment:
    """One request with more than one query token this step."""

    row_start: int
    row_end: int
    context_slots: torch.Tensor  # [ctx]
    q_positions: torch.Tensor  # [L]
    fresh: bool
    request_id: str = ""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode_rows: torch.Tensor  # [Bd] flat rows of single-token requests (with the kernel: every query row)
    decode_context_slots: torch.Tensor  # [Bd, max_ctx] (padding points at slot 0, masked)
    # [Bd, 1, 1, max_ctx] additive: 0 = attend, -inf = padding. Built once per step: a boolean mask would
    # be turned into this very tensor inside SDPA in every layer (and SDPA is ~15% faster given it).
    decode_mask: torch.Tensor
    prefills: list[PrefillSegment]
    decode_request_ids: list[str] | None = None  # only needed when attention is captured
    # The in-place kernel path (the runner chose it for this step): block tables [Bd, max_blocks] and context
    # lengths [Bd] instead of gathered slots and a mask.
    decode_kernel: PagedDecode | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Batched single-query attention: q [B, H, D], k, v [B, ctx, Hkv, D], mask [B, 1, 1, ctx] (boolean, or
    additive float)."""
    gqa = q.shape[1] != k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa
    )
    return out.squeeze(2)


class PagedAttention:
    """The ``AttentionBackend`` the engine hands the model for one step."""

    def __init__(self, storage: KVStorage, meta: AttentionMetadata, capture: AttentionCapture | None = None) -> None:
        self.storage = storage
        self.meta = meta
        self.capture = capture

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        self.storage.write(layer, meta.slot_mapping, k, v)
        # Without prefill segments every row is a decode row, in row order (with the kernel, every step): no
        # scatter needed.
        out = None if not meta.prefills else torch.empty_like(q)
        if meta.decode_rows.numel() and meta.decode_kernel is not None:
            assert meta.decode_block_tables is not None and meta.decode_lens is not None
            qd = q if out is None else q[meta.decode_rows]
            kc, vc = self.storage.k_cache[layer], self.storage.v_cache[layer]
            args = (qd, kc, vc, meta.decode_block_tables, meta.decode_lens, qd.shape[-1] ** -0.5)
            if torch.autograd._profiler_enabled():
                # A pybind op is invisible to torch.profiler without a label (bench step --profile); the label
                # costs ~6 us a call, so it is only put on while a profiler runs.
                with torch.profiler.record_function("kvlab::paged_decode"):
                    dec = meta.decode_kernel(*args)
            else:
                dec = meta.decode_kernel(*args)
            if out is None:
                out = dec
            else:
                out[meta.decode_rows] = dec
        elif meta.decode_rows.numel():
            kc, vc = self.storage.gather(layer, meta.decode_context_slots, q.dtype)
            if out is None:
                out = decode_attention(q, kc, vc, meta.decode_mask)
            else:
                out[meta.decode_rows] = decode_attention(q[meta.decode_rows], kc, vc, meta.decode_mask)
            if self.capture is not None:
                self._capture_decode(self.capture, layer, q, kc)
        for seg in meta.prefills:
            assert out is not None  # allocated above whenever there are prefills
            kc, vc = self.storage.gather(layer, seg.context_slots, q.dtype)
            out[seg.row_start : seg.row_end] = prefill_attention(
                q[seg.row_start : seg.row_end], kc, vc, seg.q_positions, seg.fresh
            )
            if self.capture is not None and self.capture.wants(seg.request_id, layer):
                mask = causal_mask_with_offset(seg.q_positions, kc.shape[0])
                self.capture.record(
                    seg.request_id, layer, q[seg.row_start : seg.row_end], kc, mask, seg.q_positions.tolist()
                )
        # Every row is a decode row or in a prefill, and the runner never runs the model on zero rows.
        assert out is not None
        return out

    def _capture_decode(self, capture: AttentionCapture, layer: int, q: torch.Tensor, kc: torch.Tensor) -> None:
        meta = self.meta
        for i, rid in enumerate(meta.decode_request_ids or []):
            if capture.wants(rid, layer):
                ctx = int((meta.decode_mask[i] == 0).sum())
                row = int(meta.decode_rows[i])
                mask = torch.ones(1, ctx, dtype=torch.bool)
                capture.record(rid, layer, q[row : row + 1], kc[i, :ctx], mask, [ctx - 1])
