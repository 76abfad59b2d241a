"""The KV cache manager's own rates: pure Python, no model, no storage (``kvlab bench layout`` times the storage).

* :func:`step_rates`: engine-like steps. In each step every running request appends one decode token, one new
  request arrives (``lookup()``, then ``allocate()`` of its whole prompt in one chunk), the step's writes are
  committed, and the requests that have appended ``decode_tokens`` tokens are freed. Lookup, allocate, the
  decode appends, the commit and free are each timed on their own, around those calls only (``allocate()``
  matches the prefix again inside: the scheduler asks first, then admits). The run is repeated on a fresh
  manager, and each phase's fastest run counts;
* :func:`lookup_scaling`: ``lookup()`` of a prompt whose every block is cached, against its length. A lookup
  hashes each full block once (its chain key), so the time per block should stay flat as the prompt grows. The
  hashes are counted by wrapping ``kvlab.kv.prefix.hash_block`` (what ``PrefixIndex.match`` calls) during one
  untimed lookup: a count no machine changes;
* :func:`many_live`: many requests alive at once, sharing a system prompt, then a few decode steps, with token
  or block prefix granularity. The invariants are checked once, at the end, and that check is timed.

Every prompt's own part starts with a token of its own (outside the range the random tokens are drawn from), so
no two prompts share more than the shared prefix and every count below follows from the sizes. Timings are
measured here and never asserted in tests; the counts are.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any
from unittest import mock

import kvlab.kv.prefix as prefix_index
from kvlab.bench.table import ResultTable, result_table, right_columns
from kvlab.config import GRANULARITIES, CacheConfig, blocks_for
from kvlab.kv import KVCacheManager, check_invariants

VOCAB = 32_000  # random tokens are drawn below this; VOCAB + i starts prompt i's own part
STEP_PHASES = ("lookup", "allocate", "decode", "commit", "free")


def _blocks(tokens: int, block_size: int) -> int:
    return blocks_for(tokens, block_size)


def _per_second(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


# -- 1. allocate / append / free in engine-like steps ----------------------------------------------------------
@dataclass(frozen=True)
class StepRates:
    """One workload of :func:`step_rates`: its counts (equal in every run) and each phase's fastest run."""

    shared_prefix: int  # tokens every prompt starts with
    requests: int
    prompt_tokens: int
    decode_tokens: int  # appended one per step by each request before it is freed
    block_size: int
    num_blocks: int
    repeats: int
    steps: int
    decode_appends: int  # append_slots() calls of one token
    peak_live: int  # requests holding blocks at once
    blocks_allocated: int  # blocks the pool handed out (KVStats.allocations)
    hit_tokens: int  # prompt tokens found cached at admission
    queried_tokens: int  # prompt tokens looked up at admission
    evictions: int
    lookup_seconds: float  # each: the fastest of ``repeats`` runs, summed over the run's calls
    allocate_seconds: float
    decode_seconds: float
    commit_seconds: float
    free_seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def rates(self) -> dict[str, float]:
        """Calls per second of each phase (commits: one per step)."""
        return {
            "lookup_per_s": _per_second(self.requests, self.lookup_seconds),
            "allocate_per_s": _per_second(self.requests, self.allocate_seconds),
            "decode_append_per_s": _per_second(self.decode_appends, self.decode_seconds),
            "commit_per_s": _per_second(self.steps, self.commit_seconds),
            "free_per_s": _per_second(self.requests, self.free_seconds),
        }

    def as_dict(self) -> dict[str, Any]:
        rates = {k: round(v, 1) for k, v in self.rates().items()}
        return asdict(self) | {"hit_rate": round(self.hit_rate, 4)} | rates


def _step_prompts(requests: int, shared_prefix: int, prompt_tokens: int, rng: random.Random) -> list[list[int]]:
    system = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    own = prompt_tokens - shared_prefix - 1
    return [[*system, VOCAB + i, *(rng.randrange(VOCAB) for _ in range(own))] for i in range(requests)]


