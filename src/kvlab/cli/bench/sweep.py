"""``kvlab bench sweep``: the scheduler sweep, and the block-size and cliff studies (``kv_sweeps``).
Heavy imports wait until it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.bench.kv_sweeps import BlockSizesOption, CliffStrategiesOption, GranularitiesOption, WorkloadsOption
from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    ThreadsOption,
    dump_json,
    int_list,
    int_list_option,
    load_or_exit,
    out_console,
    plot_option,
    render,
    set_threads,
)
from kvlab.cli.progress import phase


def bench_sweep(
    model: ModelOption = "mini",
    num_prompts: Annotated[
        int, typer.Option(min=1, help="Requests in the burst, one shared-prefix prompt each (W<N>)")
    ] = 128,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    max_num_seqs: Annotated[str, int_list_option("Comma-separated max_num_seqs values")] = "8,16,32,64,128",
    max_num_batched_tokens: Annotated[
        str, int_list_option("Comma-separated token budgets (run at the knee's max_num_seqs)")
    ] = "64,128,256,512,1024,2048",
    threads: ThreadsOption = None,
    plot: Annotated[
        Path, plot_option("PNG of throughput and latency (of the block-size and cliff sweeps with those)")
    ] = Path("sweep.png"),
    json_out: JsonOption = None,
    block_sizes: BlockSizesOption = None,
    workload: WorkloadsOption = "short,long",
    granularity: GranularitiesOption = "token,block",
    block_requests: Annotated[
        int | None, typer.Option(min=1, help="Block-size sweep: requests per workload (default: short 256, long 16)")
    ] = None,
    cliff: Annotated[
        bool,
        typer.Option("--cliff", help="Run the concurrency sweep against a fixed KV pool, not the scheduler sweep"),
    ] = False,
    concurrency: Annotated[
        str, int_list_option("Cliff: comma-separated numbers of concurrent requests")
    ] = "1,2,4,8,16,32",
    kv_blocks: Annotated[int, typer.Option(min=2, help="Cliff: blocks of 16 tokens in the KV pool")] = 64,
    strategies: CliffStrategiesOption = "isolated,shared-cow",
    rounds: Annotated[int, typer.Option(min=1, help="Cliff: requests each client sends, one after another")] = 4,
    repeats: Annotated[
        int, typer.Option(min=1, help="Block-size and cliff sweeps: runs per point; the fastest counts")
    ] = 1,
) -> None:
    """Throughput and p50/p99 latency over max_num_seqs, then over max_num_batched_tokens; finds the knee.

    --block-sizes: per block size, internal fragmentation, time in the KV manager and in building block tables
    per step, prefix-hit tokens lost to block granularity, throughput (short and long workloads). --cliff:
    concurrency against a fixed KV pool, with and without prefix sharing: knee, cliff, and per-step attribution
    (preemptions, recomputed tokens, copies, evictions, KV usage, tokens per step). Either or both replace the
    scheduler sweep."""
    if block_sizes is not None or cliff:
        from kvlab.cli.bench.kv_sweeps import run_kv_sweeps

        run_kv_sweeps(
            model=model,
            threads=threads,
            block_sizes=block_sizes,
            workloads=workload,
            granularities=granularity,
            block_requests=block_requests,
            cliff=cliff,
            concurrency=concurrency,
            kv_blocks=kv_blocks,
            strategies=strategies,
            rounds=rounds,
            repeats=repeats,
            plot=plot,
            json_out=json_out,
        )
        return
    from kvlab.bench.studies.sweep import find_knee, plot_sweep, run_point, sweep_table
    from kvlab.bench.workloads import shared_prefix_prompts

    out = out_console(json_out)
    seqs, budgets = int_list(max_num_seqs), int_list(max_num_batched_tokens)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    prompts = shared_prefix_prompts(loaded, num_prompts)
    phase("warm-up")
    run_point(loaded, prompts[:2], 2, 2, 256)
    seq_points = []
    for i, s in enumerate(seqs):
        phase(f"max_num_seqs {s} ({i + 1} of {len(seqs)})")
        seq_points.append(run_point(loaded, prompts, max_tokens, s, max(budgets)))
    knee = find_knee(seq_points)
    at = knee.max_num_seqs if knee is not None else max(seqs)
    token_points = []
    for i, b in enumerate(budgets):
        phase(f"max_num_batched_tokens {b} at max_num_seqs {at} ({i + 1} of {len(budgets)})")
        token_points.append(run_point(loaded, prompts, max_tokens, at, b))
    render(out, sweep_table(seq_points, token_points, knee, loaded.name, num_prompts, max_tokens, n_threads))
    plot_sweep(seq_points, token_points, knee, f"kvlab bench sweep: {loaded.name}, {num_prompts} requests", plot)
    out.print(f"wrote {plot}")
    dump_json(
        json_out,
        {
            "knee_max_num_seqs": None if knee is None else knee.max_num_seqs,
            "max_num_seqs": [p.as_dict() for p in seq_points],
            "max_num_batched_tokens": [p.as_dict() for p in token_points],
        },
    )
