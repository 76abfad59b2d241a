"""Attention over the paged KV cache.

Each layer first writes the step's K/V at ``slot_mapping``, then every request reads its whole
context back from the pool through its block table. Reading back (rather than using the fresh k, v)
is deliberate: the attention sees exactly what the cache holds, so a leak in the cache shows in the
output, and the sanitizer's view of what was read is the truth.

The runner builds one metadata per step, whole, for one of two paths:

- ``ReferenceAttentionMetadata``: gather + SDPA. Requests with one query token this step are single-query rows
  (``SingleQueryRows``: batched SDPA over their gathered, padded contexts); requests verifying a draft are draft
  rows (``DraftRows``: the same, a few queries each); requests with more are prefill segments (``PrefillSegment``:
  varlen causal SDPA over the gathered context). Attention capture reads this path.
- ``KernelAttentionMetadata``: the compiled kernel (``kvlab.attention.kernels``) reading K/V in place. Decode
  tokens and the queries of short chunks are kernel rows: row ``r`` reads the first ``row_context_lens[r]`` slots
  of its request's table ``row_block_tables[r]``. A chunk of many queries is a prefill segment instead, computed
  tile by tile: by kvlab's flash kernels (``kvlab.attention.flash``, reading the cache through its slots), or
  where they are missing by SDPA's tiled kernel over its gathered context, as on the reference path. Where the
  kernel rows' tables begin with the same blocks (``KernelSharedPrefix``: a document every row decodes after, a
  system prompt), those slots are attended once for all rows by the flash loop and each row walks only its own
  slots after them, the two merged by their log-sum-exp (the cascade attention of FlashInfer and vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab import native
from kvlab.attention.flash import FlashPrefillKernel, FlashPrefixKernel, flash_prefix_kernel
from kvlab.attention.kernels import (
    KVWriteKernel,
    PagedAfterPrefixKernel,
    PagedAttentionKernel,
    paged_after_prefix_kernel,
)
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
    # [L, ctx] additive causal mask over the cached prefix (``causal_bias_with_offset``), built once a step for
    # every layer; None when fresh.
    bias: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class SingleQueryRows:
    """Reference path: the requests with one query token this step (a decode token, or a one-token prompt or
    chunk), one row each, attended together over their gathered contexts."""

    rows: torch.Tensor  # [B1] flat rows, ascending
    context_slots: torch.Tensor  # [B1, max_ctx] (padding points at slot 0, masked); after prefix_slots if set
    # [B1, 1, 1, max_ctx] additive: 0 = attend, -inf = padding. Built once per step: a boolean mask would
    # be turned into this very tensor inside SDPA in every layer (and SDPA is ~15% faster given it).
    mask: torch.Tensor
    request_ids: tuple[str, ...]  # per row (attention capture names what it records)
    # [P] the first P slots of every row's context, the same blocks in every table (a cached document all the
    # rows decode after): gathered once a layer and attended by all rows together; ``context_slots`` and
    # ``mask`` then hold each row's slots after them. None: each row gathers its whole context.
    prefix_slots: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class DraftRows:
    """Reference path: the requests verifying a speculative draft, each with its next token and its draft as query
    rows over its gathered context, attended together in one call (as single-query rows are): the rows padded to
    the longest draft, a padding row repeating its request's last query and masked as it is."""

    rows: torch.Tensor  # [R] the flat rows of every real query, request by request, ascending
    query_rows: torch.Tensor  # [B, Q] the flat row each (request, query) reads its query from, padding included
    picks: torch.Tensor  # [R] where each of ``rows`` is in the [B * Q] output
    context_slots: torch.Tensor  # [B, max_ctx] (padding points at slot 0, masked)
    mask: torch.Tensor  # [B, 1, Q, max_ctx] additive: query j of a request at position p sees slots 0 .. p


