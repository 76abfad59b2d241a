"""Scheduler sweep: throughput and latency as ``max_num_seqs`` and ``max_num_batched_tokens`` grow.

Every request arrives at once (an offline burst, as in ``kvlab bench throughput``), so latencies include
queueing: with few seats a request waits for others to finish; with many, each step carries a bigger
batch and every token takes longer. The knee is where adding seats stops paying: the last setting
after which throughput grows by less than ``min_gain`` while the per-token latency keeps rising.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvlab.bench.studies.throughput import kvlab_knobs
from kvlab.bench.table import ResultTable, result_table
from kvlab.model.loader import LoadedModel


@dataclass(frozen=True)
class SweepPoint:
    max_num_seqs: int
    max_num_batched_tokens: int
    seconds: float
    output_tokens: int
    steps: int
    ttft_p50: float  # seconds from arrival to the first token
    ttft_p99: float
    tpot_p50: float  # seconds per output token after the first
    tpot_p99: float
    e2e_p50: float  # seconds from arrival to the last token
    e2e_p99: float

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        return asdict(self) | {"throughput": round(self.throughput, 2)}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of a non-empty sequence by numpy's linear interpolation (its default), as
    ``kvlab bench serve`` and ``bench tenants`` compute theirs and vLLM's bench serve does: "p99" means one thing
    in every kvlab table."""
    return float(np.percentile(values, q))


def run_point(
    loaded: LoadedModel, prompts: Sequence[list[int]], max_tokens: int, max_num_seqs: int, max_num_batched_tokens: int
) -> SweepPoint:
    from kvlab import LLM, SamplingParams

    knobs = kvlab_knobs(
        prompts,
        max_tokens,
        loaded.config.max_position_embeddings,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    llm = LLM(loaded, **knobs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    eng = llm.engine
    start = time.monotonic()
    ids = [eng.add_request(p, params, arrival_time=start) for p in prompts]
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.advance()
    seconds = time.perf_counter() - t0
    outs = [eng.output(i) for i in ids]
    # (arrival, first token, finished) per request. Only a failed request can lack the last two.
    times: list[tuple[float, float, float]] = []
    for o in outs:
        m = o.metrics
        if m.first_token_time is None or m.finished_time is None:
            raise RuntimeError(f"request {o.request_id} produced no timings: {o.error or 'no first token'}")
        times.append((m.arrival_time, m.first_token_time, m.finished_time))
    ttft = [first - arrival for arrival, first, _ in times]
    e2e = [finished - arrival for arrival, _, finished in times]
    tpot = [
        (finished - first) / (len(o.token_ids) - 1)
        for o, (_, first, finished) in zip(outs, times, strict=True)
        if len(o.token_ids) > 1
    ] or [0.0]
    return SweepPoint(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        seconds=seconds,
        output_tokens=sum(len(o.token_ids) for o in outs),
        steps=eng.stats().steps,
        ttft_p50=statistics.median(ttft),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=statistics.median(tpot),
        tpot_p99=percentile(tpot, 99),
        e2e_p50=statistics.median(e2e),
        e2e_p99=percentile(e2e, 99),
    )


def find_knee(points: Sequence[SweepPoint], min_gain: float = 0.10) -> SweepPoint | None:
    """The last point before throughput stops growing by ``min_gain`` (10%) while per-token latency
    rises; None if throughput still grows at the end of the sweep."""
    ordered = sorted(points, key=lambda p: p.max_num_seqs)
    for here, nxt in itertools.pairwise(ordered):
        if nxt.throughput < here.throughput * (1 + min_gain) and nxt.tpot_p50 > here.tpot_p50:
            return here
    return None


def sweep_table(
    seq_points: Sequence[SweepPoint],
    token_points: Sequence[SweepPoint],
    knee: SweepPoint | None,
    model: str,
    requests: int,
    max_tokens: int,
    threads: int,
) -> ResultTable:
    """The max_num_seqs points, then the token-budget ones, as one table; the note says where the knee is."""
    if knee is None:
        top = max(p.max_num_seqs for p in seq_points)
        note = f"no knee: throughput still grows by 10% or more at max_num_seqs={top}"
    else:
        note = (
            f"knee at max_num_seqs={knee.max_num_seqs}: beyond it throughput grows by less than 10% "
            "while the per-token latency climbs"
        )
    columns = ("max_num_seqs", "max_batched_tokens", "steps", "tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms")
    return result_table(
        f"sweep: {model}, {requests} requests x {max_tokens} tokens, {threads} threads",
        (*columns, "e2e p50/p99 s"),
        [
            (
                f"{p.max_num_seqs}" + (" (knee)" if p is knee else ""),
                str(p.max_num_batched_tokens),
                str(p.steps),
                f"{p.throughput:.1f}",
                f"{1e3 * p.ttft_p50:.0f} / {1e3 * p.ttft_p99:.0f}",
                f"{1e3 * p.tpot_p50:.1f} / {1e3 * p.tpot_p99:.1f}",
                f"{p.e2e_p50:.2f} / {p.e2e_p99:.2f}",
            )
            for p in [*seq_points, *token_points]
        ],
        notes=[note],
    )


def plot_sweep(
    seq_points: Sequence[SweepPoint], token_points: Sequence[SweepPoint], knee: SweepPoint | None, title: str, out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for row, (points, key, label) in enumerate(
        (
            (seq_points, "max_num_seqs", "max_num_seqs"),
            (token_points, "max_num_batched_tokens", "max_num_batched_tokens"),
        )
    ):
        pts = sorted(points, key=lambda p: getattr(p, key))
        xs = [getattr(p, key) for p in pts]
        tput, lat = axes[row]
        tput.plot(xs, [p.throughput for p in pts], "o-")
        tput.set(xlabel=label, ylabel="output tokens/s", title=f"throughput vs {label}")
        if key == "max_num_seqs":
            lat.plot(xs, [1e3 * p.tpot_p50 for p in pts], "o-", label="TPOT p50")
            lat.plot(xs, [1e3 * p.tpot_p99 for p in pts], "s--", label="TPOT p99")
            lat.plot(xs, [1e3 * p.e2e_p50 / 10 for p in pts], "^:", label="end-to-end p50 / 10")
            if knee is not None:
                tput.axvline(knee.max_num_seqs, color="red", alpha=0.5, label=f"knee: {knee.max_num_seqs}")
                lat.axvline(knee.max_num_seqs, color="red", alpha=0.5)
                tput.legend()
        else:
            lat.plot(xs, [1e3 * p.ttft_p50 for p in pts], "o-", label="TTFT p50")
            lat.plot(xs, [1e3 * p.ttft_p99 for p in pts], "s--", label="TTFT p99")
            lat.plot(xs, [1e3 * p.tpot_p99 for p in pts], "^:", label="TPOT p99")
        lat.set(xlabel=label, ylabel="ms", title=f"latency vs {label}")
        lat.legend()
        for ax in (tput, lat):  # settings double: a log-2 axis with only their own ticks labelled
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
            ax.set_xticks(xs, [str(x) for x in xs])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
