"""Per-step attribution of one engine run, measured from outside the engine.

``StepMeter`` wraps a few bound methods of one engine's scheduler, KV manager and runner (instance
attributes shadowing the class's methods: nothing in ``kvlab.engine`` or ``kvlab.kv`` changes, and other
engines are untouched) and records, for every ``advance()``:

* what the step carried: requests, query tokens split into decode tokens, first-time prompt tokens and
  *recomputed* tokens (positions a preempted request had computed before it lost its blocks: the cost of a
  preemption, less what its re-admission found in the prefix cache), preemptions, copy-on-write copies,
  evictions, blocks in use, and the block-table entries the runner reads (the requests' table lengths);
* where the host time went: inside the KV manager's calls (the outermost call only: ``allocate`` calls
  ``append_slots`` itself), inside the runner's ``prepare`` (block tables -> slot mapping, context slots
  and tensors) and inside the scheduler's ``schedule`` (which includes its KV calls);
* optionally the fill of every block in use (``fragmentation=True``): slots filled, empty slots of
  partially filled blocks (internal fragmentation), whole blocks held empty (reserved for the rest of a
  prompt, or copy-on-write spares);
* optionally what a token-granular prefix cache could have reused at each admission
  (``prefix_potential=True``): the longest common prefix of the prompt with any sequence computed in an
  earlier step (a trie of every computed token), capped like a hit at ``len(prompt) - 1``. Against the hit
  the manager reports, the difference is what the cache did not reuse: with ``prefix_granularity="block"``
  the tokens lost to whole-block flooring (the trie ignores evictions: a pool that evicts also loses hits).

The meter's own bookkeeping is timed and left out: ``StepRecord.seconds`` is the step's wall time minus the
meter's work inside it, and ``clock`` runs on those clean seconds only, so latencies measured on it are the
engine's. Timings are measurements, never asserted in tests; the counts are deterministic. ``paused_gc()``
keeps Python's cyclic collector out of a measured run (as ``timeit`` does): a full collection lands in
whichever call happens to allocate, several milliseconds at once, and would be charged to it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvlab.config import CacheConfig, SchedulerConfig
from kvlab.engine.engine import Engine
from kvlab.engine.request import Request
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.scheduler import ScheduledBatch
from kvlab.kv import Allocation
from kvlab.model.loader import LoadedModel

# The manager's calls the scheduler and engine make in a step (lookup/num_free_blocks: admission checks).
KV_CALLS = ("lookup", "allocate", "append_slots", "free", "fork", "commit_writes", "num_free_blocks")

_Trie = dict[int, "_Trie"]


@dataclass(frozen=True)
class StepRecord:
    step: int
    seconds: float  # advance() wall time, the meter's own work left out
    kv_seconds: float  # inside the KV manager's calls
    prepare_seconds: float  # inside ModelRunner.prepare
    schedule_seconds: float  # inside Scheduler.schedule (its KV calls included)
    requests: int  # scheduled this step
    tokens: int  # query tokens this step
    decode_tokens: int  # positions past the prompt computed for the first time
    prefill_tokens: int  # prompt positions computed for the first time
    recompute_tokens: int  # positions computed before a preemption, computed again
    preemptions: int
    cow_copies: int
    evictions: int
    used_blocks: int  # blocks with refcount > 0 after the step
    table_entries: int  # sum of the scheduled requests' block-table lengths (what prepare walks)
    # With fragmentation=True (else 0): slots of the blocks in use, after the step.
    allocated_slots: int = 0
    filled_slots: int = 0
    partial_waste_slots: int = 0  # empty slots of partially filled blocks: internal fragmentation
    reserved_slots: int = 0  # slots of blocks held but still empty (rest of a prompt, CoW spares)


@dataclass(frozen=True)
class RequestTiming:
    """One request's arrival, first token and end, in engine steps and on the meter's clean clock."""

    request_id: str
    arrival_step: int  # the scheduler's step count when it was added (it runs from the next step on)
    first_step: int
    finish_step: int
    arrival_s: float
    first_s: float
    finish_s: float
    output_tokens: int
    preemptions: int

    @property
    def ttft_steps(self) -> int:
        return self.first_step - self.arrival_step

    @property
    def e2e_steps(self) -> int:
        return self.finish_step - self.arrival_step

    @property
    def tpot_steps(self) -> float:
        n = self.output_tokens - 1
        return (self.finish_step - self.first_step) / n if n > 0 else 0.0

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        n = self.output_tokens - 1
        return (self.finish_s - self.first_s) / n if n > 0 else 0.0


class StepMeter:
    def __init__(self, eng: Engine, fragmentation: bool = False, prefix_potential: bool = False) -> None:
        self.eng = eng
        self.kv = eng.kv
        self.fragmentation = fragmentation
        self.prefix_potential = prefix_potential
        self.records: list[StepRecord] = []
        self.timings: dict[str, RequestTiming] = {}
        self.clock = 0.0  # clean seconds: the sum of the steps' own times
        self.overhead_seconds = 0.0  # the meter's own work, left out of every figure
        self.hit_potential = 0  # prefix tokens a token-granular cache could have reused (prefix_potential)
        self.hit_actual = 0  # prefix tokens the manager reused, over the same admissions
        self.recomputed_tokens = 0
        self.preempted_requests: set[str] = set()
        # Per step, reset by advance().
        self._kv_s = self._prep_s = self._sched_s = self._inside = 0.0
        self._depth = 0
        self._batch: ScheduledBatch | None = None
        self._step_tokens: tuple[int, int, int] = (0, 0, 0)
        self._table_entries = 0
        self._preempted = 0
        self._computing: list[tuple[Request, int, int]] = []
        # Preempted requests: the positions they had computed (recomputing them is the preemption's cost).
        self._watermark: dict[str, int] = {}
        self._trie: _Trie = {}
        self._cursor: dict[str, tuple[int, _Trie]] = {}  # request -> (tokens inserted, trie node there)
        self._pending: dict[str, tuple[int, float]] = {}  # request -> (arrival step, arrival clock)
        self._first: dict[str, tuple[int, float]] = {}
        self._num_free_blocks = eng.kv.num_free_blocks
        for name in KV_CALLS:
            setattr(eng.kv, name, self._kv_timed(getattr(eng.kv, name), name))
        schedule, preempt, prepare = eng.scheduler.schedule, eng.scheduler.preempt, eng.runner.prepare

        def timed_schedule() -> ScheduledBatch:
            t0 = time.perf_counter()
            batch = schedule()
            self._sched_s += time.perf_counter() - t0
            self._observe(self._on_batch, batch)
            return batch

        def counted_preempt(req: Request, requeue: bool = True) -> None:
            self._observe(self._on_preempt, req)
            preempt(req, requeue)

        def timed_prepare(batch: ScheduledBatch) -> Any:
            t0 = time.perf_counter()
            try:
                return prepare(batch)
            finally:
                self._prep_s += time.perf_counter() - t0

        eng.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
        eng.scheduler.preempt = counted_preempt  # type: ignore[method-assign]
        eng.runner.prepare = timed_prepare  # type: ignore[method-assign]

    # -- driving ---------------------------------------------------------------------------------------
    def add(self, prompt: list[int], params: Any, request_id: str) -> str:
        """``Engine.add_request`` with the arrival noted at the current step and clock."""
        rid = self.eng.add_request(prompt, params, request_id=request_id)
        self._pending[rid] = (self.eng.scheduler.step, self.clock)
        return rid

    def advance(self) -> list[str]:
        """One ``Engine.advance()``, recorded."""
        kv = self.kv
        cow0, ev0 = kv.stats.cow_copies, kv.stats.evictions
        self._kv_s = self._prep_s = self._sched_s = self._inside = 0.0
        self._batch = None
        self._preempted = 0
        t0 = time.perf_counter()
        moved = self.eng.advance()
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        seconds = max(0.0, wall - self._inside)
        self.clock += seconds
        self._after_step(seconds, kv.stats.cow_copies - cow0, kv.stats.evictions - ev0)
        self.overhead_seconds += self._inside + time.perf_counter() - t1
        return moved

    # -- wrappers --------------------------------------------------------------------------------------
    def _observe(self, fn: Callable[..., None], *args: Any) -> None:
        """Run the meter's own work inside a step and keep its time out of the step's."""
        t0 = time.perf_counter()
        fn(*args)
        self._inside += time.perf_counter() - t0

    def _kv_timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            potential = None
            if name == "allocate" and self.prefix_potential and self.kv.index is not None:
                t = time.perf_counter()
                prompt = args[1] if len(args) > 1 else kwargs["prompt_tokens"]
                potential = min(len(prompt) - 1, self._common_prefix(prompt))
                self._inside += time.perf_counter() - t
            self._depth += 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self._kv_s += time.perf_counter() - t0
                self._depth -= 1
            if potential is not None and isinstance(out, Allocation) and out.ok:
                self.hit_potential += potential
                self.hit_actual += out.num_cached_tokens
            return out

        return call

    def _on_preempt(self, req: Request) -> None:
        self._preempted += 1
        self.preempted_requests.add(req.request_id)
        done = req.num_computed_tokens
        self._watermark[req.request_id] = max(done, self._watermark.get(req.request_id, 0))

    def _on_batch(self, batch: ScheduledBatch) -> None:
        self._batch = batch
        decode = prefill = recompute = entries = 0
        self._computing = []
        for s in batch.scheduled:
            req, n = s.request, s.num_tokens
            if n == 0:
                continue
            start = req.num_computed_tokens  # not yet advanced: the engine adds n after the forward pass
            end = start + n
            mark = self._watermark.get(req.request_id, 0)
            again = max(0, min(end, mark) - start)
            if mark and end >= mark:
                del self._watermark[req.request_id]
            first = n - again
            in_prompt = max(0, min(end, req.num_prompt_tokens) - max(start, mark))
            recompute += again
            prefill += in_prompt
            decode += first - in_prompt
            entries += len(self.kv.block_table(req.request_id)) if self.kv.has_request(req.request_id) else 0
            if self.prefix_potential:
                self._computing.append((req, start, n))
        self._step_tokens = (decode, prefill, recompute)
        self._table_entries = entries
        self.recomputed_tokens += recompute

    # -- after the step --------------------------------------------------------------------------------
    def _after_step(self, seconds: float, cow: int, evictions: int) -> None:
        kv = self.kv
        batch = self._batch
        used = round(kv.usage() * kv.num_blocks)
        frag = self._fill() if self.fragmentation else (0, 0, 0, 0)
        if batch is not None and batch:
            decode, prefill, recompute = self._step_tokens
            tokens, requests, entries = batch.num_tokens, len(batch.scheduled), self._table_entries
        else:
            decode = prefill = recompute = tokens = requests = entries = 0
        self.records.append(
            StepRecord(
                self.eng.scheduler.step,
                seconds,
                self._kv_s,
                self._prep_s,
                self._sched_s,
                requests,
                tokens,
                decode,
                prefill,
                recompute,
                self._preempted,
                cow,
                evictions,
                used,
                entries,
                *frag,
            )
        )
        for req, start, n in self._computing:  # computed now: later admissions could share them
            self._insert(req, start, n)
        self._computing = []
        self._note_timings()

    def _fill(self) -> tuple[int, int, int, int]:
        """(allocated, filled, empty slots of partially filled blocks, slots of blocks held empty)."""
        kv, bs = self.kv, self.kv.block_size
        fill: dict[int, int] = {}
        for rid in kv.request_ids():
            n = kv.num_computed_tokens(rid)
            for i, block in enumerate(kv.block_table(rid)):
                f = min(bs, max(0, n - i * bs))
                if fill.get(block, -1) < f:
                    fill[block] = f
        spares = sum(len(s) for s in kv.cow_reserve().values())
        allocated = (kv.num_blocks - self._num_free_blocks()) * bs
        filled = sum(fill.values())
        partial = sum(bs - f for f in fill.values() if 0 < f < bs)
        empty = (sum(1 for f in fill.values() if f == 0) + spares) * bs
        return allocated, filled, partial, empty

    def _note_timings(self) -> None:
        step = self.eng.scheduler.step
        for rid in list(self._pending):
            seqs = self.eng.sequences(rid)
            head = seqs[0]
            if rid not in self._first and head.output_token_ids:
                self._first[rid] = (step, self.clock)
            if all(r.is_finished for r in seqs):
                arrival, arrival_s = self._pending.pop(rid)
                first, first_s = self._first.pop(rid, (step, self.clock))
                self.timings[rid] = RequestTiming(
                    rid,
                    arrival,
                    first,
                    step,
                    arrival_s,
                    first_s,
                    self.clock,
                    sum(len(r.output_token_ids) for r in seqs),
                    sum(r.num_preemptions for r in seqs),
                )

    # -- the trie of computed tokens -------------------------------------------------------------------
    def _insert(self, req: Request, start: int, n: int) -> None:
        tokens = req.all_token_ids
        at, node = self._cursor.get(req.request_id, (0, self._trie))
        if at != start:  # preempted and re-admitted (or first seen mid-way): walk from the root again
            at, node = 0, self._trie
        for t in tokens[at : start + n]:
            node = node.setdefault(t, {})
        self._cursor[req.request_id] = (start + n, node)

    def _common_prefix(self, prompt: Any) -> int:
        node, depth = self._trie, 0
        for t in prompt:
            nxt = node.get(t)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        return depth

    # -- summaries -------------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def seconds(self) -> float:
        return self.clock

    def total(self, field_name: str) -> float:
        return sum(getattr(r, field_name) for r in self.records)

    def per_step(self, field_name: str) -> float:
        return self.total(field_name) / self.steps if self.steps else 0.0


def warm_up(loaded: LoadedModel) -> None:
    """One small unmeasured run, so that no measured point pays the first call's costs (kernels, allocator)."""
    eng = Engine(loaded, CacheConfig(num_blocks=64), SchedulerConfig(max_model_len=64))
    for i in range(4):
        eng.add_request(list(range(1, 12 + i)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(1000):
        if not eng.has_unfinished_requests():
            return
        eng.advance()


@contextmanager
def paused_gc() -> Iterator[None]:
    """Collect once, then keep the cyclic garbage collector off until the block exits (reference counting still
    frees everything that is not a cycle)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