def _step_run(
    config: CacheConfig, prompts: list[list[int]], decode_tokens: int, step_tokens: list[list[int]]
) -> tuple[dict[str, float], dict[str, int]]:
    """One run of the steps on a fresh manager: (seconds per phase, counts)."""
    m = KVCacheManager(config)
    perf = time.perf_counter
    seconds = dict.fromkeys(STEP_PHASES, 0.0)
    running: dict[str, int] = {}  # request -> decode tokens appended so far
    admitted = steps = appends = peak = 0
    while admitted < len(prompts) or running:
        token = step_tokens[steps]
        t0 = perf()
        for rid in running:
            if not m.append_slots(rid, token).ok:
                raise RuntimeError(f"the pool of {config.num_blocks} blocks ran out at a decode append")
        seconds["decode"] += perf() - t0
        appends += len(running)
        for rid in running:
            running[rid] += 1
        if admitted < len(prompts):
            rid, prompt = f"r{admitted}", prompts[admitted]
            t0 = perf()
            hit = m.lookup(prompt)
            t1 = perf()
            alloc = m.allocate(rid, prompt)
            t2 = perf()
            seconds["lookup"] += t1 - t0
            seconds["allocate"] += t2 - t1
            if not alloc.ok:
                raise RuntimeError(f"the pool of {config.num_blocks} blocks ran out at admission: {alloc.failure}")
            if alloc.num_cached_tokens != hit:
                raise RuntimeError(f"lookup() said {hit} cached tokens, allocate() found {alloc.num_cached_tokens}")
            running[rid] = 0
            admitted += 1
        peak = max(peak, len(running))
        t0 = perf()
        m.commit_writes()
        seconds["commit"] += perf() - t0
        for rid in [r for r, n in running.items() if n == decode_tokens]:
            del running[rid]
            t0 = perf()
            m.free(rid)
            seconds["free"] += perf() - t0
        steps += 1
    check_invariants(m)
    if m.num_free_blocks() != m.num_blocks:
        raise RuntimeError("blocks are still in use after every request was freed")
    s = m.stats
    counts = {
        "steps": steps,
        "decode_appends": appends,
        "peak_live": peak,
        "blocks_allocated": s.allocations,
        "hit_tokens": s.prefix_cache_hits,
        "queried_tokens": s.prefix_cache_queries,
        "evictions": s.evictions,
    }
    return seconds, counts


def step_rates(
    requests: int = 1000,
    shared_prefix: int = 0,
    prompt_tokens: int = 128,
    decode_tokens: int = 16,
    block_size: int = 16,
    num_blocks: int = 256,
    repeats: int = 5,
    seed: int = 0,
) -> StepRates:
    """``requests`` arrive one per step with ``prompt_tokens``-token prompts whose first ``shared_prefix`` tokens
    are the same; each appends ``decode_tokens`` tokens, one per step, then leaves. ``repeats`` runs on fresh
    managers; the counts must agree, and each phase's fastest run counts."""
    if requests < 1 or repeats < 1 or decode_tokens < 0:
        raise ValueError("requests and repeats must be >= 1, decode_tokens >= 0")
    if not 0 <= shared_prefix < prompt_tokens:
        raise ValueError(f"shared_prefix must be in 0..prompt_tokens-1, got {shared_prefix} of {prompt_tokens}")
    need = min(requests, decode_tokens + 1) * _blocks(prompt_tokens + decode_tokens, block_size)
    if num_blocks < need:
        raise ValueError(f"{decode_tokens + 1} requests live at once need up to {need} blocks; num_blocks={num_blocks}")
    rng = random.Random(seed)
    prompts = _step_prompts(requests, shared_prefix, prompt_tokens, rng)
    step_tokens = [[rng.randrange(VOCAB)] for _ in range(requests + decode_tokens + 1)]
    config = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    best = dict.fromkeys(STEP_PHASES, float("inf"))
    counts: dict[str, int] | None = None
    for _ in range(repeats):
        seconds, run_counts = _step_run(config, prompts, decode_tokens, step_tokens)
        if counts is not None and run_counts != counts:
            raise RuntimeError(f"the counts changed between runs: {counts} then {run_counts}")
        counts = run_counts
        best = {k: min(best[k], seconds[k]) for k in STEP_PHASES}
    assert counts is not None
    return StepRates(
        shared_prefix,
        requests,
        prompt_tokens,
        decode_tokens,
        block_size,
        num_blocks,
        repeats,
        **counts,
        lookup_seconds=best["lookup"],
        allocate_seconds=best["allocate"],
        decode_seconds=best["decode"],
        commit_seconds=best["commit"],
        free_seconds=best["free"],
    )


# -- 2. prefix lookup against prompt length --------------------------------------------------------------------
@dataclass(frozen=True)
class LookupTiming:
    """``lookup()`` of a ``tokens``-token prefix that is all cached (the query has one token more)."""

    tokens: int
    blocks: int  # blocks the lookup walks: ceil(tokens / block_size)
    hashes: int  # hash_block() calls of one lookup: one per full block
    hit_tokens: int
    repeats: int
    best_us: float
    median_us: float

    @property
    def us_per_block(self) -> float:
        """Best time per block walked."""
        return self.best_us / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"us_per_block": round(self.us_per_block, 3)}


def _counted_lookup(m: KVCacheManager, query: list[int]) -> tuple[int, int]:
    """(``m.lookup(query)``, the hash_block() calls the prefix index made in it), by wrapping the index's reference
    to that function for this one call."""
    with mock.patch.object(prefix_index, "hash_block", wraps=prefix_index.hash_block) as counted:
        hit = m.lookup(query)
    return hit, counted.call_count


