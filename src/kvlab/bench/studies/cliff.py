"""The latency cliff: concurrency against a fixed, modest KV pool (``kvlab bench sweep --cliff``).

The founding document (section 1) describes latency that does not grow gradually with concurrency but
doubles suddenly, and traces it to the KV cache. Here ``c`` clients each send ``rounds`` requests one after
another (closed loop: a client's next request arrives as soon as its previous one ends), against a pool
of ``num_blocks`` blocks that holds only a few requests at their full length. While the pool holds every
request in flight, each step moves every request by one token: latency grows only as the step itself gets
longer (bigger batches). Once it does not, a request that needs a new block finds none, the newest running
request is preempted (its blocks freed), and it is recomputed later from whatever of its prefix is still
cached; new requests also wait for blocks before their first token. Latency counted in engine steps, which
the machine's speed does not touch, makes the split visible: without preemptions a request's TPOT is one
step per token; past the pool's capacity it jumps.

Two thresholds, told apart:

* the *knee*: the last concurrency after which throughput grows by less than ``min_gain`` (10%) — adding
  clients stops paying, whether because each step gets slower or because the pool caps the batch;
* the *cliff*: the first concurrency whose p99 TPOT in steps is at least ``jump`` (1.5x) that of the
  concurrency before it (of one step per token, before the first): tokens stop arriving one per step
  because requests lose their blocks.

Per point the attribution: preemptions, tokens recomputed because of them, copy-on-write copies, evictions,
mean and peak KV usage, requests and tokens per step (decode, first-time prefill, recompute). Strategies
are ``kvlab.experiment.strategies.BUILTIN_STRATEGIES`` names: ``isolated`` (no prefix sharing) and
``shared-cow`` (sharing, the default) by default; ``shared-no-cow`` (no refcounts, no copy-on-write) shows
what an unsafe engine "gains": blocks still read by others count as free. Outputs are compared with the
first strategy's at the same concurrency (greedy): the unsafe one's differences are its contamination.
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvlab.bench.studies.stepmeter import StepMeter, StepRecord, paused_gc, warm_up
from kvlab.bench.studies.sweep import percentile
from kvlab.bench.table import Column, ResultTable, result_table
from kvlab.config import CacheConfig, SchedulerConfig, blocks_for
from kvlab.engine.engine import Engine
from kvlab.engine.sampling import SamplingParams
from kvlab.experiment.strategies import BUILTIN_STRATEGIES
from kvlab.model.loader import LoadedModel

DEFAULT_STRATEGIES = ("isolated", "shared-cow")
MAX_STEPS = 200_000


@dataclass(frozen=True)
class CliffWorkload:
    """Every request: a shared prefix (a system prompt), its own question, then greedy tokens (EOS ignored)."""

    shared: int = 96
    distinct: tuple[int, int] = (16, 32)
    output: tuple[int, int] = (64, 96)
    rounds: int = 4  # requests per client
    num_blocks: int = 64
    block_size: int = 16
    seed: int = 0

    @property
    def longest(self) -> int:
        return self.shared + self.distinct[1] + self.output[1]

    def requests_of(self, concurrency: int, vocab_size: int) -> list[tuple[list[int], int]]:
        """(prompt, max_tokens) of the c x rounds requests, in sending order (the same first ones at any c)"""
        rng = random.Random(self.seed)
        ids = min(vocab_size, 256)
        shared = [rng.randrange(ids) for _ in range(self.shared)]
        return [
            (shared + [rng.randrange(ids) for _ in range(rng.randint(*self.distinct))], rng.randint(*self.output))
            for _ in range(concurrency * self.rounds)
        ]

    def pool_holds(self, share: bool) -> int:
        """Requests the pool holds at their longest, all at once (with sharing, the prefix's full blocks once)."""
        bs = self.block_size
        shared_blocks = self.shared // bs if share else 0
        own = blocks_for(self.longest, bs) - shared_blocks
        return (self.num_blocks - shared_blocks) // own


@dataclass(frozen=True)
class CliffPoint:
    strategy: str
    concurrency: int
    requests: int
    num_blocks: int  # the pool
    steps: int
    output_tokens: int
    seconds: float  # engine time (the meter's work left out)
    ttft_p50: float  # seconds, on the engine's clock
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    e2e_p50: float
    e2e_p99: float
    ttft_steps_p99: float  # the same latencies in engine steps
    tpot_steps_p50: float
    tpot_steps_p99: float
    e2e_steps_p50: float
    e2e_steps_p99: float
    preemptions: int
    preempted_requests: int
    recomputed_tokens: int
    cow_copies: int
    evictions: int
    prefix_hit_tokens: int
    kv_usage_mean_pct: float
    kv_usage_peak_pct: float
    requests_per_step: float
    tokens_per_step: float
    decode_tokens_per_step: float
    ms_per_step: float
    differing_outputs: int | None = None  # requests whose tokens differ from the first strategy's
    timeline: tuple[StepRecord, ...] = field(default=(), repr=False, compare=False)
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("timeline", "outputs")}
        return d | {"throughput": round(self.throughput, 2)}

    def counts(self) -> tuple:
        return (self.steps, self.preemptions, self.recomputed_tokens, self.cow_copies, self.evictions, self.outputs)


