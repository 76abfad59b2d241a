"""Turns a scheduled batch into flat tensors, runs the model over the paged cache, returns logits.

Metadata is built once per step and shared by every layer: ``input_ids``, ``positions``,
``cu_seqlens_q`` (checked), ``slot_mapping``, and for attention the context slots each request reads
through its block table. With the sanitizer on, every write is shadowed and every read is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.attention.kernels import KERNEL_DTYPES, KERNEL_HEAD_DIMS, PagedDecode
from kvlab.attention.paged import AttentionMetadata, PagedAttention, PrefillSegment
from kvlab.attention.varlen import build_cu_seqlens, check_cu_seqlens
from kvlab.engine.request import Request
from kvlab.engine.scheduler import ScheduledBatch
from kvlab.instrument.attention import AttentionCapture
from kvlab.instrument.sanitizer import KVSanitizer, Violation
from kvlab.kv import KVCacheManager, KVStorage
from kvlab.model.llama import LlamaModel


@dataclass
class PreparedStep:
    """A batch as flat tensors and attention metadata: everything the model forward needs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # flat row whose logits each sampling request takes
    requests: list[Request]  # the sampling requests, in the order of sample_rows
    violations: list[Violation] = field(default_factory=list)


@dataclass
class StepResult:
    requests: list[Request]  # requests whose whole sequence is now computed: they sample a token
    logits: torch.Tensor  # [len(requests), vocab]
    violations: list[Violation] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCacheManager,
        storage: KVStorage,
        sanitizer: KVSanitizer | None = None,
        filter_empty: bool = True,
        capture: AttentionCapture | None = None,
        decode_kernel: PagedDecode | None = None,
    ) -> None:
        self.model = model
        # The in-place decode kernel serves fp32/bf16 NHD caches of the head sizes it is built for, without
        # attention capture (capture needs the gathered K); any other step takes the reference gather + SDPA.
        usable = (
            storage.layout == "NHD"
            and storage.dtype in KERNEL_DTYPES
            and model.dtype in KERNEL_DTYPES
            and model.config.head_dim in KERNEL_HEAD_DIMS
        )
        self.decode_kernel = decode_kernel if usable and capture is None else None
        self.kv = kv
        self.storage = storage
        self.sanitizer = sanitizer
        self.filter_empty = filter_empty
        self.capture = capture
        self.block_size = kv.block_size

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        """Scheduler output -> flat tensors and metadata (and, with the sanitizer, this step's checks)."""
        entries = batch.scheduled
        if self.filter_empty:
            entries = [e for e in entries if e.num_tokens > 0]
        lengths = [e.num_tokens for e in entries]
        cu_q = build_cu_seqlens(lengths)
        check_cu_seqlens(cu_q, sum(lengths), allow_empty=not self.filter_empty)

        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_ids: list[str] = []
        decode_tables: list[list[int]] = []  # one per request with rows in decode_rows
        decode_counts: list[int] = []  # its rows: 1 for a decode token, a whole chunk through the kernel
        decode_lens: list[int] = []  # per row: the slots it reads
        prefills: list[PrefillSegment] = []
        samplers: list[tuple[Request, int]] = []
        for e, row in zip(entries, cu_q[:-1], strict=True):
            req, start, n = e.request, e.start, e.num_tokens
            ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(e.slots)
            ctx = start + n
            if n == 1 or (n and self.decode_kernel is not None):
                # A single query, or a prefill chunk whose queries go to the in-place kernel one row each: query i
                # of the chunk reads the first start + i + 1 slots (this chunk's own K/V is written before any
                # layer reads), the causal mask over the cached prefix, without a gather: reading K/V where it
                # lies beats gathering it for SDPA for prefill chunks too, not only for single decode queries.
                decode_rows.extend(range(row, row + n))
                decode_ids.extend([req.request_id] * n)
                decode_tables.append(self.kv.block_table(req.request_id))
                decode_counts.append(n)
                decode_lens.extend(range(start + 1, ctx + 1))
            elif n > 1:
                prefills.append(
                    PrefillSegment(
                        row,
                        row + n,
                        self.storage.context_slots(self.kv.block_table(req.request_id), ctx),
                        torch.arange(start, ctx),
                        fresh=start == 0,
                        request_id=req.request_id,
                    )
                )
            if ctx == req.num_tokens or n == 0:
                # The sampled row is the request's last query token. With filter_empty=False an empty
                # request has no row of its own and this index lands on its neighbour's last token:
                # the leak the empty-request strategy reproduces.
                samplers.append((req, row + n - 1))

        san = self.sanitizer
        violations = self._sanitize(san, entries, batch.step) if san else []
        if san and not self.filter_empty:
            violations += self._foreign_rows(san, entries, cu_q, ids, positions, batch.step)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long),
            decode_context_slots=torch.empty(0, 0, dtype=torch.long),
            decode_mask=torch.empty(0),
            prefills=prefills,
            decode_request_ids=decode_ids,
        )
        if decode_rows and self.decode_kernel is not None:
            meta.decode_kernel = self.decode_kernel
            tables = self._padded_tables(decode_tables, max(decode_lens))
            if len(decode_tables) < len(decode_rows):  # a table row for each query row of a chunk
                tables = tables.repeat_interleave(torch.tensor(decode_counts), dim=0)
            meta.decode_block_tables = tables
            meta.decode_lens = torch.tensor(decode_lens, dtype=torch.long)
        elif decode_rows:
            meta.decode_context_slots, meta.decode_mask = self._decode_slots(decode_tables, decode_lens)
        # An empty request first in the batch gets row -1, which wraps to the last request's row,
        # as an unchecked index would: the leak is real, not simulated.
        return PreparedStep(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            [r for _, r in samplers],
            [r for r, _ in samplers],
            violations,
        )

    @torch.inference_mode()
    def forward(self, prep: PreparedStep) -> torch.Tensor:
        """The model over the paged cache; logits [len(prep.requests), vocab] of the sampled rows only."""
        cfg = self.model.config
        if not prep.input_ids.numel():
            return torch.empty(0, cfg.vocab_size)
        hidden = self.model(prep.input_ids, prep.positions, PagedAttention(self.storage, prep.meta, self.capture))
        rows = prep.sample_rows
        return self.model.compute_logits(hidden[rows]) if rows else torch.empty(0, cfg.vocab_size)

    def _padded_tables(self, tables: list[list[int]], max_ctx: int) -> torch.Tensor:
        max_blocks = -(-max_ctx // self.block_size)
        # One tensor from padded lists: building a tensor per row costs a fixed overhead per row.
        rows = [t[:max_blocks] for t in tables]
        return torch.tensor([t + [0] * (max_blocks - len(t)) for t in rows], dtype=torch.long)

    def _decode_slots(self, tables: list[list[int]], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        max_ctx = max(lens)
        padded = self._padded_tables(tables, max_ctx)
        pos = torch.arange(max_ctx)
        slots = padded[:, pos // self.block_size] * self.block_size + pos % self.block_size
        padding = pos[None, :] >= torch.tensor(lens)[:, None]
        bias = torch.zeros(padding.shape, dtype=self.model.dtype).masked_fill_(padding, float("-inf"))
        return slots, bias[:, None, None, :]

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
        for e in entries:
            if e.num_tokens == 0:
                continue
            req, start, end = e.request, e.start, e.start + e.num_tokens
            digests = req.context_digests(end)
            san.record_write(
                req.request_id,
                e.slots,
                req.all_token_ids[start:end],
                list(range(start, end)),
                step,
                context=digests[start:end],
            )
        found: list[Violation] = []
        for e in entries:
            if e.num_tokens == 0:
                continue
            req, ctx = e.request, e.start + e.num_tokens
            slots = self.storage.context_slots(self.kv.block_table(req.request_id), ctx).tolist()
            found += san.check_read(
                req.request_id,
                slots,
                req.all_token_ids[:ctx],
                list(range(ctx)),
                step,
                context=req.context_digests(ctx),
            )
        return found
