"""Continuous batching: which requests advance this step, and by how many tokens.

Every step, running requests go first (a decode token, or the next chunk of a prompt), then waiting
requests are admitted first come, first served while ``max_num_seqs`` and the token budget
``max_num_batched_tokens`` allow. A prompt longer than the remaining budget is prefilled in chunks.
When the pool runs dry the most recently admitted running request is preempted: its blocks are freed
and it goes back to the front of the queue to be recomputed (its prefix may still hit the cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvlab.config import SchedulerConfig
from kvlab.engine.request import Request, RequestStatus
from kvlab.kv import Allocation, KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # query tokens this step; 0 only on the unsafe filter_empty=False path
    slots: list[int]

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens


@dataclass
class ScheduledBatch:
    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step = 0
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request, after: Request) -> None:
        """Put a forked sibling (n > 1) right behind ``after`` in the running batch: it already holds
        blocks, so it joins without admission, and it keeps its group together for preemption order."""
        self.running.insert(self.running.index(after) + 1, request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledBatch:
        self.step += 1
        batch = ScheduledBatch(self.step)
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_prompt_tokens == 0:
                # Unsafe path only: an empty request never owns a token, yet stays in every batch.
                batch.scheduled.append(ScheduledRequest(req, 0, []))
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.config.enable_chunked_prefill and req.num_computed_tokens < req.num_prompt_tokens:
                n = req.num_tokens - req.num_computed_tokens
                if n > budget:
                    break
            alloc = self._slots_or_preempt(req, n, batch)
            if alloc is None:
                break  # req itself was preempted; everyone behind it already was
            batch.scheduled.append(ScheduledRequest(req, n, alloc.slots))
            batch.copies.extend(alloc.copies)
            budget -= n
            i += 1

        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _slots_or_preempt(self, req: Request, n: int, batch: ScheduledBatch) -> Allocation | None:
        tokens = req.all_token_ids[req.num_computed_tokens : req.num_computed_tokens + n]
        while True:
            alloc = self.kv.append_slots(req.request_id, tokens)
            if alloc.ok:
                return alloc
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return None

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        if self.kv.has_request(req.request_id):
            self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        admitted: list[Request] = []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) + req.params.n > self.config.max_num_seqs:
                break
            if any(self._shares_pending_prefix(req, other) for other in admitted):
                # Its prefix is being computed by a request admitted this very step and becomes findable
                # only once written: waiting one step turns that prefix into a cache hit instead of a
                # second computation (SGLang's in-batch prefix check does the same).
                break
            if req.num_prompt_tokens == 0:  # unsafe path only: the engine rejects empty prompts otherwise
                self.waiting.popleft()
                self._start(req)
                batch.scheduled.append(ScheduledRequest(req, 0, []))
                continue
            # Without chunking, the whole uncached prompt must fit this step's budget before it is admitted.
            uncached = (
                None
                if self.config.enable_chunked_prefill
                else req.num_tokens - self.kv.lookup(req.all_token_ids, req.cache_salt)
            )
            if uncached is not None and uncached > budget:
                break
            # allocate() matches the prefix itself and hands out at most `budget` slots: one match per admission.
            alloc = self.kv.allocate(req.request_id, req.all_token_ids, req.cache_salt, num_tokens=budget)
            if not alloc.ok:
                break  # first come, first served: nobody overtakes the head of the queue
            n = len(alloc.slots)
            req.num_computed_tokens = alloc.num_cached_tokens
            self.waiting.popleft()
            admitted.append(req)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = alloc.num_cached_tokens
            self._start(req)
            batch.scheduled.append(ScheduledRequest(req, n, alloc.slots))
            batch.copies.extend(alloc.copies)
            budget -= n

    def _shares_pending_prefix(self, req: Request, other: Request) -> bool:
        """Would ``req`` share a block that ``other``, admitted this step, is about to compute?

        ``other`` computes from its cache hit onwards; the block right after that hit is the first one it
        writes. Only if ``req`` holds that same block (same salt, same tokens up to its end) is waiting a
        step worth it: a prefix both already find in the cache is shared at once.
        """
        if not self.kv.config.share_prefix or req.cache_salt != other.cache_salt:
            return False
        bs = self.kv.block_size
        end = (other.num_computed_tokens // bs + 1) * bs
        a, b = req.all_token_ids, other.all_token_ids
        return len(a) > end and len(b) >= end and a[:end] == b[:end]

    def _start(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()

    def finish(self, req: Request, reason: str, status: RequestStatus = RequestStatus.FINISHED) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.kv.has_request(req.request_id):
            self.kv.free(req.request_id)
        req.status = status
        req.finish_reason = reason