def strategy_cache(name: str, w: CliffWorkload) -> CacheConfig:
    """The strategy's cache knobs on the workload's pool (strategies that change the batch are refused)."""
    try:
        strategy = BUILTIN_STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(BUILTIN_STRATEGIES)}") from None
    if strategy.inject_empty or strategy.scheduler:
        raise ValueError(f"strategy {name!r} changes the batch itself, not the cache: not a cliff strategy")
    cache, _ = strategy.configs({"num_blocks": w.num_blocks, "block_size": w.block_size}, {})
    return cache


def run_cliff_point(loaded: LoadedModel, w: CliffWorkload, strategy: str, concurrency: int) -> CliffPoint:
    cache = strategy_cache(strategy, w)
    sched = SchedulerConfig(
        max_num_seqs=concurrency,
        max_num_batched_tokens=2048,
        max_model_len=min(loaded.config.max_position_embeddings, w.longest),
        unsafe=cache.unsafe,
    )
    eng = Engine(loaded, cache, sched)
    meter = StepMeter(eng)
    reqs = w.requests_of(concurrency, loaded.config.vocab_size)
    queue = list(enumerate(reqs))
    live: dict[int, str] = {}  # client -> its request in flight

    def submit(client: int) -> None:
        k, (prompt, max_tokens) = queue.pop(0)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        live[client] = meter.add(prompt, params, f"r{k}")

    with paused_gc():
        for client in range(concurrency):
            submit(client)
        while eng.has_unfinished_requests():
            meter.advance()
            for client, rid in list(live.items()):
                if eng.is_finished(rid):
                    del live[client]
                    if queue:
                        submit(client)
            if meter.steps > MAX_STEPS:
                raise RuntimeError("the engine made no progress")
    t = list(meter.timings.values())
    recs = meter.records
    busy = [r for r in recs if r.requests] or recs
    s = eng.kv.stats
    return CliffPoint(
        strategy=strategy,
        concurrency=concurrency,
        requests=len(t),
        num_blocks=w.num_blocks,
        steps=meter.steps,
        output_tokens=sum(x.output_tokens for x in t),
        seconds=meter.seconds,
        ttft_p50=statistics.median(x.ttft_s for x in t),
        ttft_p99=percentile([x.ttft_s for x in t], 99),
        tpot_p50=statistics.median(x.tpot_s for x in t),
        tpot_p99=percentile([x.tpot_s for x in t], 99),
        e2e_p50=statistics.median(x.e2e_s for x in t),
        e2e_p99=percentile([x.e2e_s for x in t], 99),
        ttft_steps_p99=percentile([x.ttft_steps for x in t], 99),
        tpot_steps_p50=statistics.median(x.tpot_steps for x in t),
        tpot_steps_p99=percentile([x.tpot_steps for x in t], 99),
        e2e_steps_p50=statistics.median(x.e2e_steps for x in t),
        e2e_steps_p99=percentile([x.e2e_steps for x in t], 99),
        preemptions=eng.scheduler.num_preemptions,
        preempted_requests=len(meter.preempted_requests),
        recomputed_tokens=meter.recomputed_tokens,
        cow_copies=s.cow_copies,
        evictions=s.evictions,
        prefix_hit_tokens=s.prefix_cache_hits,
        kv_usage_mean_pct=100.0 * statistics.fmean(r.used_blocks for r in busy) / w.num_blocks,
        kv_usage_peak_pct=100.0 * max(r.used_blocks for r in recs) / w.num_blocks,
        requests_per_step=statistics.fmean(r.requests for r in busy),
        tokens_per_step=statistics.fmean(r.tokens for r in busy),
        decode_tokens_per_step=statistics.fmean(r.decode_tokens for r in busy),
        ms_per_step=1e3 * meter.seconds / meter.steps if meter.steps else 0.0,
        timeline=tuple(recs),
        outputs={rid: tuple(eng.output(rid).token_ids) for rid in meter.timings},
    )


def sweep_cliff(
    loaded: LoadedModel,
    w: CliffWorkload,
    concurrencies: Sequence[int],
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    repeats: int = 1,
) -> list[CliffPoint]:
    """Every strategy at every concurrency (the fastest of ``repeats`` runs counts; counts and tokens must not
    change between runs). ``differing_outputs``: against the first strategy at the same concurrency."""
    for name in strategies:
        strategy_cache(name, w)  # unknown names fail before anything runs
    warm_up(loaded)
    out: list[CliffPoint] = []
    for name in strategies:
        for c in concurrencies:
            best: CliffPoint | None = None
            for _ in range(repeats):
                p = run_cliff_point(loaded, w, name, c)
                if best is not None and best.counts() != p.counts():
                    raise RuntimeError(f"{name} at concurrency {c} changed between repeats")
                if best is None or p.seconds < best.seconds:
                    best = p
            assert best is not None
            out.append(best)
    first = {p.concurrency: p for p in out if p.strategy == strategies[0]}
    return [_with_diff(p, first[p.concurrency]) if p.strategy != strategies[0] else _with_diff(p, None) for p in out]