def lookup_scaling(
    lengths: Sequence[int] = (256, 512, 1024, 2048, 4096, 8192, 16384),
    block_size: int = 16,
    repeats: int = 20,
    seed: int = 1,
) -> list[LookupTiming]:
    """For each length n: a prompt of n tokens is prefilled, committed and freed (cached, free), then ``lookup()``
    of it plus one token runs ``repeats`` times; the fastest and the median count."""
    if repeats < 1 or not lengths or min(lengths) < 1:
        raise ValueError("repeats must be >= 1 and lengths a non-empty list of positive ints")
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        blocks = _blocks(n, block_size)
        m = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=blocks + 8))
        prompt = [rng.randrange(VOCAB) for _ in range(n)]
        if not m.allocate("warm", prompt).ok:
            raise RuntimeError(f"could not prefill {n} tokens")
        m.commit_writes()
        m.free("warm")
        query = [*prompt, VOCAB]  # a lookup leaves the last prompt token out: the whole of ``prompt`` can hit
        hit, hashes = _counted_lookup(m, query)
        if hit != n:
            raise RuntimeError(f"lookup found {hit} of {n} cached tokens")
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            m.lookup(query)
            samples.append(time.perf_counter() - t0)
        rows.append(LookupTiming(n, blocks, hashes, hit, repeats, min(samples) * 1e6, statistics.median(samples) * 1e6))
    return rows


# -- 3. many live requests at once -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LiveRequests:
    """:func:`many_live` under one prefix granularity: counts at the end (before the frees), fastest timings."""

    granularity: str
    requests: int
    system_tokens: int  # shared by every prompt
    own_tokens: int  # each prompt's own tokens after them
    decode_steps: int
    admit_per_step: int  # admissions between commits: a step's admissions cannot hit each other
    block_size: int
    num_blocks: int
    repeats: int
    live_requests: int
    blocks_in_use: int
    hit_tokens: int
    peak_refcount: int
    gc_objects: int  # objects the cyclic GC tracks beyond those before the manager was filled
    admit_seconds: float  # fastest of ``repeats``: every allocate() and its commits
    decode_seconds: float  # fastest: all decode steps (appends + commits)
    invariants_seconds: float  # fastest: one check_invariants() of the full pool
    free_seconds: float  # fastest: freeing every request

    @property
    def decode_step_ms(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"decode_step_ms": round(self.decode_step_ms, 3)}


def _live_run(
    config: CacheConfig, prompts: list[list[int]], decode: list[list[int]], admit_per_step: int
) -> tuple[dict[str, float], dict[str, int]]:
    perf = time.perf_counter
    rids = [f"r{i}" for i in range(len(prompts))]
    gc.collect()
    objects0 = len(gc.get_objects())
    m = KVCacheManager(config)
    t0 = perf()
    for i, (rid, prompt) in enumerate(zip(rids, prompts, strict=True)):
        if not m.allocate(rid, prompt).ok:
            raise RuntimeError(f"the pool of {config.num_blocks} blocks ran out at admission")
        if i % admit_per_step == admit_per_step - 1:
            m.commit_writes()
    m.commit_writes()
    t_admit = perf() - t0
    t0 = perf()
    for token in decode:
        for rid in rids:
            if not m.append_slots(rid, token).ok:
                raise RuntimeError(f"the pool of {config.num_blocks} blocks ran out at a decode step")
        m.commit_writes()
    t_decode = perf() - t0
    counts = {
        "live_requests": len(m.request_ids()),
        "blocks_in_use": m.num_blocks - m.num_free_blocks(),
        "hit_tokens": m.stats.prefix_cache_hits,
        "peak_refcount": m.stats.peak_refcount,
        "gc_objects": len(gc.get_objects()) - objects0,
    }
    t0 = perf()
    check_invariants(m)
    t_check = perf() - t0
    t0 = perf()
    for rid in rids:
        m.free(rid)
    t_free = perf() - t0
    if m.num_free_blocks() != m.num_blocks:
        raise RuntimeError("blocks are still in use after every request was freed")
    seconds = {"admit": t_admit, "decode": t_decode, "invariants": t_check, "free": t_free}
    return seconds, counts


