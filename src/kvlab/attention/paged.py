"""Attention over the paged KV cache.

Each layer first writes the step's K/V at ``slot_mapping``, then every request reads its whole
context back from the pool through its block table. Reading back (rather than using the fresh k, v)
is deliberate: the attention sees exactly what the cache holds, so a leak in the cache shows in the
output, and the sanitizer's view of what was read is the truth.

The runner builds one metadata per step, whole, for one of two paths:

- ``ReferenceAttentionMetadata``: gather + SDPA. Requests with one query token this step are single-query rows
  (``SingleQueryRows``: batched SDPA over their gathered, padded contexts); requests with more are prefill
  segments (``PrefillSegment``: varlen causal SDPA over the gathered context). Attention capture reads this path.
- ``KernelAttentionMetadata``: the compiled kernel (``kvlab.attention.kernels``) reading K/V in place. Every query
  row of the step is a kernel row, decode tokens and prefill queries alike: row ``r`` reads the first
  ``row_context_lens[r]`` slots of its request's table ``row_block_tables[r]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.attention.kernels import PagedAttentionKernel
from kvlab.attention.varlen import causal_mask_with_offset, prefill_attention
from kvlab.instrument.attention import AttentionCapture
from kvlab.kv import KVStorage


@dataclass(frozen=True, eq=False)
class PrefillSegment:
    """Reference path: one request with more than one query token this step, rows ``[row_start, row_end)``."""

    row_start: int
    row_end: int
    context_slots: torch.Tensor  # [ctx] the request's whole context, this chunk included
    q_positions: torch.Tensor  # [L]
    fresh: bool  # the chunk is the whole context (no cached prefix): the plain causal kernel applies
    request_id: str


@dataclass(frozen=True, eq=False)
class SingleQueryRows:
    """Reference path: the requests with one query token this step (a decode token, or a one-token prompt or
    chunk), one row each, attended together over their gathered contexts."""

    rows: torch.Tensor  # [B1] flat rows, ascending
    context_slots: torch.Tensor  # [B1, max_ctx] (padding points at slot 0, masked)
    # [B1, 1, 1, max_ctx] additive: 0 = attend, -inf = padding. Built once per step: a boolean mask would
    # be turned into this very tensor inside SDPA in every layer (and SDPA is ~15% faster given it).
    mask: torch.Tensor
    request_ids: tuple[str, ...]  # per row (attention capture names what it records)


@dataclass(frozen=True, eq=False)
class ReferenceAttentionMetadata:
    """One step on the reference path (gather + SDPA): every row is a single-query row or in exactly one
    prefill segment."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    single_query: SingleQueryRows | None  # None: no request has a single query token this step
    prefills: tuple[PrefillSegment, ...]


@dataclass(frozen=True, eq=False)
class KernelAttentionMetadata:
    """One step on the kernel path: every query row of the step, in row order, read by ``kernel`` in place."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    row_block_tables: torch.Tensor  # [T, max_blocks] the block table of the request each row belongs to
    row_context_lens: torch.Tensor  # [T] the slots each row reads: query i of a chunk at start, start + i + 1
    kernel: PagedAttentionKernel

    def __post_init__(self) -> None:
        rows = self.slot_mapping.shape[0]
        if self.row_block_tables.shape[0] != rows or self.row_context_lens.shape[0] != rows:
            raise ValueError(
                f"KernelAttentionMetadata: one table and one length per row: {rows} rows, "
                f"{self.row_block_tables.shape[0]} tables, {self.row_context_lens.shape[0]} lengths"
            )


AttentionMetadata = ReferenceAttentionMetadata | KernelAttentionMetadata


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
        if isinstance(meta, KernelAttentionMetadata):
            return self._kernel_rows(layer, q, meta)
        return self._reference(layer, q, meta)

    def _kernel_rows(self, layer: int, q: torch.Tensor, meta: KernelAttentionMetadata) -> torch.Tensor:
        # Every row is a kernel row, in row order: the kernel's output is the layer's.
        kc, vc = self.storage.k_cache[layer], self.storage.v_cache[layer]
        args = (q, kc, vc, meta.row_block_tables, meta.row_context_lens, q.shape[-1] ** -0.5)
        if torch.autograd._profiler_enabled():
            # A pybind op is invisible to torch.profiler without a label (bench step --profile); the label
            # costs ~6 us a call, so it is only put on while a profiler runs.
            with torch.profiler.record_function("kvlab::paged_decode"):
                return meta.kernel(*args)
        return meta.kernel(*args)

    def _reference(self, layer: int, q: torch.Tensor, meta: ReferenceAttentionMetadata) -> torch.Tensor:
        single = meta.single_query
        if not meta.prefills:
            # Every row is a single-query row, in row order (the runner never runs the model on zero rows).
            assert single is not None
            kc, vc = self.storage.gather(layer, single.context_slots, q.dtype)
            if self.capture is not None:
                self._capture_single(self.capture, layer, q, kc, single)
            return decode_attention(q, kc, vc, single.mask)
        out = torch.empty_like(q)
        if single is not None:
            kc, vc = self.storage.gather(layer, single.context_slots, q.dtype)
            out[single.rows] = decode_attention(q[single.rows], kc, vc, single.mask)
            if self.capture is not None:
                self._capture_single(self.capture, layer, q, kc, single)
        for seg in meta.prefills:
            kc, vc = self.storage.gather(layer, seg.context_slots, q.dtype)
            out[seg.row_start : seg.row_end] = prefill_attention(
                q[seg.row_start : seg.row_end], kc, vc, seg.q_positions, seg.fresh
            )
            if self.capture is not None and self.capture.wants(seg.request_id, layer):
                mask = causal_mask_with_offset(seg.q_positions, kc.shape[0])
                self.capture.record(
                    seg.request_id, layer, q[seg.row_start : seg.row_end], kc, mask, seg.q_positions.tolist()
                )
        return out

    @staticmethod
    def _capture_single(
        capture: AttentionCapture, layer: int, q: torch.Tensor, kc: torch.Tensor, single: SingleQueryRows
    ) -> None:
        for i, rid in enumerate(single.request_ids):
            if capture.wants(rid, layer):
                ctx = int((single.mask[i] == 0).sum())
                row = int(single.rows[i])
                mask = torch.ones(1, ctx, dtype=torch.bool)
                capture.record(rid, layer, q[row : row + 1], kc[i, :ctx], mask, [ctx - 1])
