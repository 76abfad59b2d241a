"""``kvlab bench layout``: the NHD and HND cache layouts, written and read. Heavy imports wait until it runs."""

from __future__ import annotations

from typing import Annotated

import typer

from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    ThreadsOption,
    dump_json,
    int_list,
    int_list_option,
    load_or_exit,
    out_console,
    render,
    set_threads,
)
from kvlab.cli.progress import phase


def bench_layout(
    model: ModelOption = "mini",
    batches: Annotated[str, int_list_option("Comma-separated decode batch sizes")] = "1,8,32,64",
    contexts: Annotated[str, int_list_option("Comma-separated context lengths")] = "128,512,2048",
    threads: ThreadsOption = None,
    min_run_time: Annotated[float, typer.Option(min=0.01, help="Seconds of repeats per figure")] = 0.2,
    json_out: JsonOption = None,
) -> None:
    """NHD vs HND cache layout: decode writes and decode reads (gather + attention), one layer."""
    from kvlab.bench.studies.layout import compare_layouts, layout_table

    out = out_console(json_out)
    batch_list, context_list = int_list(batches), int_list(contexts)
    loaded = load_or_exit(model)
    cfg = loaded.config
    n_threads = set_threads(threads, loaded)
    phase(f"batches {batches}, contexts {contexts}")
    rows = compare_layouts(
        batch_list, context_list, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, min_run_time=min_run_time
    )
    render(out, layout_table(rows, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, n_threads))
    dump_json(json_out, [r.as_dict() for r in rows])
