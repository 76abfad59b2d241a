"""The figure of ``kvlab bench sweep --block-sizes`` / ``--cliff``: a matplotlib ``Figure`` made without pyplot
(no global figure state, Agg through ``savefig``), as ``kvlab.analysis.plots`` makes its figures.

One row per block-size workload (fragmentation, block-management time, prefix hits lost, throughput), then
two rows for the cliff: throughput, latency in seconds and in engine steps, preemptions and recomputed
tokens against concurrency, and the step-by-step timeline (KV usage, tokens per step by kind, preemptions)
of each strategy at the first cliff's concurrency.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from kvlab.bench.studies.blocksize import BlockSizePoint
from kvlab.bench.studies.cliff import CliffPoint, by_strategy, find_cliff, find_knee

DPI = 110


def log2_x(ax: Axes, xs: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(list(xs), [str(x) for x in xs])


def _block_row(axes: Sequence[Axes], points: Sequence[BlockSizePoint]) -> None:
    frag, cost, lost, tput = axes
    name = points[0].workload
    sizes = sorted({p.block_size for p in points})
    grans = list(dict.fromkeys(p.granularity for p in points))
    ref = [p for p in points if p.granularity == grans[0]]
    frag.plot(sizes, [p.fragmentation_pct for p in ref], "o-", label="partial blocks' empty slots")
    frag.plot(sizes, [p.reserved_pct for p in ref], "s--", label="blocks held empty")
    frag.set(xlabel="block size", ylabel="% of slots in use", title=f"{name}: internal fragmentation")
    frag.legend(fontsize=7)
    for g in grans:
        pts = [p for p in points if p.granularity == g]
        cost.plot(sizes, [p.kv_us_per_step for p in pts], "o-", label=f"KV manager ({g})")
        cost.plot(sizes, [p.prepare_us_per_step for p in pts], "s--", label=f"prepare ({g})")
        lost.plot(sizes, [p.lost_hit_pct for p in pts], "o-", label=g)
        tput.plot(sizes, [p.throughput for p in pts], "o-", label=g)
    cost.set(xlabel="block size", ylabel="µs per step", title=f"{name}: block management")
    lost.set(xlabel="block size", ylabel="% of reusable prefix", title=f"{name}: prefix hits lost")
    tput.set(xlabel="block size", ylabel="output tokens/s", title=f"{name}: throughput")
    for ax in axes:
        log2_x(ax, sizes)
    for ax in (cost, lost, tput):
        ax.legend(fontsize=7)


def _cliff_rows(top: Sequence[Axes], bottom: Sequence[Axes], points: Sequence[CliffPoint]) -> None:
    tput, lat, steps, attr = top
    series = by_strategy(points)
    xs = sorted({p.concurrency for p in points})
    cliff_at: int | None = None
    for name, pts in series.items():
        c = [p.concurrency for p in pts]
        (line,) = tput.plot(c, [p.throughput for p in pts], "o-", label=name)
        color = line.get_color()
        lat.plot(c, [1e3 * p.tpot_p99 for p in pts], "o-", color=color, label=f"{name} p99")
        lat.plot(c, [1e3 * p.tpot_p50 for p in pts], "^:", color=color, label=f"{name} p50")
        steps.plot(c, [p.tpot_steps_p99 for p in pts], "o-", color=color, label=f"{name} p99")
        attr.plot(c, [p.preemptions for p in pts], "o-", color=color, label=f"{name} preemptions")
        attr.plot(c, [p.recomputed_tokens / 100 for p in pts], "s--", color=color, label=f"{name} recomputed / 100")
        knee, cliff = find_knee(pts), find_cliff(pts)
        if knee is not None:
            tput.axvline(knee.concurrency, color=color, alpha=0.4, linestyle="--")
        if cliff is not None:
            for ax in (lat, steps):
                ax.axvline(cliff.concurrency, color=color, alpha=0.4)
            cliff_at = cliff.concurrency if cliff_at is None else min(cliff_at, cliff.concurrency)
    tput.set(xlabel="concurrent requests", ylabel="output tokens/s", title="throughput (dashed: knee)")
    lat.set(xlabel="concurrent requests", ylabel="ms per output token", title="TPOT (line: cliff)")
    steps.set(xlabel="concurrent requests", ylabel="engine steps per output token", title="TPOT in engine steps")
    attr.set(xlabel="concurrent requests", ylabel="count", title="preemptions, recomputed tokens")
    for ax in top:
        log2_x(ax, xs)
        ax.legend(fontsize=6)
    at = cliff_at if cliff_at is not None else max(xs)
    for ax, (name, pts) in zip(bottom, series.items(), strict=False):
        p = next(q for q in pts if q.concurrency == at)
        t = [r.step for r in p.timeline]
        ax.stackplot(
            t,
            [r.decode_tokens for r in p.timeline],
            [r.prefill_tokens for r in p.timeline],
            [r.recompute_tokens for r in p.timeline],
            labels=["decode", "prefill", "recompute"],
            alpha=0.6,
        )
        ax.set(xlabel="step", ylabel="tokens per step", title=f"{name} at {at} concurrent: {p.preemptions} preemptions")
        # Admission bursts of prefill dwarf the decode band: the axis stops at what most steps carry.
        tokens = sorted(r.tokens for r in p.timeline)
        ceiling = max(4 * max((r.decode_tokens for r in p.timeline), default=1), tokens[int(0.95 * (len(tokens) - 1))])
        ax.set_ylim(0, 1.1 * ceiling)
        usage = ax.twinx()
        usage.plot(t, [100 * r.used_blocks / p.num_blocks for r in p.timeline], color="black", lw=0.8)
        usage.set_ylim(0, 105)
        usage.set_ylabel("KV blocks in use %")
        pre = [r.step for r in p.timeline if r.preemptions]
        if pre:
            usage.plot(pre, [102] * len(pre), "v", color="red", ms=3, label="preemption")
        ax.legend(fontsize=6, loc="lower left", framealpha=0.8)
    for ax in list(bottom)[len(series) :]:
        ax.set_visible(False)


def kv_sweep_figure(
    block_points: Sequence[BlockSizePoint], cliff_points: Sequence[CliffPoint], title: str = ""
) -> Figure:
    workloads = list(dict.fromkeys(p.workload for p in block_points))
    rows = len(workloads) + (2 if cliff_points else 0)
    fig = Figure(figsize=(16, 3.6 * rows + 0.6))
    grid = fig.subplots(rows, 4, squeeze=False)
    for row, name in enumerate(workloads):
        _block_row(grid[row], [p for p in block_points if p.workload == name])
    if cliff_points:
        _cliff_rows(grid[len(workloads)], grid[len(workloads) + 1], cliff_points)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def save_png(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png", dpi=DPI)