def many_live(
    requests: int = 10_000,
    granularity: str = "token",
    system_tokens: int = 32,
    own_tokens: int = 16,
    decode_steps: int = 8,
    admit_per_step: int = 256,
    block_size: int = 16,
    num_blocks: int | None = None,
    repeats: int = 1,
    seed: int = 2,
) -> LiveRequests:
    """``requests`` requests admitted ``admit_per_step`` per step (a commit after each step), each with the same
    ``system_tokens`` then ``own_tokens`` of its own, then ``decode_steps`` steps of one token for every one.
    ``num_blocks`` defaults to what they would need with no sharing, plus 16."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if min(requests, own_tokens, admit_per_step, repeats) < 1 or min(system_tokens, decode_steps) < 0:
        raise ValueError("requests, own_tokens, admit_per_step and repeats must be >= 1")
    per_request = _blocks(system_tokens + own_tokens + decode_steps, block_size)
    pool = requests * per_request + 16 if num_blocks is None else num_blocks
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(system_tokens)]
    prompts = [[*system, VOCAB + i, *(rng.randrange(VOCAB) for _ in range(own_tokens - 1))] for i in range(requests)]
    decode = [[rng.randrange(VOCAB)] for _ in range(decode_steps)]
    config = CacheConfig(block_size=block_size, num_blocks=pool, prefix_granularity=granularity)
    best = {"admit": float("inf"), "decode": float("inf"), "invariants": float("inf"), "free": float("inf")}
    counts: dict[str, int] | None = None
    for _ in range(repeats):
        seconds, run_counts = _live_run(config, prompts, decode, admit_per_step)
        # The GC count may move by a few objects between runs (interpreter caches); the manager's counts may not.
        if counts is not None and {k: v for k, v in run_counts.items() if k != "gc_objects"} != {
            k: v for k, v in counts.items() if k != "gc_objects"
        }:
            raise RuntimeError(f"the counts changed between runs: {counts} then {run_counts}")
        counts = run_counts if counts is None else counts
        best = {k: min(best[k], seconds[k]) for k in best}
    assert counts is not None
    return LiveRequests(
        granularity,
        requests,
        system_tokens,
        own_tokens,
        decode_steps,
        admit_per_step,
        block_size,
        pool,
        repeats,
        **counts,
        admit_seconds=best["admit"],
        decode_seconds=best["decode"],
        invariants_seconds=best["invariants"],
        free_seconds=best["free"],
    )


# -- tables ------------------------------------------------------------------------------------------------------
def steps_table(steps: Sequence[StepRates]) -> ResultTable:
    r0 = steps[0]
    return result_table(
        f"manager steps: {r0.requests:,} requests of {r0.prompt_tokens} prompt + {r0.decode_tokens} decoded tokens, "
        f"blocks of {r0.block_size}, pool of {r0.num_blocks}; calls/s, fastest of {r0.repeats} runs per phase",
        right_columns("shared", "lookup/s", "allocate/s", "decode append/s", "commit/s", "free/s", "hit rate")
        + right_columns("blocks allocated", "evictions", "peak live"),
        [
            (
                str(r.shared_prefix),
                *(f"{v:,.0f}" for v in r.rates().values()),
                f"{r.hit_rate:.1%}",
                f"{r.blocks_allocated:,}",
                f"{r.evictions:,}",
                str(r.peak_live),
            )
            for r in steps
        ],
    )


def lookup_table(lookups: Sequence[LookupTiming], repeats: int) -> ResultTable:
    return result_table(
        f"prefix lookup of a fully cached prompt against its length; fastest and median of {repeats}",
        right_columns("tokens", "blocks", "hashes", "hit tokens", "best µs", "median µs", "µs / block"),
        [
            (
                f"{row.tokens:,}",
                f"{row.blocks:,}",
                f"{row.hashes:,}",
                f"{row.hit_tokens:,}",
                f"{row.best_us:,.1f}",
                f"{row.median_us:,.1f}",
                f"{row.us_per_block:.2f}",
            )
            for row in lookups
        ],
    )


def live_table(live: Sequence[LiveRequests], repeats: int) -> ResultTable:
    first = live[0]
    return result_table(
        f"{first.live_requests:,} live requests: {first.system_tokens}-token shared system prompt + "
        f"{first.own_tokens} own tokens, {first.admit_per_step} admitted per step, then {first.decode_steps} decode "
        f"steps; {first.num_blocks:,} blocks; fastest of {repeats}",
        right_columns("granularity", "live", "blocks in use", "hit tokens", "peak refcount", "GC objects")
        + right_columns("admit s", "decode step ms", "invariants s", "free all s"),
        [
            (
                lr.granularity,
                f"{lr.live_requests:,}",
                f"{lr.blocks_in_use:,}",
                f"{lr.hit_tokens:,}",
                f"{lr.peak_refcount:,}",
                f"{lr.gc_objects:,}",
                f"{lr.admit_seconds:.3f}",
                f"{lr.decode_step_ms:.2f}",
                f"{lr.invariants_seconds:.3f}",
                f"{lr.free_seconds:.3f}",
            )
            for lr in live
        ],
    )
