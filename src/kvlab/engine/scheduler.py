"""Continuous batching: which requests advance this step, and by how many tokens.

Every step, running requests go first (a decode token, or the next chunk of a prompt), then waiting
requests are admitted while ``max_num_seqs`` and the token budget ``max_num_batched_tokens`` allow. A
prompt longer than the remaining budget is prefilled in chunks. When the pool runs dry a running request
is preempted: its blocks are freed and it goes back to the front of its queue to be recomputed (its
prefix may still hit the cache).

Tenants share the engine fairly. Requests carry a ``tenant`` (the server's API-key tenant; None for every
request of an offline run, which is then plain first come, first served). Admission takes the head of the
queue of the tenant running the fewest sequences (ties: the earliest arrival), so a flood from one tenant
cannot queue ahead of another's single request; first come, first served within a tenant. A tenant whose
head finds no seat or no blocks, while another tenant runs more sequences than it would after giving one
up, takes one: the other tenant's newest sequence is preempted (recomputed later, from the cache where its
blocks survive). The victim of a dry pool is likewise the newest sequence of the tenant running the most.
With one tenant every rule reduces to the plain one: FCFS, and the most recently admitted goes first.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvlab.config import SchedulerConfig, blocks_for
from kvlab.engine.request import Request, RequestStatus
from kvlab.engine.speculative import NgramIndex
from kvlab.kv import Allocation, Keying, KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # query tokens this step, a draft's included; 0 only on the unsafe filter_empty=False path
    slots: list[int]
    draft: list[int] = field(default_factory=list)  # speculative tokens after the request's own (engine.speculative)

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def num_verified(self) -> int:
        """Query tokens that are the request's own (the rest is the draft)."""
        return self.num_tokens - len(self.draft)

    @property
    def token_ids(self) -> list[int]:
        """The query tokens: the request's next ones, then the draft."""
        start = self.start
        return self.request.all_token_ids[start : start + self.num_verified] + self.draft


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


