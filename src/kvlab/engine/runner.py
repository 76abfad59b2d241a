"""Turns a scheduled batch into flat tensors, runs the model over the paged cache, returns logits.

Metadata is built once per step and shared by every layer: ``input_ids``, ``positions``,
``cu_seqlens_q`` (checked), ``slot_mapping``, and for attention what each row reads through its request's
block table: for the reference path the gathered context slots of its single-query rows, draft rows and prefill
segments (``ReferenceAttentionMetadata``), for the compiled kernel one block table and context length per query row
(``KernelAttentionMetadata``). With the sanitizer on, every write is shadowed and every read is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.attention.flash import FLASH_DTYPES, FLASH_HEAD_DIMS, FlashPrefillKernel
from kvlab.attention.kernels import (
    FP8_DTYPES,
    KERNEL_CACHE_DTYPES,
    KERNEL_DTYPES,
    KERNEL_HEAD_DIMS,
    PagedAttentionKernel,
    kv_write_kernel,
)
from kvlab.attention.paged import (
    AttentionMetadata,
    CascadeKernels,
    DraftRows,
    KernelAttentionMetadata,
    KernelSharedPrefix,
    PagedAttention,
    PrefillSegment,
    ReferenceAttentionMetadata,
    SingleQueryRows,
    tiled_queries,
)
from kvlab.attention.varlen import build_cu_seqlens, causal_bias_with_offset, check_cu_seqlens
from kvlab.config import blocks_for
from kvlab.engine.heap import freeze_live_objects, retain_freed_memory
from kvlab.engine.request import Request
from kvlab.engine.scheduler import ScheduledBatch, ScheduledRequest
from kvlab.instrument.attention import AttentionCapture
from kvlab.instrument.sanitizer import KVSanitizer, Namespace, Violation, prefix_digests
from kvlab.kv import KVCacheManager, KVStorage
from kvlab.model.llama import LlamaModel

# Reference path: single-query rows whose tables begin with this many slots in common read them once for all
# (``SingleQueryRows.prefix_slots``); below it, gathering each row's whole context costs no more
# (docs/performance.md, "Long context").
SHARED_PREFIX_MIN_SLOTS = 256
# Kernel path (bf16): kernel rows whose tables begin with the same blocks attend them once for all (the cascade,
# ``KernelSharedPrefix``) from this many rows and shared slots; below, the flash loop's tile of 8 queries and its
# packing of the prefix cost about what each row's walk over it does (docs/performance.md, "Shared-prefix decode").
CASCADE_MIN_ROWS = 8
CASCADE_MIN_SLOTS = 512


@dataclass
class PreparedStep:
    """A batch as flat tensors and attention metadata: everything the model forward needs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # flat rows whose logits the sampling requests take: one each, 1 + draft with a draft
    requests: list[Request]  # the sampling requests, in the order of sample_rows
    violations: list[Violation] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per sampling request: its draft (mostly empty)
    draft_slots: list[list[int]] = field(default_factory=list)  # per sampling request: the slots its draft took