def _with_diff(p: CliffPoint, ref: CliffPoint | None) -> CliffPoint:
    if ref is None:
        return replace(p, differing_outputs=0)
    return replace(p, differing_outputs=sum(p.outputs.get(k) != v for k, v in ref.outputs.items()))


def find_knee(points: Sequence[CliffPoint], min_gain: float = 0.10) -> CliffPoint | None:
    """The last concurrency after which throughput grows by less than ``min_gain``; None if it still grows."""
    ordered = sorted(points, key=lambda p: p.concurrency)
    for here, nxt in itertools.pairwise(ordered):
        if nxt.throughput < here.throughput * (1 + min_gain):
            return here
    return None


def find_cliff(points: Sequence[CliffPoint], jump: float = 1.5) -> CliffPoint | None:
    """The first concurrency whose p99 TPOT in engine steps is ``jump`` times the previous concurrency's (before
    the first: one step per token, what a request gets while nothing stalls it)."""
    before = 1.0
    for p in sorted(points, key=lambda p: p.concurrency):
        if p.tpot_steps_p99 >= jump * before:
            return p
        before = p.tpot_steps_p99
    return None


def by_strategy(points: Sequence[CliffPoint]) -> dict[str, list[CliffPoint]]:
    out: dict[str, list[CliffPoint]] = {}
    for p in points:
        out.setdefault(p.strategy, []).append(p)
    return {k: sorted(v, key=lambda p: p.concurrency) for k, v in out.items()}


def cliff_tables(
    points: Sequence[CliffPoint], w: CliffWorkload, model: str, threads: int, repeats: int
) -> list[ResultTable]:
    """One table per strategy, the knee and the cliff marked; above the first, the workload; under the last,
    what the columns mean and each strategy's knee and cliff."""
    groups = by_strategy(points)
    first = next(iter(groups), "")
    tables, verdicts = [], []
    columns = ("conc.", "", "tok/s", "TPOT p99 ms", "E2E p50 s", "TPOT p99 st", "TTFT p99 st", "preempt")
    more = ("recomp.", "CoW/evict", "KV % avg/max", "req/st", "tok/st", "ms/st", "differ")
    for name, pts in groups.items():
        knee, cl = find_knee(pts), find_cliff(pts)
        verdicts.append(
            f"{name}: knee (throughput +<10% after it) at {knee.concurrency if knee else 'none'}, cliff (TPOT p99 "
            f"in steps x1.5) at {cl.concurrency if cl else 'none'}"
        )
        rows = [
            (
                str(p.concurrency),
                "/".join(m for m, at in (("knee", knee), ("cliff", cl)) if p is at),
                f"{p.throughput:.0f}",
                f"{1e3 * p.tpot_p99:.2f}",
                f"{p.e2e_p50:.3f}",
                f"{p.tpot_steps_p99:.2f}",
                f"{p.ttft_steps_p99:.0f}",
                f"{p.preemptions}",
                str(p.recomputed_tokens),
                f"{p.cow_copies}/{p.evictions}",
                f"{p.kv_usage_mean_pct:.0f}/{p.kv_usage_peak_pct:.0f}",
                f"{p.requests_per_step:.1f}",
                f"{p.tokens_per_step:.1f}",
                f"{p.ms_per_step:.2f}",
                "-" if p.strategy == first else str(p.differing_outputs),
            )
            for p in pts
        ]
        tables.append(result_table(f"cliff: {name}", [Column(c, "right") for c in (*columns, *more)], rows))
    if not tables:
        return []
    heading = (
        f"[bold]cliff[/bold]: {model}, {w.num_blocks} blocks of {w.block_size} tokens, closed loop of {w.rounds} "
        f"requests per client ({w.shared} shared + {w.distinct[0]}-{w.distinct[1]} own prompt tokens, "
        f"{w.output[0]}-{w.output[1]} output tokens), {threads} threads, best of {repeats}"
    )
    legend = (
        f"the pool holds {w.pool_holds(False)} requests at their longest ({w.longest} tokens) without sharing, "
        f"{w.pool_holds(True)} with the {w.shared}-token prefix shared. st: engine steps (TPOT: steps per token "
        "after the first, 1 while nothing stalls; TTFT: steps from arrival to the first token); recomp.: tokens "
        "computed again after a preemption; KV avg/max: blocks in use; req/st, tok/st: requests and tokens per "
        f"step; differ: outputs unlike {first}'s at the same concurrency"
    )
    tables[0] = replace(tables[0], heading=heading)
    tables[-1] = replace(tables[-1], notes=(legend, *verdicts))
    return tables
