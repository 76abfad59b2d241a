"""``kvlab bench scaling``: how cost grows with the work, against each mode's roofline
(``kvlab.bench.studies.scaling``). The benchmark is imported when the command runs, so ``kvlab --help`` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.bench.options import ModesOption, modes_of
from kvlab.cli.common import (
    JsonOption,
    ModelOption,
    ThreadsOption,
    dump_json,
    fail,
    int_list,
    int_list_option,
    load_or_exit,
    name_list,
    names_option,
    out_console,
    plot_option,
    render,
    set_threads,
)
from kvlab.cli.progress import phase

PARTS = ("decode", "prefill", "memory")


def bench_scaling(
    model: ModelOption = "mini",
    modes: ModesOption = "fp32",
    parts: Annotated[str, names_option(PARTS, "parts", "Comma-separated parts to run")] = ",".join(PARTS),
    batches: Annotated[
        str, int_list_option("Decode: batch sweep (also the memory grid's requests)")
    ] = "1,2,4,8,16,32,64,128,256",
    context: Annotated[int, typer.Option(min=1, help="Decode: each request's prompt tokens in the batch sweep")] = 128,
    contexts: Annotated[
        str,
        int_list_option(
            "Decode: context sweep's prompt tokens, cut to the model's positions minus the decoded steps (also the "
            "memory grid's contexts, uncut)"
        ),
    ] = "128,256,512,1024,2048,4096,8192",
    context_batch: Annotated[int, typer.Option(min=1, help="Decode: requests in the context sweep")] = 8,
    prompt_lengths: Annotated[
        str, int_list_option("Prefill: prompt tokens, cut to the model's positions")
    ] = "128,256,512,1024,2048,4096",
    steps: Annotated[int, typer.Option(min=1, help="Decode: timed steps per point (median); the modes take turns")] = 6,
    repeats: Annotated[int, typer.Option(min=1, help="Prefill: runs per point; the fastest counts")] = 2,
    chunk: Annotated[
        int | None,
        typer.Option(min=1, help="Prefill: max_num_batched_tokens (chunked prefill); default: the prompt, one step"),
    ] = None,
    threads: ThreadsOption = None,
    plot: Annotated[Path | None, plot_option("Also write the parts run as a PNG here")] = None,
    json_out: JsonOption = None,
) -> None:
    """Decode step time against batch and against context, prefill tokens/s against prompt length (cold and with
    the first half cached), KV memory against requests x context: each timing against its mode's roofline (its
    FLOPs at the matmul peak of its dtype, or its weights at the memory bandwidth, whichever is longer)."""
    from kvlab.bench.modes import ModelsByDtype
    from kvlab.bench.studies.scaling import ScalingSizes
    from kvlab.bench.studies.scaling import bench_scaling as run
    from kvlab.bench.studies.scaling_report import scaling_tables

    out = out_console(json_out)
    mode_list = modes_of(model, modes)
    chosen = name_list(parts, PARTS, "parts", flag="--parts")
    sizes = ScalingSizes(
        batches=tuple(int_list(batches)),
        context=context,
        contexts=tuple(int_list(contexts)),
        context_batch=context_batch,
        prompt_lengths=tuple(int_list(prompt_lengths)),
        steps=steps,
        repeats=repeats,
        chunk=chunk,
    )
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    phase(f"{', '.join(chosen)} under {', '.join(m.name for m in mode_list)}")
    try:
        result = run(
            ModelsByDtype(model, {"float32": loaded}),
            mode_list,
            sizes,
            decode="decode" in chosen,
            prefill="prefill" in chosen,
            memory="memory" in chosen,
            threads=n_threads,
        )
    except ValueError as exc:  # the model's positions hold fewer tokens than the decode steps need
        fail(str(exc))
    for table in scaling_tables(result):
        render(out, table)
    if plot is not None:
        from kvlab.bench.studies.kv_figures import save_png
        from kvlab.bench.studies.scaling_report import scaling_figure

        save_png(scaling_figure(result), plot)
        out.print(f"wrote {plot}", highlight=False)
    dump_json(json_out, result.as_dict())
