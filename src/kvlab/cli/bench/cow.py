"""``kvlab bench cow``: copy-on-write decided at the write or at allocation. Heavy imports wait until it runs."""

from __future__ import annotations

from typing import Annotated

import typer

from kvlab.bench.names import COW_WORKLOADS
from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    ThreadsOption,
    dump_json,
    load_or_exit,
    name_list,
    names_option,
    out_console,
    render,
    set_threads,
)
from kvlab.cli.progress import phase
from kvlab.config import CacheConfig


def bench_cow(
    model: ModelOption = "mini",
    workloads: Annotated[str, names_option(COW_WORKLOADS, "workloads")] = "passphrase,fork,chat",
    trials: Annotated[int, typer.Option(min=1, help="passphrase: trials of 2 concurrent requests")] = 100,
    num_prompts: Annotated[int, typer.Option(min=1, help="fork: shared-prefix prompts (W<N>)")] = 32,
    n: Annotated[int, typer.Option(min=2, help="fork: samples per prompt (forks at the first token)")] = 4,
    sessions: Annotated[int, typer.Option(min=1, help="chat: concurrent sessions")] = 8,
    turns: Annotated[int, typer.Option(min=1, help="chat: turns per session")] = 6,
    max_tokens: Annotated[int, typer.Option(min=1, help="fork and chat: tokens per answer")] = 16,
    block_size: Annotated[int, typer.Option(min=1)] = CacheConfig.block_size,
    num_blocks: Annotated[int, typer.Option(min=2)] = CacheConfig.num_blocks,
    repeats: Annotated[int, typer.Option(min=1, help="Runs per mode, taking turns; the fastest counts")] = 3,
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
) -> None:
    """Copy-on-write decided at the write or at allocation (cow_check=write|allocate) on three workloads: copies
    made, made at allocation, not needed, extra against write, bytes copied, time in the KV manager and in
    the copies per step, total time. Both modes must give the same tokens (exit 1 otherwise)."""
    from kvlab.bench.studies.cow import CowSizes, compare_cow_checks, cow_table
    from kvlab.config import ConfigError

    out = out_console(json_out)
    try:
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    names = name_list(workloads, COW_WORKLOADS, "workloads")
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    sizes = CowSizes(trials=trials, requests=num_prompts, n=n, sessions=sessions, turns=turns, max_tokens=max_tokens)
    phase(f"write against allocate on {', '.join(names)}")
    rows = compare_cow_checks(loaded, names, sizes, cache, repeats=repeats)
    render(out, cow_table(rows, loaded.name, block_size, num_blocks, n_threads, repeats))
    dump_json(json_out, [row.as_dict() for row in rows])
    bad = [row for row in rows if not row.identical]
    for row in bad:
        shown = ", ".join(row.mismatches[:5]) + (" ..." if len(row.mismatches) > 5 else "")
        out.print(
            f"[red bold]MISMATCH[/red bold] {row.workload}: {len(row.mismatches)} request(s) got different tokens "
            f"under cow_check=write and allocate: {shown}"
        )
    if bad:
        raise typer.Exit(1)