class WaitingQueue:
    """Waiting requests, one first-come-first-served queue per tenant (a preempted request goes back to the
    front of its own). Iterating visits every request; ``heads`` the front of each tenant's queue."""

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[Request]] = {}
        self._len = 0

    def append(self, req: Request) -> None:
        self._queues.setdefault(req.tenant, deque()).append(req)
        self._len += 1

    def appendleft(self, req: Request) -> None:
        self._queues.setdefault(req.tenant, deque()).appendleft(req)
        self._len += 1

    def remove(self, req: Request) -> None:
        queue = self._queues[req.tenant]
        queue.remove(req)
        self._len -= 1
        if not queue:
            del self._queues[req.tenant]  # heads() visits only tenants with work

    def heads(self) -> list[Request]:
        return [q[0] for q in self._queues.values()]

    def oldest(self) -> Request:
        return min(self.heads(), key=lambda r: r.metrics.arrival_time)

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and req in self._queues.get(req.tenant, ())

    def __iter__(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue

    def __len__(self) -> int:
        return self._len


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue()
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
        self._make_room_for_waiting_tenants(batch)
        fairness_preemptions = len(batch.preempted)

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
            draft = self._draft(req, n, budget)
            alloc = self._draft_slots(req, draft) if draft else None
            if alloc is None or not alloc.ok:  # a draft never costs another request its blocks
                draft = []
                alloc = self._slots_or_preempt(req, n, batch, i)
            if alloc is None:
                continue  # req itself was preempted: running[i] is now the request behind it
            batch.scheduled.append(ScheduledRequest(req, n + len(draft), alloc.slots, draft))
            batch.copies.extend(alloc.copies)
            budget -= n + len(draft)
            i += 1

        if len(batch.preempted) == fairness_preemptions:  # the pool did not run dry: there is room to admit
            self._admit(batch, budget)
        # Fairness's victims wait out admission aside: back in their queues they would be their tenants' heads, not
        # the heads fairness weighed, and the one whose tenant now runs the fewest would take its seat straight back.
        for victim in batch.preempted[:fairness_preemptions]:
            self.waiting.appendleft(victim)
        return batch

    def _draft(self, req: Request, n: int, budget: int) -> list[int]:
        """Speculative tokens for a greedy decode step (``SchedulerConfig.speculative``): within the budget, the
        tokens the request may still generate and ``max_model_len``."""
        spec = self.config.speculative
        # A decode step proper: not the last token of a prompt (its first output is sampled as a plain step's,
        # with the prompt's logprobs and the fork of n > 1).
        if spec is None or n != 1 or not req.output_token_ids or req.num_computed_tokens != req.num_tokens - 1:
            return []
        p = req.params
        if not p.greedy or p.n != 1:
            return []  # vLLM verifies sampled drafts by rejection sampling; kvlab drafts for greedy requests only
        limit = min(budget - 1, self.config.max_model_len - req.num_tokens)
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - len(req.output_token_ids) - 1)
        if req.drafter is None:
            req.drafter = NgramIndex()
        return req.drafter.propose(req.prompt_token_ids, req.output_token_ids, spec, limit)

    def _draft_slots(self, req: Request, draft: list[int]) -> Allocation:
        """Slots for the request's next token and its draft; a failure changes nothing."""
        spec = self.config.speculative
        assert spec is not None
        # The unsafe commit_rejected records the draft as the request's tokens at once (KVCacheManager.take_back).
        num_draft = 0 if spec.commit_rejected else len(draft)
        return self.kv.append_slots(req.request_id, [req.output_token_ids[-1], *draft], num_draft=num_draft)

    def _slots_or_preempt(self, req: Request, n: int, batch: ScheduledBatch, i: int) -> Allocation | None:
        """Slots for ``req`` (``running[i]``), preempting requests not yet scheduled this step (``running[i:]``)
        until the pool has them; None when ``req`` itself had to go."""
        tokens = req.all_token_ids[req.num_computed_tokens : req.num_computed_tokens + n]
        while True:
            alloc = self.kv.append_slots(req.request_id, tokens)
            if alloc.ok:
                return alloc
            victim = self._newest_of_busiest(self.running[i:])
            assert victim is not None  # req itself is a candidate
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return None

    def _newest_of_busiest(self, candidates: list[Request], exclude: object = ...) -> Request | None:
        """The most recently admitted of ``candidates`` whose tenant runs the most sequences (a tie goes to the
        tenant owning the newest candidate); ``exclude``: a tenant that is not to give one up."""
        counts = self._seats_by_tenant()
        newest: dict[str | None, int] = {r.tenant: k for k, r in enumerate(candidates) if r.tenant != exclude}
        if not newest:
            return None
        tenant = max(newest, key=lambda t: (counts[t], newest[t]))
        return candidates[newest[tenant]]

    def _seats_by_tenant(self) -> Counter[str | None]:
        counts: Counter[str | None] = Counter()
        for r in self.running:
            counts[r.tenant] += r.seats
        return counts

    def _make_room_for_waiting_tenants(self, batch: ScheduledBatch) -> None:
        """Preempt for a tenant whose waiting head finds no seat or no blocks, while another tenant runs more
        sequences than it would have after giving one up (never within a tenant: that is FCFS)."""
        if not self.waiting or not self.running:
            return
        counts = self._seats_by_tenant()
        heads = sorted(self.waiting.heads(), key=lambda r: (counts[r.tenant], r.metrics.arrival_time))
        # The seats of the heads before this one, which admission takes first. (Not their blocks: the block count
        # is an estimate with a spare per head, and summing spares would preempt for blocks admission never needs.)
        taken = 0
        for i, head in enumerate(heads):
            # Another tenant's sequence first (cheap, and None with one tenant), then whether the head fits.
            victim = self._newest_of_busiest(self.running, exclude=head.tenant)
            fits: bool | None = None  # whether the head fits now; None: not known since the last preemption
            while victim is not None and not (fits := self._fits(head, taken)):
                if counts[victim.tenant] - victim.seats < counts[head.tenant] + head.seats:
                    break  # the victim's tenant would end up with less than this one: not fairer
                self.preempt(victim, requeue=False)  # schedule() requeues it after admission
                batch.preempted.append(victim)
                counts[victim.tenant] -= victim.seats
                fits = None
                victim = self._newest_of_busiest(self.running, exclude=head.tenant)
            if i + 1 < len(heads):
                if not (self._fits(head, taken) if fits is None else fits):
                    # Admission takes the heads in this order and stops at one that does not fit: a seat freed for
                    # a head behind this one would stay empty this step, its sequence preempted for nothing.
                    break
                taken += head.seats
            counts[head.tenant] += head.seats  # the next head competes against this one as if admitted

    def _fits(self, req: Request, taken_seats: int = 0) -> bool:
        """Would admission find ``req`` a seat for each of its n sequences, after the ``taken_seats`` of the heads it
        admits first, and blocks for its prompt? (Its uncached blocks and the copy-on-write spare: an estimate;
        allocate() decides.)"""
        if sum(r.seats for r in self.running) + taken_seats + req.seats > self.config.max_num_seqs:
            return False
        bs = self.kv.block_size
        cached = self.kv.lookup(req.all_token_ids, req.cache_salt, req.public_prefix_tokens)
        needed = blocks_for(req.num_tokens, bs) - cached // bs + 1
        return self.kv.num_free_blocks() >= needed

    def preempt(self, req: Request, requeue: bool = True) -> None:
        """Free ``req``'s blocks and put it back at the front of its queue, to be recomputed (``requeue=False``: the
        caller puts it back)."""
        self.running.remove(req)
        if self.kv.has_request(req.request_id):
            self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if requeue:
            self.waiting.appendleft(req)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        admitted: list[Request] = []
        counts = self._seats_by_tenant()
        while self.waiting and budget > 0:
            # The tenant running the fewest sequences goes first; first come, first served among equals.
            req = min(self.waiting.heads(), key=lambda r: (counts[r.tenant], r.metrics.arrival_time))
            # Seats, not requests: a parent of n > 1 forks its siblings at its first token, in this very step.
            if counts.total() + req.seats > self.config.max_num_seqs:
                break
            if any(self._shares_pending_prefix(req, other) for other in admitted):
                # Its prefix is being computed by a request admitted this very step and becomes findable
                # only once written: waiting one step turns that prefix into a cache hit instead of a
                # second computation (SGLang's in-batch prefix check does the same).
                break
            if req.num_prompt_tokens == 0:  # unsafe path only: the engine rejects empty prompts otherwise
                self.waiting.remove(req)
                self._start(req)
                counts[req.tenant] += req.seats
                batch.scheduled.append(ScheduledRequest(req, 0, []))
                continue
            # Without chunking, the whole uncached prompt must fit this step's budget before it is admitted.
            uncached = (
                None
                if self.config.enable_chunked_prefill
                else req.num_tokens - self.kv.lookup(req.all_token_ids, req.cache_salt, req.public_prefix_tokens)
            )
            if uncached is not None and uncached > budget:
                break
            # allocate() matches the prefix itself and hands out at most `budget` slots: one match per admission.
            alloc = self.kv.allocate(
                req.request_id,
                req.all_token_ids,
                req.cache_salt,
                num_tokens=budget,
                public_prefix_tokens=req.public_prefix_tokens,
                tenant=req.tenant,
            )
            if not alloc.ok:
                break  # nobody overtakes the head it chose: a large request is never starved by small ones
            n = len(alloc.slots)
            req.num_computed_tokens = alloc.num_cached_tokens
            self.waiting.remove(req)
            admitted.append(req)
            counts[req.tenant] += req.seats
            if req.num_cached_tokens is None:
                req.num_cached_tokens = alloc.num_cached_tokens
                req.num_public_cached_tokens = alloc.num_public_cached_tokens
            self._start(req)
            batch.scheduled.append(ScheduledRequest(req, n, alloc.slots))
            batch.copies.extend(alloc.copies)
            budget -= n

    def _shares_pending_prefix(self, req: Request, other: Request) -> bool:
        """Would ``req`` share a block that ``other``, admitted this step, is about to compute?

        ``other`` computes from its cache hit onwards; the block right after that hit is the first one it
        writes. Only if ``req`` holds that same block (both key every block up to it alike: the same salt and
        public prefix, or blocks public for both; and the same tokens up to its end) is waiting a step worth it: a
        prefix both already find in the cache is shared at once.
        """
        if not self.kv.config.share_prefix:
            return False
        bs = self.kv.block_size
        end = (other.num_computed_tokens // bs + 1) * bs
        if not self._keying(req).agrees(self._keying(other), end // bs):
            return False
        a, b = req.all_token_ids, other.all_token_ids
        return len(a) > end and len(b) >= end and a[:end] == b[:end]

    def _keying(self, req: Request) -> Keying:
        return self.kv.keying_of(req.all_token_ids, req.cache_salt, req.public_prefix_tokens)

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
