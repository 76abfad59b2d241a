"""``kvlab bench manager``: the KV cache manager's own rates, pure Python and no model
(``kvlab.bench.studies.manager_rates``). The benchmark is imported when the command runs, so ``kvlab --help``
stays fast."""

from __future__ import annotations

from typing import Annotated

import typer

from kvlab.cli.common import JsonOption, dump_json, fail, int_list, int_list_option, out_console, render
from kvlab.cli.progress import phase


def bench_manager(
    num_requests: Annotated[int, typer.Option(min=1, help="Steps part: requests, one arriving per step")] = 1000,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Steps part: tokens per prompt")] = 128,
    shared_prefixes: Annotated[
        str, int_list_option("Steps part: comma-separated shared system prompt lengths (tokens, 0: none)", lo=0)
    ] = "0,64",
    decode_tokens: Annotated[int, typer.Option(min=0, help="Steps part: tokens each request decodes")] = 16,
    num_blocks: Annotated[int, typer.Option(min=1, help="Steps part: blocks in the pool")] = 256,
    repeats: Annotated[int, typer.Option(min=1, help="Steps part: runs; each phase's fastest counts")] = 5,
    lengths: Annotated[
        str, int_list_option("Lookup part: comma-separated cached prompt lengths")
    ] = "256,512,1024,2048,4096,8192,16384",
    lookup_repeats: Annotated[int, typer.Option(min=1, help="Lookup part: lookups per length")] = 20,
    live_requests: Annotated[int, typer.Option(min=1, help="Live part: requests alive at once")] = 10_000,
    admit_per_step: Annotated[
        int, typer.Option(min=1, help="Live part: admissions per step (a step's admissions cannot hit each other)")
    ] = 256,
    live_repeats: Annotated[int, typer.Option(min=1, help="Live part: runs; the fastest of each timing")] = 3,
    block_size: Annotated[int, typer.Option(min=1, max=1024)] = 16,
    json_out: JsonOption = None,
) -> None:
    """KV cache manager rates (no model): allocate/append/free per engine step, prefix lookup against prompt
    length, many live requests at once."""
    from kvlab.bench.studies.manager_rates import (
        live_table,
        lookup_scaling,
        lookup_table,
        many_live,
        step_rates,
        steps_table,
    )

    out = out_console(json_out)
    shared = int_list(shared_prefixes, lo=0)
    if max(shared) >= prompt_tokens:
        raise typer.BadParameter(
            f"each must be below --prompt-tokens ({prompt_tokens})", param_hint="--shared-prefixes"
        )
    phase("steps part")
    try:
        steps = [
            step_rates(num_requests, s, prompt_tokens, decode_tokens, block_size, num_blocks, repeats) for s in shared
        ]
    except ValueError as exc:  # a pool too small for the requests live at once
        fail(str(exc))
    render(out, steps_table(steps))
    phase("lookup part")
    lookups = lookup_scaling(int_list(lengths), block_size, lookup_repeats)
    render(out, lookup_table(lookups, lookup_repeats))
    phase("live part")
    live = [
        many_live(live_requests, g, admit_per_step=admit_per_step, block_size=block_size, repeats=live_repeats)
        for g in ("token", "block")
    ]
    render(out, live_table(live, live_repeats))
    dump_json(
        json_out,
        {
            "steps": [r.as_dict() for r in steps],
            "lookup": [r.as_dict() for r in lookups],
            "live": [r.as_dict() for r in live],
        },
    )