@dataclass
class StepResult:
    requests: list[Request]  # requests whose whole sequence is now computed: they sample a token
    logits: torch.Tensor  # [rows, vocab]: one row per request, 1 + its draft's length for a request with a draft
    violations: list[Violation] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per request (empty: none), as PreparedStep.drafts
    draft_slots: list[list[int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCacheManager,
        storage: KVStorage,
        sanitizer: KVSanitizer | None = None,
        filter_empty: bool = True,
        capture: AttentionCapture | None = None,
        attention_kernel: PagedAttentionKernel | None = None,
        flash_kernel: FlashPrefillKernel | None = None,
        cascade: CascadeKernels | None = None,
    ) -> None:
        retain_freed_memory()  # a step's temporaries reused by the next, not faulted in fresh (engine.heap)
        self.model = model
        # The in-place attention kernel serves fp32/bf16/fp8 NHD caches of the head sizes it is built for, without
        # attention capture (capture needs the gathered K); any other step takes the reference gather + SDPA.
        usable = (
            storage.layout == "NHD"
            and storage.dtype in KERNEL_CACHE_DTYPES
            and model.dtype in KERNEL_DTYPES
            and model.config.head_dim in KERNEL_HEAD_DIMS
        )
        # Set, every step's query rows run through it (KernelAttentionMetadata); None, the reference path.
        self.attention_kernel = attention_kernel if usable and capture is None else None
        # Beside it, long prefill chunks run through the flash kernel.
        self.flash_kernel = (
            flash_kernel
            if self.attention_kernel is not None
            and model.dtype in FLASH_DTYPES
            and model.config.head_dim in FLASH_HEAD_DIMS
            else None
        )
        # With it, kernel rows that share a prefix attend it once (needs the flash loop's dtype and head size).
        self.cascade = cascade if self.flash_kernel is not None else None
        # And each layer's new K/V goes into the cache by the compiled write where it comes in the cache's dtype or
        # is rounded into fp8 (as the reference's `.to()` rounds).
        in_place = self.attention_kernel is not None and (storage.dtype == model.dtype or storage.dtype in FP8_DTYPES)
        self.kv_write = kv_write_kernel() if in_place else None
        self.kv = kv
        self.storage = storage
        self.sanitizer = sanitizer
        self.filter_empty = filter_empty
        self.capture = capture
        self.block_size = kv.block_size
        freeze_live_objects()  # the first engine's build: no collection walks what exists now again (engine.heap)

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        """Scheduler output -> flat tensors and metadata (and, with the sanitizer, this step's checks)."""
        entries = batch.scheduled
        if self.filter_empty:
            entries = [e for e in entries if e.num_tokens > 0]
        lengths = [e.num_tokens for e in entries]
        cu_q = build_cu_seqlens(lengths)
        check_cu_seqlens(cu_q, sum(lengths), allow_empty=not self.filter_empty)

        kernel = self.attention_kernel
        flash = self.flash_kernel
        dtype = self.model.dtype
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []  # kernel: per request with rows; reference: per single-query row
        row_counts: list[int] = []  # kernel: the rows of each table (1 for a decode token, a whole chunk)
        context_lens: list[int] = []  # per kernel or single-query row: the slots it reads
        single_rows: list[int] = []
        single_ids: list[str] = []
        prefills: list[PrefillSegment] = []
        samplers: list[tuple[Request, int]] = []
        sample_rows: list[int] = []
        drafts: list[list[int]] = []
        draft_slots: list[list[int]] = []
        kernel_rows: list[int] = []
        drafted: list[tuple[int, int, int, list[int]]] = []  # reference path: (first row, rows, start, block table)
        for e, row in zip(entries, cu_q[:-1], strict=True):
            req, start, n = e.request, e.start, e.num_tokens
            ids.extend(e.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(e.slots)
            ctx = start + n
            if n and kernel is not None:
                # Its prompt queries may go to a tiled kernel, the rest are kernel rows (``tiled_queries``).
                tiled = tiled_queries(start, n, req.num_prompt_tokens, dtype, flash is not None)
                table = self.kv.block_table(req.request_id)
                if tiled:
                    prefills.append(self._segment(req.request_id, table, row, start, tiled, dtype, flash is not None))
                if tiled < n:
                    # Query i of the rows reads the first start + i + 1 slots (this step's K/V is written before any
                    # layer reads): the causal mask over the cached prefix, without a gather.
                    tables.append(table)
                    row_counts.append(n - tiled)
                    context_lens.extend(range(start + tiled + 1, ctx + 1))
                    kernel_rows.extend(range(row + tiled, row + n))
            elif n == 1:
                single_rows.append(row)
                single_ids.append(req.request_id)
                tables.append(self.kv.block_table(req.request_id))
                context_lens.append(ctx)
            elif e.draft and self.capture is None:
                drafted.append((row, n, start, self.kv.block_table(req.request_id)))
            elif n:
                prefills.append(
                    self._segment(req.request_id, self.kv.block_table(req.request_id), row, start, n, dtype, False)
                )
            if start + e.num_verified == req.num_tokens or n == 0:
                # The sampled row is the request's last query token. With filter_empty=False an empty
                # request has no row of its own and this index lands on its neighbour's last token:
                # the leak the empty-request strategy reproduces. A draft adds a row per draft token.
                samplers.append((req, row + n - 1))
                first = row + n - 1 - len(e.draft)
                sample_rows.extend(range(first, row + n))
                drafts.append(e.draft)
                draft_slots.append(e.slots[len(e.slots) - len(e.draft) :] if e.draft else [])

        san = self.sanitizer
        violations = self._sanitize(san, entries, batch.step) if san else []
        if san and not self.filter_empty:
            violations += self._foreign_rows(san, entries, cu_q, ids, positions, batch.step)
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        meta: AttentionMetadata
        if kernel is not None:
            row_tables = self._row_tables(tables, row_counts, context_lens)
            row_lens = torch.tensor(context_lens, dtype=torch.long)
            meta = KernelAttentionMetadata(
                slot_mapping,
                row_block_tables=row_tables,
                row_context_lens=row_lens,
                kernel=kernel,
                rows=torch.tensor(kernel_rows, dtype=torch.long) if prefills else None,
                prefills=tuple(prefills),
                flash=flash if prefills else None,
                shared=self._kernel_shared_prefix(tables, row_tables, row_lens, context_lens),
                write=self.kv_write,
            )
        else:
            single = None
            if single_rows:
                context_slots, mask, prefix = self._single_query_slots(tables, context_lens)
                single = SingleQueryRows(
                    torch.tensor(single_rows, dtype=torch.long), context_slots, mask, tuple(single_ids), prefix
                )
            verifying = self._draft_rows(drafted) if drafted else None
            meta = ReferenceAttentionMetadata(slot_mapping, single, tuple(prefills), verifying)
        # An empty request first in the batch gets row -1, which wraps to the last request's row,
        # as an unchecked index would: the leak is real, not simulated.
        return PreparedStep(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            sample_rows,
            [r for r, _ in samplers],
            violations,
            drafts,
            draft_slots,
        )

    def _segment(
        self, request_id: str, table: list[int], row: int, start: int, n: int, dtype: torch.dtype, flash: bool
    ) -> PrefillSegment:
        """The ``n`` queries from context position ``start`` of a request (its block ``table``), flat rows from
        ``row``, as a tiled chunk."""
        ctx = start + n
        q_positions = torch.arange(start, ctx)
        return PrefillSegment(
            row,
            row + n,
            self.storage.context_slots(table, ctx),
            q_positions,
            fresh=start == 0,
            request_id=request_id,
            # The flash kernel masks by position itself.
            bias=None if start == 0 or flash else causal_bias_with_offset(q_positions, ctx, dtype),
        )

    @torch.inference_mode()
    def forward(self, prep: PreparedStep) -> torch.Tensor:
        """The model over the paged cache; logits [len(prep.sample_rows), vocab] of the sampled rows only."""
        cfg = self.model.config
        if not prep.input_ids.numel():
            return torch.empty(0, cfg.vocab_size)
        hidden = self.model(prep.input_ids, prep.positions, PagedAttention(self.storage, prep.meta, self.capture))
        rows = prep.sample_rows
        return self.model.compute_logits(hidden[rows]) if rows else torch.empty(0, cfg.vocab_size)

    def _padded_tables(self, tables: list[list[int]], max_ctx: int) -> torch.Tensor:
        max_blocks = blocks_for(max_ctx, self.block_size)
        # One tensor from padded lists: building a tensor per row costs a fixed overhead per row.
        rows = [t[:max_blocks] + [0] * (max_blocks - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.long).view(len(rows), max_blocks)  # [0, 0] without rows

    def _table_slots(self, tables: list[list[int]], positions: torch.Tensor) -> torch.Tensor:
        """[len(tables), len(positions)]: the slot of each position (ascending) in each table; a table too short for a
        position gives a slot of block 0, which the caller masks."""
        bs = self.block_size
        padded = self._padded_tables(tables, int(positions[-1]) + 1)
        return padded[:, positions // bs] * bs + positions % bs

    def _row_tables(self, tables: list[list[int]], row_counts: list[int], lens: list[int]) -> torch.Tensor:
        """Kernel path: each request's table (padded to the longest context), repeated for each of its rows."""
        padded = self._padded_tables(tables, max(lens, default=0))
        if len(tables) < len(lens):  # a table row for each query row of a chunk
            padded = padded.repeat_interleave(torch.tensor(row_counts), dim=0)
        return padded

    def _single_query_slots(
        self, tables: list[list[int]], lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Reference path: the gathered context slots of each single-query row, the additive padding mask, and
        the prefix slots all the rows share (None when they share too little; the rows' slots then start at 0)."""
        shared = 0 if self.capture is not None else self._shared_prefix_blocks(tables, lens, SHARED_PREFIX_MIN_SLOTS)
        shared *= self.block_size
        pos = torch.arange(shared, max(lens))
        slots = self._table_slots(tables, pos)
        padding = pos[None, :] >= torch.tensor(lens)[:, None]
        bias = torch.zeros(padding.shape, dtype=self.model.dtype).masked_fill_(padding, float("-inf"))
        prefix = self.storage.context_slots(tables[0], shared) if shared else None
        return slots, bias[:, None, None, :], prefix

    def _draft_rows(self, drafted: list[tuple[int, int, int, list[int]]]) -> DraftRows:
        """Reference path: the rows of the requests verifying a draft, each (first row, rows, start, block table),
        as one padded batch: query j of a request at position start + j sees its slots 0 .. start + j."""
        firsts, counts, starts = (torch.tensor(col, dtype=torch.long) for col in list(zip(*drafted, strict=True))[:3])
        width = int(counts.max())
        lens = starts + counts
        pos = torch.arange(int(lens.max()))
        slots = self._table_slots([t for *_, t in drafted], pos)
        # A padding query repeats its request's last one, mask row included: no row is masked whole.
        j = torch.minimum(torch.arange(width)[None, :], counts[:, None] - 1)  # [B, Q]
        allowed = pos[None, None, :] <= (starts[:, None] + j)[:, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype).masked_fill_(~allowed, float("-inf"))
        real = torch.arange(width)[None, :] < counts[:, None]
        return DraftRows(
            rows=(firsts[:, None] + j)[real],
            query_rows=firsts[:, None] + j,
            picks=torch.arange(real.numel()).view(real.shape)[real],
            context_slots=slots,
            mask=mask[:, None],
        )

    def _shared_prefix_blocks(self, tables: list[list[int]], lens: list[int], min_slots: int) -> int:
        """How many leading blocks every table of ``tables`` (one a request) holds in common, when they hold at
        least ``min_slots`` slots; each row (``lens``: the slots it reads) keeps at least one slot of its own after
        them. Both paths' shared-prefix decode ask it (the reference's gather, the kernel path's cascade)."""
        if len(tables) < 2:
            return 0
        limit = (min(lens) - 1) // self.block_size
        if limit * self.block_size < min_slots:
            return 0
        common = 0
        first = tables[0]
        while common < limit and all(len(t) > common and t[common] == first[common] for t in tables):
            common += 1
        return common if common * self.block_size >= min_slots else 0

    def _kernel_shared_prefix(
        self, tables: list[list[int]], row_tables: torch.Tensor, row_lens: torch.Tensor, lens: list[int]
    ) -> KernelSharedPrefix | None:
        """Kernel path: the cascade's view of the kernel rows (each request's table, each row's table and length),
        when at least CASCADE_MIN_ROWS rows share at least CASCADE_MIN_SLOTS leading slots."""
        if self.cascade is None or len(lens) < CASCADE_MIN_ROWS:
            return None
        common = self._shared_prefix_blocks(tables, lens, CASCADE_MIN_SLOTS)
        if not common:
            return None
        return KernelSharedPrefix(
            slots=self.storage.context_slots(tables[0], common * self.block_size),
            block_tables=row_tables[:, common:].contiguous(),
            context_lens=row_lens - common * self.block_size,
            kernels=self.cascade,
        )

    def _foreign_rows(
        self, san: KVSanitizer, entries: list, cu_q: list[int], ids: list[int], positions: list[int], step: int
    ) -> list[Violation]:
        """An empty request owns no row, so the row it samples belongs to another request: report it."""
        found = []
        total = cu_q[-1]
        for e, row in zip(entries, cu_q[:-1], strict=True):
            if e.num_tokens or not total:
                continue
            read = (row - 1) % total  # the wrap-around an unchecked index performs
            owner = next(o for o, start, end in zip(entries, cu_q[:-1], cu_q[1:], strict=True) if start <= read < end)
            found.append(
                Violation(
                    step=step,
                    reader=e.request.request_id,
                    block=-1,
                    slot=read,
                    position=-1,
                    expected_token=-1,
                    found_token=ids[read],
                    found_position=positions[read],
                    writer=owner.request.request_id,
                    written_step=step,
                )
            )
        san.violations += found
        return found

    def _sanitize(self, san: KVSanitizer, entries, step: int) -> list[Violation]:
        """Shadow this step's writes, then check every slot each request will attend to."""
        live = [e for e in entries if e.num_tokens]
        contexts = [self._context(e) for e in live]  # what each query reads, written first
        for e, (tokens, digests) in zip(live, contexts, strict=True):
            req, start, end = e.request, e.start, e.start + e.num_tokens
            san.record_write(
                req.request_id,
                e.slots,
                tokens[start:end],
                list(range(start, end)),
                step,
                context=digests[start:end],
                namespace=self.namespace(req),
                num_draft=len(e.draft),
            )
        found: list[Violation] = []
        for e, (tokens, digests) in zip(live, contexts, strict=True):
            req, ctx = e.request, e.start + e.num_tokens
            slots = self.storage.context_slots(self.kv.block_table(req.request_id), ctx).tolist()
            found += san.check_read(
                req.request_id,
                slots,
                tokens,
                list(range(ctx)),
                step,
                context=digests,
                namespace=self.namespace(req),
            )
        return found

    @staticmethod
    def _context(e: ScheduledRequest) -> tuple[list[int], list[int]]:
        """The tokens and prefix digests of every position the entry's query reads: the request's, then its draft."""
        req, own = e.request, e.start + e.num_verified
        digests = req.context_digests(own)
        if not e.draft:
            return req.all_token_ids[:own], digests
        return req.all_token_ids[:own] + e.draft, digests + prefix_digests(e.draft, digests[-1] if digests else 0)

    def namespace(self, req: Request) -> Namespace:
        """The request's namespace as the sanitizer sees it."""
        # From what the request declared, not from the KV manager's record of it: the check stays independent.
        return Namespace(req.cache_salt, req.public_prefix_tokens // self.block_size, req.tenant)
