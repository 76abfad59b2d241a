"""``kvlab bench sweep --block-sizes ... / --cliff``: the KV-cache sweeps of ``kvlab.bench.studies.blocksize`` and
``kvlab.bench.studies.cliff``, their options, tables, figure and JSON. The command itself lives in ``kvlab.cli.bench``;
this module keeps its own imports light (the benchmarks are imported when a sweep runs)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvlab.bench.names import BLOCK_WORKLOADS, CLIFF_STRATEGIES
from kvlab.cli.common import (
    dump_json,
    fail,
    int_list,
    load_or_exit,
    name_list,
    names_option,
    out_console,
    render,
    set_threads,
)
from kvlab.cli.progress import phase
from kvlab.config import GRANULARITIES, admission_blocks

if TYPE_CHECKING:
    from rich.console import Console

    from kvlab.bench.studies.blocksize import BlockSizePoint
    from kvlab.bench.studies.cliff import CliffPoint
    from kvlab.model.loader import LoadedModel


def check_block_sizes(text: str | None) -> str | None:
    if text is not None and max(int_list(text)) > 1024:
        raise typer.BadParameter(f"block sizes must be in [1, 1024], got {text!r}")
    return text


BlockSizesOption = Annotated[
    str | None,
    typer.Option(
        callback=check_block_sizes,
        metavar="N,...",
        help="Comma-separated block sizes, e.g. 8,16,32: run the block-size sweep instead of the scheduler sweep",
    ),
]
WorkloadsOption = Annotated[
    str, names_option(BLOCK_WORKLOADS, "workloads", "Block-size sweep: comma-separated workloads")
]
GranularitiesOption = Annotated[
    str, names_option(GRANULARITIES, "prefix granularities", "Block-size sweep: comma-separated prefix granularities")
]
CliffStrategiesOption = Annotated[
    str,
    names_option(
        CLIFF_STRATEGIES,
        "strategies",
        "Cliff: comma-separated strategies (isolated: no sharing; shared-cow: sharing; shared-no-cow: unsafe)",
    ),
]


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
    from kvlab.bench.studies.kv_figures import kv_sweep_figure, save_png

    out = out_console(json_out)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    data: dict[str, Any] = {}
    block_points: list[BlockSizePoint] = []
    cliff_points: list[CliffPoint] = []
    if block_sizes is not None:
        phase(f"block sizes {block_sizes}")
        block_points = _block_size_sweep(
            loaded, int_list(block_sizes), workloads, granularities, block_requests, repeats, n_threads, data, out
        )
    if cliff:
        phase(f"cliff: concurrency {concurrency}")
        cliff_points = _cliff_sweep(
            loaded, int_list(concurrency), kv_blocks, strategies, rounds, repeats, n_threads, data, out
        )
    what = " and ".join(x for x, on in (("block sizes", block_points), ("cliff", cliff_points)) if on)
    fig = kv_sweep_figure(block_points, cliff_points, f"kvlab bench sweep ({what}): {loaded.name}, {n_threads} threads")
    save_png(fig, plot)
    out.print(f"wrote {plot}")
    dump_json(json_out, data)


def _block_size_sweep(
    loaded: LoadedModel,
    sizes: list[int],
    workloads: str,
    granularities: str,
    requests: int | None,
    repeats: int,
    n_threads: int,
    data: dict[str, Any],
    out: Console,
) -> list[BlockSizePoint]:
    from kvlab.bench.studies.blocksize import advice_verdicts, block_size_tables, block_workload, sweep_block_sizes

    max_pos = loaded.config.max_position_embeddings
    try:
        ws = [block_workload(n, max_pos, requests) for n in name_list(workloads, BLOCK_WORKLOADS, "workloads")]
    except ValueError as exc:
        fail(str(exc))
    grans = name_list(granularities, GRANULARITIES, "prefix granularities")
    points = sweep_block_sizes(loaded, ws, sizes, grans, repeats)
    for table in block_size_tables(points, ws, loaded.name, n_threads, repeats):
        render(out, table)
    data["block_sizes"] = {"points": [p.as_dict() for p in points], "verdicts": advice_verdicts(points)}
    return points


def _cliff_sweep(
    loaded: LoadedModel,
    levels: list[int],
    kv_blocks: int,
    strategies: str,
    rounds: int,
    repeats: int,
    n_threads: int,
    data: dict[str, Any],
    out: Console,
) -> list[CliffPoint]:
    from kvlab.bench.studies.cliff import CliffWorkload, by_strategy, cliff_tables, find_cliff, find_knee, sweep_cliff

    names = name_list(strategies, CLIFF_STRATEGIES, "strategies")
    w = CliffWorkload(rounds=rounds, num_blocks=kv_blocks)
    if w.longest > loaded.config.max_position_embeddings or admission_blocks(w.longest, w.block_size) > kv_blocks:
        fail(f"a {w.longest}-token request fits neither the model nor a {kv_blocks}-block pool")
    points = sweep_cliff(loaded, w, levels, names, repeats)
    for table in cliff_tables(points, w, loaded.name, n_threads, repeats):
        render(out, table)
    knees: dict[str, int | None] = {}
    cliffs: dict[str, int | None] = {}
    for name, pts in by_strategy(points).items():
        knee, cl = find_knee(pts), find_cliff(pts)
        knees[name] = None if knee is None else knee.concurrency
        cliffs[name] = None if cl is None else cl.concurrency
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