@dataclass(frozen=True, eq=False)
class ReferenceAttentionMetadata:
    """One step on the reference path (gather + SDPA): every row is a single-query row, a draft's row or in exactly
    one prefill segment."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    single_query: SingleQueryRows | None  # None: no request has a single query token this step
    prefills: tuple[PrefillSegment, ...]
    drafts: DraftRows | None = None  # None: no request verifies a draft this step (or attention is captured)


@dataclass(frozen=True)
class CascadeKernels:
    """The two compiled ops of a shared-prefix (cascade) decode: every row's query heads against the prefix's slots
    (the flash loop, queries of many rows in one tile), then each row over its own slots, merged."""

    prefix: FlashPrefixKernel
    after: PagedAfterPrefixKernel


def cascade_kernels(dtype: torch.dtype) -> CascadeKernels | None:
    """The ops for queries in ``dtype``, or None where they are missing. bf16 only: the fp32 flash loop's tiles
    are 16 queries of one head, and it lost to the row kernel below 16 rows (docs/performance.md, "Shared-prefix
    decode")."""
    prefix = flash_prefix_kernel(dtype) if dtype == torch.bfloat16 else None
    after = paged_after_prefix_kernel() if prefix is not None else None
    return CascadeKernels(prefix, after) if prefix is not None and after is not None else None


@dataclass(frozen=True, eq=False)
class KernelSharedPrefix:
    """Kernel path: the first ``slots`` of every kernel row's context are the same blocks, read once for all rows;
    each row's table and length after them."""

    slots: torch.Tensor  # [P] the shared blocks' slots, in order (P a whole number of blocks)
    block_tables: torch.Tensor  # [R, max_blocks - P / block_size] each row's table after the shared blocks
    context_lens: torch.Tensor  # [R] each row's slots after them, at least 1
    kernels: CascadeKernels


@dataclass(frozen=True, eq=False)
class KernelAttentionMetadata:
    """One step on the kernel path: the query rows ``kernel`` reads in place (every row of the step, in row order,
    unless ``rows`` names them), and the prefill chunks large enough to go to a tiled kernel instead."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    row_block_tables: torch.Tensor  # [R, max_blocks] the block table of the request each kernel row belongs to
    row_context_lens: torch.Tensor  # [R] the slots each row reads: query i of a chunk at start, start + i + 1
    kernel: PagedAttentionKernel
    # The flat rows the kernel computes, ascending; None: all T rows (then R == T). A chunk of many queries goes
    # to ``prefills`` (``tiled_queries``): blocks of queries against blocks of keys beat walking the whole context
    # once per query and head.
    rows: torch.Tensor | None = None
    prefills: tuple[PrefillSegment, ...] = ()
    # Set (kvlab.attention.flash), the prefill segments run through it, reading the cache through their slots;
    # None, they are gathered and run through SDPA.
    flash: FlashPrefillKernel | None = None
    # Set, the kernel rows share a prefix, attended once for all of them (the cascade); None, each row walks its
    # whole context.
    shared: KernelSharedPrefix | None = None
    # Set, each layer's new K/V is stored through it (``KVStorage.write``'s bits); None, through ``KVStorage.write``.
    write: KVWriteKernel | None = None

    def __post_init__(self) -> None:
        rows = self.slot_mapping.shape[0] if self.rows is None else self.rows.shape[0]
        if self.row_block_tables.shape[0] != rows or self.row_context_lens.shape[0] != rows:
            raise ValueError(
                f"KernelAttentionMetadata: one table and one length per row: {rows} rows, "
                f"{self.row_block_tables.shape[0]} tables, {self.row_context_lens.shape[0]} lengths"
            )
        if self.rows is None and self.prefills:
            raise ValueError("KernelAttentionMetadata: with prefill segments, name the kernel's rows")


AttentionMetadata = ReferenceAttentionMetadata | KernelAttentionMetadata

# Where the kernel path sends a chunk to the tiled SDPA. The kernel computes each query's scores over its whole
# context, one query and head at a time; SDPA gathers the context once and computes tiles of queries against
# tiles of keys. Counted in the kernel's scores (each query's context summed), SDPA wins from a few thousand
# over a cached prefix; over a fresh prompt the causal tiles waste work and the kernel's bf16 loads keep it ahead
# for longer (crossovers measured in the docs/performance.md, "Long context").
TILED_MIN_QUERIES = 4
TILED_MIN_SCORES_CACHED = 1 << 15
TILED_MIN_SCORES_FRESH = {torch.float32: 1 << 16, torch.bfloat16: 1 << 18}


def tiled_queries(start: int, num_queries: int, prompt_tokens: int, dtype: torch.dtype, flash: bool = False) -> int:
    """On the kernel path, how many of a request's chunk of ``num_queries`` queries after ``start`` cached slots go to
    a tiled kernel (``flash``: kvlab's, ``kvlab.attention.flash``; otherwise SDPA's): its first ones, the chunk's
    prompt queries (of ``prompt_tokens``), or none; the rest are rows of the paged kernel.

    A request's generated tokens (a draft verified; outputs recomputed after a preemption) are always rows, as the
    decode steps that sampled them computed them. With the flash kernels every prompt query goes to them, however
    short its prompt or chunk: the flash kernel's row and the row kernel's differ in their last bits (in bf16 or over
    an fp8 cache that changed answers), so a position's K/V then has the same bits whatever its prompt's length, its
    chunks, a cache hit before it or the other requests of its steps (docs/serving.md, "What changes an answer";
    ``kvlab fuzz --precision``). Without them, SDPA takes a prompt's queries where it beats the row kernel."""
    prompt = max(0, min(start + num_queries, prompt_tokens) - start)
    if flash or not prompt:
        return prompt
    if prompt < TILED_MIN_QUERIES or dtype not in TILED_MIN_SCORES_FRESH:
        return 0
    scores = prompt * start + prompt * (prompt + 1) // 2
    return prompt if scores >= (TILED_MIN_SCORES_CACHED if start else TILED_MIN_SCORES_FRESH[dtype]) else 0


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Batched single-query attention: q [B, H, D], k, v [B, ctx, Hkv, D], mask [B, 1, 1, ctx] (boolean, or
    additive float)."""
    gqa = q.shape[1] != k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa
    )
    return out.squeeze(2)


def draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Batched multi-query attention: q [B, Q, H, D] against k, v [B, ctx, Hkv, D] under mask [B, 1, Q, ctx]
    (additive); [B, Q, H, D]."""
    gqa = q.shape[2] != k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa
    )
    return out.transpose(1, 2)


