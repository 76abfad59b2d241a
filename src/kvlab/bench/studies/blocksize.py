"""Block size: the founding document's advice, measured (``kvlab bench sweep --block-sizes 8,16,32``).

The advice: "8 for short sequences (mean length < 32), 32 for long ones (> 512), 16 by default; small
blocks cost block-management overhead, large ones internal fragmentation". Each block size runs the same
workload, all requests at once, greedy with EOS ignored, on a pool of the same number of *slots* whatever
the block size (the same bytes), large enough that nothing is preempted or evicted, so only the block size
changes. Per run (``StepMeter`` does the measuring):

* internal fragmentation: the empty slots of partially filled blocks, summed over steps, as a share of the
  slots of every block in use (summed over the same steps: slot-steps); blocks held whole and empty (the
  rest of a prompt being prefilled in chunks, copy-on-write spares) are counted apart (``reserved_pct``);
* block-management cost: host time per step inside the KV manager's calls and inside the runner's
  ``prepare`` (block tables -> slot mapping and context slots), plus two counts that do not depend on the
  machine: blocks handed out by the pool, and block-table entries the runner reads per step;
* prefix-hit tokens lost to block granularity: what a token-granular cache could have reused (the longest
  common prefix with sequences computed before) minus what the manager did reuse. 0 under
  ``prefix_granularity="token"``; under ``"block"`` every hit is floored to whole blocks;
* throughput: output tokens per second of engine time (the meter's own work left out).

The workloads (``--workload``):

* ``short``: 256 requests of 20-30 tokens (a 12-token shared instruction, 2-8 tokens of their own, 6-10
  output tokens): mean length ~25, under the advice's 32;
* ``long``: 16 requests sharing a 128-token prefix. The advice's "long" is > 512 tokens; the mini model has
  512 positions, so on it the requests are 440-496 tokens (mean ~470, the longest it can hold with a 48-token
  answer); on a model with 1024 positions or more (SmolLM2: 8192) they are 600-696 tokens (mean ~650).

Random token ids (seeded): the measure is about lengths and sharing, not about text.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvlab.bench.names import BLOCK_WORKLOADS
from kvlab.bench.studies.stepmeter import StepMeter, paused_gc, warm_up
from kvlab.bench.table import Column, ResultTable, result_table
from kvlab.config import GRANULARITIES, CacheConfig, SchedulerConfig, blocks_for
from kvlab.engine.engine import Engine
from kvlab.engine.sampling import SamplingParams
from kvlab.model.loader import LoadedModel

WORKLOADS = BLOCK_WORKLOADS
ADVICE = {"short": 8, "long": 32}  # the document's pick; 16 otherwise
MAX_STEPS = 100_000


@dataclass(frozen=True)
class BlockWorkload:
    name: str
    requests: int
    shared: int  # tokens of the prefix every request starts with
    distinct: tuple[int, int]  # each request's own prompt tokens after it (inclusive range)
    output: tuple[int, int]  # each request's max_tokens (inclusive range; EOS ignored)
    max_num_seqs: int
    seed: int = 0

    @property
    def longest(self) -> int:
        return self.shared + self.distinct[1] + self.output[1]

    def requests_of(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """(prompt, max_tokens) of every request, the same for every block size."""
        rng = random.Random(self.seed)
        ids = min(vocab_size, 256)
        shared = [rng.randrange(ids) for _ in range(self.shared)]
        return [
            (shared + [rng.randrange(ids) for _ in range(rng.randint(*self.distinct))], rng.randint(*self.output))
            for _ in range(self.requests)
        ]


def block_workload(name: str, max_positions: int, requests: int | None = None) -> BlockWorkload:
    """The named workload for a model of ``max_positions`` positions (``requests`` overrides its count)."""
    if name == "short":
        w = BlockWorkload("short", 256, shared=12, distinct=(2, 8), output=(6, 10), max_num_seqs=64)
    elif name == "long":
        if max_positions >= 1024:
            w = BlockWorkload("long", 16, shared=128, distinct=(440, 520), output=(32, 48), max_num_seqs=16)
        else:
            w = BlockWorkload("long", 16, shared=128, distinct=(280, 320), output=(32, 48), max_num_seqs=16)
        if w.longest > max_positions:
            raise ValueError(f"the long workload needs {w.longest} positions; the model has {max_positions}")
    else:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if requests is not None:  # as many waves of admissions as the full workload: later waves hit the prefix
        w = replace(w, requests=requests, max_num_seqs=max(1, w.max_num_seqs * requests // w.requests))
    return w


@dataclass(frozen=True)
class BlockSizePoint:
    workload: str
    block_size: int
    granularity: str
    num_blocks: int
    requests: int
    mean_length: float  # prompt + output tokens per request
    steps: int
    output_tokens: int
    seconds: float  # engine time (the meter's work left out)
    fragmentation_pct: float  # empty slots of partially filled blocks / slots in use (slot-steps)
    reserved_pct: float  # slots of blocks held empty / slots in use (slot-steps)
    kv_us_per_step: float  # inside the KV manager's calls
    prepare_us_per_step: float  # inside ModelRunner.prepare
    table_entries_per_step: float  # block-table entries the runner reads per step
    block_allocations: int  # blocks handed out by the pool
    prefix_hit_tokens: int  # prompt tokens the cache reused
    prefix_hit_potential: int  # what a token-granular cache could have reused
    lost_hit_tokens: int  # potential - reused
    cow_copies: int
    evictions: int
    preemptions: int

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps if self.steps else 0.0

    @property
    def block_management_pct(self) -> float:
        """KV manager + prepare, as a share of the step."""
        step_us = 1e3 * self.ms_per_step
        return 100.0 * (self.kv_us_per_step + self.prepare_us_per_step) / step_us if step_us else 0.0

    @property
    def lost_hit_pct(self) -> float:
        return 100.0 * self.lost_hit_tokens / self.prefix_hit_potential if self.prefix_hit_potential else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "throughput": round(self.throughput, 2),
            "ms_per_step": round(self.ms_per_step, 3),
            "block_management_pct": round(self.block_management_pct, 2),
            "lost_hit_pct": round(self.lost_hit_pct, 2),
        }

    def counts(self) -> tuple:
        """What must not change between repeats."""
        return (
            self.steps,
            self.output_tokens,
            self.fragmentation_pct,
            self.reserved_pct,
            self.block_allocations,
            self.prefix_hit_tokens,
            self.prefix_hit_potential,
            self.cow_copies,
        )


def pool_slots(w: BlockWorkload) -> int:
    """Slots that hold every request of ``w`` at its longest at once (plus a copy-on-write block each), rounded
    up to a multiple of 64 so every block size divides it: the same pool bytes for every block size."""
    slots = w.requests * (w.longest + 64)
    return -(-slots // 64) * 64


def run_block_point(loaded: LoadedModel, w: BlockWorkload, block_size: int, granularity: str) -> BlockSizePoint:
    slots = pool_slots(w)
    cache = CacheConfig(block_size=block_size, num_blocks=blocks_for(slots, block_size), prefix_granularity=granularity)
    sched = SchedulerConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=2048,
        max_model_len=min(loaded.config.max_position_embeddings, w.longest),
    )
    eng = Engine(loaded, cache, sched)
    meter = StepMeter(eng, fragmentation=True, prefix_potential=True)
    reqs = w.requests_of(loaded.config.vocab_size)
    for i, (prompt, max_tokens) in enumerate(reqs):
        meter.add(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), f"r{i}")
    with paused_gc():
        while eng.has_unfinished_requests():
            meter.advance()
            if meter.steps > MAX_STEPS:
                raise RuntimeError("the engine made no progress")
    s = eng.kv.stats
    allocated = meter.total("allocated_slots")
    return BlockSizePoint(
        workload=w.name,
        block_size=block_size,
        granularity=granularity,
        num_blocks=cache.num_blocks,
        requests=len(reqs),
        mean_length=sum(len(p) + m for p, m in reqs) / len(reqs),
        steps=meter.steps,
        output_tokens=sum(t.output_tokens for t in meter.timings.values()),
        seconds=meter.seconds,
        fragmentation_pct=100.0 * meter.total("partial_waste_slots") / allocated if allocated else 0.0,
        reserved_pct=100.0 * meter.total("reserved_slots") / allocated if allocated else 0.0,
        kv_us_per_step=1e6 * meter.per_step("kv_seconds"),
        prepare_us_per_step=1e6 * meter.per_step("prepare_seconds"),
        table_entries_per_step=meter.per_step("table_entries"),
        block_allocations=s.allocations,
        prefix_hit_tokens=meter.hit_actual,
        prefix_hit_potential=meter.hit_potential,
        lost_hit_tokens=meter.hit_potential - meter.hit_actual,
        cow_copies=s.cow_copies,
        evictions=s.evictions,
        preemptions=eng.scheduler.num_preemptions,
    )


def sweep_block_sizes(
    loaded: LoadedModel,
    workloads: Sequence[BlockWorkload],
    block_sizes: Sequence[int],
    granularities: Sequence[str] = GRANULARITIES,
    repeats: int = 1,
) -> list[BlockSizePoint]:
    """Every workload x granularity x block size; with ``repeats`` every setting of a workload takes its turn
    that many times (noise on a shared machine spreads over all of them) and the fastest run of each counts (the
    counts must not change between runs)."""
    if bad := sorted(set(granularities) - set(GRANULARITIES)):
        raise ValueError(f"unknown granularity {bad}; known: {', '.join(GRANULARITIES)}")
    warm_up(loaded)
    out: list[BlockSizePoint] = []
    for w in workloads:
        settings = [(g, bs) for g in granularities for bs in block_sizes]
        best: dict[tuple[str, int], BlockSizePoint] = {}
        for _ in range(repeats):
            for g, bs in settings:
                p = run_block_point(loaded, w, bs, g)
                prev = best.get((g, bs))
                if prev is not None and prev.counts() != p.counts():
                    raise RuntimeError(f"{w.name} at block size {bs} ({g}) changed between repeats")
                if prev is None or p.seconds < prev.seconds:
                    best[g, bs] = p
        out += [best[s] for s in settings]
    return out


def _each(points: Sequence[BlockSizePoint], fmt: str, key: Callable[[BlockSizePoint], float]) -> str:
    return ", ".join(f"{p.block_size}: {format(key(p), fmt)}" for p in points)


def advice_verdicts(points: Sequence[BlockSizePoint], tie: float = 0.05) -> list[str]:
    """One line per workload and granularity: the block size the throughput favours against the document's pick
    (within ``tie``, 5%, of the fastest counts as a tie), with the fragmentation and block-management figures."""
    lines = []
    for name, g in dict.fromkeys((p.workload, p.granularity) for p in points):
        mine = sorted((p for p in points if p.workload == name and p.granularity == g), key=lambda p: p.block_size)
        advised = ADVICE.get(name, 16)
        fastest = max(mine, key=lambda p: p.throughput)
        pick = next((p for p in mine if p.block_size == advised), None)
        if pick is None:
            verdict = f"{advised} was not measured"
        elif pick is fastest:
            verdict = "the advice holds"
        elif pick.throughput >= (1 - tie) * fastest.throughput:
            verdict = f"a tie: {advised} is within {tie:.0%} of {fastest.block_size}"
        else:
            verdict = f"the advice does not hold: {fastest.block_size} is fastest"
        each = functools.partial(_each, mine)
        lines.append(
            f"{name}, {g} granularity (mean {mine[0].mean_length:.0f} tokens; advised {advised}): tok/s "
            f"{each('.0f', lambda p: p.throughput)}; fragmentation % {each('.1f', lambda p: p.fragmentation_pct)}; "
            f"KV + prepare µs/step {each('.0f', lambda p: p.kv_us_per_step + p.prepare_us_per_step)}; prefix hits "
            f"lost % {each('.0f', lambda p: p.lost_hit_pct)} -> {verdict}"
        )
    return lines


def block_size_tables(
    points: Sequence[BlockSizePoint], workloads: Sequence[BlockWorkload], model: str, threads: int, repeats: int
) -> list[ResultTable]:
    """One table per workload; under the last, what the columns mean, the points that preempted or evicted,
    and ``advice_verdicts``."""
    tables = []
    for w in workloads:
        mine = [p for p in points if p.workload == w.name]
        if not mine:
            continue
        columns = ("block", "granul.", "steps", "frag. %", "held empty %", "KV µs/step", "prepare µs/step", "% of step")
        more = ("table entries/step", "blocks taken", "hits / reusable", "lost %", "CoW", "tok/s")
        tables.append(
            result_table(
                f"block sizes, {w.name}: {model}, {w.requests} requests of {mine[0].mean_length:.0f} tokens on "
                f"average ({w.shared} shared), {w.max_num_seqs} seats, a pool of "
                f"{mine[0].num_blocks * mine[0].block_size} slots, {threads} threads, best of {repeats}",
                [Column(c, no_wrap=c == "hits / reusable") for c in (*columns, *more)],
                [
                    (
                        str(p.block_size),
                        p.granularity,
                        str(p.steps),
                        f"{p.fragmentation_pct:.1f}",
                        f"{p.reserved_pct:.1f}",
                        f"{p.kv_us_per_step:.0f}",
                        f"{p.prepare_us_per_step:.0f}",
                        f"{p.block_management_pct:.1f}",
                        f"{p.table_entries_per_step:.0f}",
                        str(p.block_allocations),
                        f"{p.prefix_hit_tokens}/{p.prefix_hit_potential}",
                        f"{p.lost_hit_pct:.1f}",
                        str(p.cow_copies),
                        f"{p.throughput:.0f}",
                    )
                    for p in mine
                ],
            )
        )
    notes = [
        "fragmentation: empty slots of partially filled blocks / slots in use, over every step; held empty: whole "
        "blocks held before they are written (chunked prompts, CoW spares); hits / reusable: prompt tokens the "
        "cache reused / the longest common prefix with sequences computed before (what token granularity reuses); "
        "lost: the rest; % of step: KV manager + prepare. Same pool bytes for every block size; nothing is "
        "preempted or evicted.",
        *(
            f"[yellow]note:[/yellow] {p.workload} at block size {p.block_size}: {p.preemptions} preemptions, "
            f"{p.evictions} evictions (lost hits include evicted prefixes)"
            for p in points
            if p.preemptions or p.evictions
        ),
        *advice_verdicts(points),
    ]
    if tables:
        tables[-1] = replace(tables[-1], notes=tuple(notes))
    return tables
