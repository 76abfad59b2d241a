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
    """Decode step vs bare model forward, per mode, against that mode's roofline: its arithmetic at the best
    matmul rate in its dtype, or its weights (as the mode stores them) at the memory bandwidth, whichever is
    longer."""

    from kvlab.bench.modes import ModelsByDtype
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
    peaks = mode_peaks(mode_list)
    bandwidth = memory_bandwidth()
    rows: list[StepTiming] = []
    for i, b in enumerate(batch_list):
        phase(f"batch {b} ({i + 1} of {len(batch_list)})")
        rows += decode_step_timings(model_in, mode_list, b, context, steps)
    dtype_of = {m.name: m.linear_dtype for m in mode_list}
    floors = [r.roofline_ms(peaks[dtype_of[r.mode]], bandwidth) for r in rows]
    render(out, step_table(rows, floors, peaks, bandwidth, loaded.name, n_threads))
    if profile is not None:
        out.print(profile_decode(model_in(mode_list[0].dtype), profile, context, mode=mode_list[0]))
    steps_out = [
        r.as_dict() | {"roofline_ms": floor, "step_over_roofline": r.step_ms / floor}
        for r, floor in zip(rows, floors, strict=True)
    ]
    dump_json(json_out, {"matmul_peak_gflops": peaks, "memory_gbps": bandwidth, "steps": steps_out})
