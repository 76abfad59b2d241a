"""``kvlab bench sweep --block-sizes ... / --cliff``: the KV-cache sweeps of ``kvlab.bench.blocksize`` and
``kvlab.bench.cliff``, their tables, figure and JSON. The command itself lives in ``kvlab.cli.bench``; this
module keeps its own imports light (the benchmarks are imported when a sweep runs)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from kvlab.cli.common import console, dump_json, int_list, load_or_exit, set_threads

BLOCK_WORKLOADS = ("short", "long")
GRANULARITY_NAMES = ("token", "block")


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or set(names) - set(allowed):
        raise typer.BadParameter(f"expected comma-separated {what} from {', '.join(allowed)}, got {text!r}")
    return list(dict.fromkeys(names))


def check_block_sizes(text: str | None) -> str | None:
    if text is not None and max(int_list(text)) > 1024:
        raise typer.BadParameter(f"block sizes must be in [1, 1024], got {text!r}")
    return text


def check_workloads(text: str) -> str:
    _names(text, BLOCK_WORKLOADS, "workloads")
    return text


def check_granularities(text: str) -> str:
    _names(text, GRANULARITY_NAMES, "prefix granularities")
    return text


def check_strategies(text: str) -> str:
    from kvlab.experiment.strategies import BUILTIN_STRATEGIES

    allowed = tuple(n for n, s in BUILTIN_STRATEGIES.items() if not (s.inject_empty or s.scheduler))
    _names(text, allowed, "strategies")
    return text


def run_kv_sweeps(
    *,
    model: str,
    threads: int | None,
    block_sizes: str | None,
    workloads: str,
    granularities: str,
    block_requests: int | None,
    cliff: bool,
    concurrency: str,
    kv_blocks: int,
    strategies: str,
    rounds: int,
    repeats: int,
    plot: Path,
    json_out: Path | None,
) -> None:
    from kvlab.bench.kv_figures import kv_sweep_figure, save_png

    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    data: dict[str, Any] = {}
    block_points: list = []
    cliff_points: list = []
    if block_sizes is not None:
        block_points = _block_size_sweep(
            loaded, int_list(block_sizes), workloads, granularities, block_requests, repeats, n_threads, data
        )
    if cliff:
        cliff_points = _cliff_sweep(
            loaded, int_list(concurrency), kv_blocks, strategies, rounds, repeats, n_threads, data
        )
    what = " and ".join(x for x, on in (("block sizes", block_points), ("cliff", cliff_points)) if on)
    fig = kv_sweep_figure(block_points, cliff_points, f"kvlab bench sweep ({what}): {loaded.name}, {n_threads} threads")
    save_png(fig, plot)
    console.print(f"wrote {plot}")
    dump_json(json_out, data)


def _block_size_sweep(
    loaded: Any,
    sizes: list[int],
    workloads: str,
    granularities: str,
    requests: int | None,
    repeats: int,
    n_threads: int,
    data: dict[str, Any],
) -> list:
    from rich.table import Table

    from kvlab.bench.blocksize import advice_verdicts, block_workload, sweep_block_sizes

    max_pos = loaded.config.max_position_embeddings
    try:
        ws = [block_workload(n, max_pos, requests) for n in _names(workloads, BLOCK_WORKLOADS, "workloads")]
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    points = sweep_block_sizes(loaded, ws, sizes, _names(granularities, GRANULARITY_NAMES, "granularities"), repeats)
    for w in ws:
        mine = [p for p in points if p.workload == w.name]
        table = Table(
            title=f"block sizes, {w.name}: {loaded.name}, {w.requests} requests of {mine[0].mean_length:.0f} tokens on "
            f"average ({w.shared} shared), {w.max_num_seqs} seats, a pool of {mine[0].num_blocks * mine[0].block_size} "
            f"slots, {n_threads} threads, best of {repeats}"
        )
        columns = ("block", "granul.", "steps", "frag. %", "held empty %", "KV µs/step", "prepare µs/step", "% of step")
        for col in (*columns, "table entries/step", "blocks taken", "hits / reusable", "lost %", "CoW", "tok/s"):
            table.add_column(col, no_wrap=col == "hits / reusable")
        for p in mine:
            table.add_row(
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
        console.print(table)
    console.print(
        "fragmentation: empty slots of partially filled blocks / slots in use, over every step; held empty: whole "
        "blocks held before they are written (chunked prompts, CoW spares); hits / reusable: prompt tokens the "
        "cache reused / the longest common prefix with sequences computed before (what token granularity reuses); "
        "lost: the rest; % of step: KV manager + prepare. Same pool bytes for every block size; nothing is "
        "preempted or evicted."
    )
    for p in points:
        if p.preemptions or p.evictions:
            console.print(
                f"[yellow]note:[/yellow] {p.workload} at block size {p.block_size}: {p.preemptions} preemptions, "
                f"{p.evictions} evictions (lost hits include evicted prefixes)"
            )
    verdicts = advice_verdicts(points)
    for line in verdicts:
        console.print(line)
    data["block_sizes"] = {"points": [p.as_dict() for p in points], "verdicts": verdicts}
    return points


def _cliff_sweep(
    loaded: Any,
    levels: list[int],
    kv_blocks: int,
    strategies: str,
    rounds: int,
    repeats: int,
    n_threads: int,
    data: dict[str, Any],
) -> list:
    from rich.table import Table

    from kvlab.bench.cliff import CliffWorkload, by_strategy, find_cliff, find_knee, sweep_cliff
    from kvlab.experiment.strategies import BUILTIN_STRATEGIES

    names = _names(strategies, tuple(BUILTIN_STRATEGIES), "strategies")
    w = CliffWorkload(rounds=rounds, num_blocks=kv_blocks)
    if w.longest > loaded.config.max_position_embeddings or -(-w.longest // w.block_size) + 1 > kv_blocks:
        console.print(
            f"[red]error:[/red] a {w.longest}-token request fits neither the model nor a {kv_blocks}-block pool"
        )
        raise typer.Exit(2)
    points = sweep_cliff(loaded, w, levels, names, repeats)
    console.print(
        f"[bold]cliff[/bold]: {loaded.name}, {kv_blocks} blocks of {w.block_size} tokens, closed loop of {rounds} "
        f"requests per client ({w.shared} shared + {w.distinct[0]}-{w.distinct[1]} own prompt tokens, "
        f"{w.output[0]}-{w.output[1]} output tokens), {n_threads} threads, best of {repeats}",
        highlight=False,
    )
    knees: dict[str, int | None] = {}
    cliffs: dict[str, int | None] = {}
    for name, pts in by_strategy(points).items():
        knee, cl = find_knee(pts), find_cliff(pts)
        knees[name] = None if knee is None else knee.concurrency
        cliffs[name] = None if cl is None else cl.concurrency
        table = Table(title=f"cliff: {name}")
        columns = ("conc.", "", "tok/s", "TPOT p99 ms", "E2E p50 s", "TPOT p99 st", "TTFT p99 st", "preempt")
        for col in (*columns, "recomp.", "CoW/evict", "KV % avg/max", "req/st", "tok/st", "ms/st", "differ"):
            table.add_column(col, justify="right")
        for p in pts:
            table.add_row(
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
                "-" if p.strategy == names[0] else str(p.differing_outputs),
            )
        console.print(table)
    console.print(
        f"the pool holds {w.pool_holds(False)} requests at their longest ({w.longest} tokens) without sharing, "
        f"{w.pool_holds(True)} with the {w.shared}-token prefix shared. st: engine steps (TPOT: steps per token after "
        "the first, 1 while nothing stalls; TTFT: steps from arrival to the first token); recomp.: tokens computed "
        "again after a preemption; KV avg/max: blocks in use; req/st, tok/st: requests and tokens per step; "
        f"differ: outputs unlike {names[0]}'s at the same concurrency"
    )
    for name in knees:
        console.print(
            f"{name}: knee (throughput +<10% after it) at {knees[name] or 'none'}, cliff (TPOT p99 in steps x1.5) at "
            f"{cliffs[name] or 'none'}",
            highlight=False,
        )
    at = {name: c for name, c in cliffs.items() if c is not None}
    timelines = {
        name: [asdict(r) for r in next(p for p in points if p.strategy == name and p.concurrency == c).timeline]
        for name, c in at.items()
    }
    data["cliff"] = {
        "workload": asdict(w),
        "pool_holds": {"sharing_off": w.pool_holds(False), "sharing_on": w.pool_holds(True)},
        "points": [p.as_dict() for p in points],
        "knee": knees,
        "cliff": cliffs,
        "timeline_at_cliff": timelines,
    }
    return points