def shared_prefix_decode_attention(
    q: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor],
    rest: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
) -> torch.Tensor:
    """Single-query attention of rows whose contexts begin with the same slots: q [B, H, D] against the shared
    prefix K/V [P, Hkv, D] (read once for all rows) and each row's own remaining K/V [B, T, Hkv, D] under
    ``mask`` [B, 1, 1, T] (additive; every row has at least one slot there). The two parts are merged by their
    log-sum-exp (the cascade scheme of FlashInfer and vLLM), in fp32 whatever the inputs' dtype."""
    b, h, d = q.shape
    kp, vp = (t.float() for t in prefix)
    kr, vr = (t.float() for t in rest)
    hkv = kp.shape[1]
    g = h // hkv
    qf = q.float().view(b, hkv, g, d) * d**-0.5
    # The prefix: every row's queries of a KV head in one matrix against that head's keys.
    qp = qf.permute(1, 0, 2, 3).reshape(hkv, b * g, d)
    s1 = torch.matmul(qp, kp.permute(1, 2, 0))  # [Hkv, B*G, P]
    l1 = torch.logsumexp(s1, dim=-1, keepdim=True)
    o1 = torch.matmul(torch.exp(s1 - l1), vp.transpose(0, 1))  # [Hkv, B*G, D]
    o1 = o1.view(hkv, b, g, d).transpose(0, 1)
    l1 = l1.view(hkv, b, g, 1).transpose(0, 1)
    # Each row's own slots after it.
    s2 = torch.matmul(qf, kr.permute(0, 2, 3, 1)) + mask.float()  # [B, Hkv, G, T]
    l2 = torch.logsumexp(s2, dim=-1, keepdim=True)
    o2 = torch.matmul(torch.exp(s2 - l2), vr.transpose(1, 2))  # [B, Hkv, G, D]
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).reshape(b, h, d).to(q.dtype)


