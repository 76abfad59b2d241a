"""``kvlab bench step``: one decode step's time against its roofline, and its profile.
Heavy imports wait until it runs."""

from __future__ import annotations

from typing import Annotated

import typer

from kvlab.cli.bench.options import ModesOption, modes_of
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


def bench_step(
    model: ModelOption = "mini",
    batches: Annotated[str, int_list_option("Comma-separated decode batch sizes")] = "1,16,32,64",
    context: Annotated[int, typer.Option(min=1, help="Prompt tokens of each request")] = 128,
    steps: Annotated[int, typer.Option(min=1, help="Timed decode steps (median); the modes take turns")] = 8,
    threads: ThreadsOption = None,
    modes: ModesOption = "fp32",
    profile: Annotated[int | None, typer.Option(help="Also print a torch.profiler table at this batch")] = None,
    json_out: JsonOption = None,
) -> None:
    """Decode step vs bare model forward, per mode, against that mode's roofline: the step's floor as the
    throughput floor prices it, its arithmetic at the measured matmul peaks or its weights (as the mode stores
    them) and the K/V it reads at the memory bandwidth, whichever is longer."""

    from kvlab.bench.modes import ModelsByDtype
    from kvlab.bench.studies.floor import Machine
    from kvlab.bench.studies.step import (
        StepTiming,
        decode_step_timings,
        memory_bandwidth,
        mode_peaks,
        profile_decode,
        step_table,
    )

    out = out_console(json_out)
    mode_list = modes_of(model, modes)
    batch_list = int_list(batches)
    loaded = load_or_exit(model)
    n_threads = set_threads(threads, loaded)
    model_in = ModelsByDtype(model, {"float32": loaded})
    machine = Machine(mode_peaks(mode_list), memory_bandwidth())
    rows: list[StepTiming] = []
    for i, b in enumerate(batch_list):
        phase(f"batch {b} ({i + 1} of {len(batch_list)})")
        rows += decode_step_timings(model_in, mode_list, b, context, steps)
    render(out, step_table(rows, machine, loaded.name, n_threads))
    if profile is not None:
        out.print(profile_decode(model_in(mode_list[0].dtype), profile, context, mode=mode_list[0]))
    dump_json(json_out, machine.as_dict() | {"steps": [r.as_dict(machine) for r in rows]})