class PagedAttention:
    """The ``AttentionBackend`` the engine hands the model for one step."""

    def __init__(self, storage: KVStorage, meta: AttentionMetadata, capture: AttentionCapture | None = None) -> None:
        self.storage = storage
        self.meta = meta
        self.capture = capture

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        write = meta.write if isinstance(meta, KernelAttentionMetadata) else None
        if write is None:
            self.storage.write(layer, meta.slot_mapping, k, v)
        else:
            write(self.storage.k_cache[layer], self.storage.v_cache[layer], meta.slot_mapping, k, v)
        if isinstance(meta, KernelAttentionMetadata):
            return self._kernel_rows(layer, q, meta)
        return self._reference(layer, q, meta)

    def _kernel_rows(self, layer: int, q: torch.Tensor, meta: KernelAttentionMetadata) -> torch.Tensor:
        if meta.rows is None:  # every row is a kernel row, in row order: the kernel's output is the layer's
            return self._kernel(layer, q, meta)
        out = torch.empty_like(q)
        if meta.rows.numel():
            out[meta.rows] = self._kernel(layer, q[meta.rows], meta)
        if meta.flash is not None:
            self._flash_segments(layer, q, meta.prefills, meta.flash, out)
        else:
            self._prefill_segments(layer, q, meta.prefills, out)
        return out

    def _flash_segments(
        self,
        layer: int,
        q: torch.Tensor,
        segments: tuple[PrefillSegment, ...],
        flash: FlashPrefillKernel,
        out: torch.Tensor,
    ) -> None:
        kc, vc = self.storage.k_cache[layer], self.storage.v_cache[layer]
        scale = q.shape[-1] ** -0.5
        for seg in segments:
            n = seg.row_end - seg.row_start
            start = seg.context_slots.shape[0] - n  # the chunk's queries are the context's last n positions
            args = (q[seg.row_start : seg.row_end], kc, vc, seg.context_slots, start, scale)
            out[seg.row_start : seg.row_end] = native.call_labelled("kvlab::flash_prefill", flash, *args)

    def _kernel(self, layer: int, q: torch.Tensor, meta: KernelAttentionMetadata) -> torch.Tensor:
        kc, vc = self.storage.k_cache[layer], self.storage.v_cache[layer]
        scale = q.shape[-1] ** -0.5
        shared = meta.shared
        if shared is None:
            args = (q, kc, vc, meta.row_block_tables, meta.row_context_lens, scale)
            return native.call_labelled("kvlab::paged_decode", meta.kernel, *args)
        prefix_out, prefix_lse = native.call_labelled(
            "kvlab::flash_prefix", shared.kernels.prefix, q, kc, vc, shared.slots, scale
        )
        args_after = (q, kc, vc, shared.block_tables, shared.context_lens, scale, prefix_out, prefix_lse)
        return native.call_labelled("kvlab::paged_decode_after_prefix", shared.kernels.after, *args_after)

    def _reference(self, layer: int, q: torch.Tensor, meta: ReferenceAttentionMetadata) -> torch.Tensor:
        single = meta.single_query
        if not meta.prefills and meta.drafts is None:
            # Every row is a single-query row, in row order (the runner never runs the model on zero rows).
            assert single is not None
            return self._single_rows(layer, q, single)
        out = torch.empty_like(q)
        if single is not None:
            out[single.rows] = self._single_rows(layer, q[single.rows], single)
        if meta.drafts is not None:
            d = meta.drafts
            kc, vc = self.storage.gather(layer, d.context_slots, q.dtype)
            queries = q[d.query_rows.reshape(-1)].view(*d.query_rows.shape, *q.shape[1:])
            out[d.rows] = draft_attention(queries, kc, vc, d.mask).flatten(0, 1)[d.picks]
        self._prefill_segments(layer, q, meta.prefills, out)
        return out

    def _prefill_segments(
        self, layer: int, q: torch.Tensor, segments: tuple[PrefillSegment, ...], out: torch.Tensor
    ) -> None:
        for seg in segments:
            kc, vc = self.storage.gather(layer, seg.context_slots, q.dtype)
            out[seg.row_start : seg.row_end] = prefill_attention(
                q[seg.row_start : seg.row_end], kc, vc, seg.q_positions, seg.fresh, seg.bias
            )
            if self.capture is not None and self.capture.wants(seg.request_id, layer):
                mask = causal_mask_with_offset(seg.q_positions, kc.shape[0])
                self.capture.record(
                    seg.request_id, layer, q[seg.row_start : seg.row_end], kc, mask, seg.q_positions.tolist()
                )

    def _single_rows(self, layer: int, q: torch.Tensor, single: SingleQueryRows) -> torch.Tensor:
        """The single-query rows' output; ``q`` holds those rows only, in order."""
        kc, vc = self.storage.gather(layer, single.context_slots, q.dtype)
        if single.prefix_slots is not None:  # never with capture on (the runner's rule)
            prefix = self.storage.gather(layer, single.prefix_slots, q.dtype)
            return shared_prefix_decode_attention(q, prefix, (kc, vc), single.mask)
        if self.capture is not None:
            self._capture_single(self.capture, layer, q, kc, single)
        return decode_attention(q, kc, vc, single.mask)

    @staticmethod
    def _capture_single(
        capture: AttentionCapture, layer: int, q: torch.Tensor, kc: torch.Tensor, single: SingleQueryRows
    ) -> None:
        for i, rid in enumerate(single.request_ids):
            if capture.wants(rid, layer):
                ctx = int((single.mask[i] == 0).sum())
                mask = torch.ones(1, ctx, dtype=torch.bool)
                capture.record(rid, layer, q[i : i + 1], kc[i, :ctx], mask, [ctx - 1])  # q: these rows only
