"""``kvlab experiment``: the passphrase experiment over a list of cache strategies."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from kvlab.cli.common import (
    DtypeOption,
    JsonOption,
    KvCacheDtypeOption,
    ModelOption,
    QuantizationOption,
    ThreadsOption,
    check_engine_mode,
    check_extra,
    dump_json,
    fail,
    input_file,
    load_or_exit,
    name_list,
    out_console,
    set_threads,
    writable_file,
    writable_folder,
)
from kvlab.experiment.strategies import BUILTIN_STRATEGIES

if TYPE_CHECKING:
    from rich.console import Console

    from kvlab.experiment.harness import Experiment, TrialResult
    from kvlab.experiment.passphrases import PassphraseSet
    from kvlab.experiment.report import StrategySummary
    from kvlab.experiment.strategies import Strategy
    from kvlab.instrument.trace import Trace

DEFAULT_STRATEGIES = "isolated,shared-no-cow,shared-cow,shared-no-refcount,weak-hash,empty-request"


def _report_folder(param: typer.CallbackParam, path: Path | None) -> Path | None:
    """``--report``'s check while the command line is parsed: a folder that can be made and written, and the
    report extra installed, before any trial runs."""
    if path is not None:
        check_extra("report", "kvlab experiment --report")
    return writable_folder(param, path)


def experiment_cli(
    model: ModelOption = "mini",
    strategies: Annotated[
        str,
        typer.Option(
            metavar="NAME,...",
            help=f"Comma-separated strategy names, built-in ({' | '.join(BUILTIN_STRATEGIES)}) or from --passphrases",
        ),
    ] = DEFAULT_STRATEGIES,
    trials: Annotated[int, typer.Option(min=1, help="Trials per strategy")] = 100,
    concurrency: Annotated[int, typer.Option(min=1, max=26, help="Concurrent passphrase requests per trial")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the trial plans (arrivals, order, output lengths)")] = 0,
    passphrases: Annotated[Path | None, input_file("YAML/JSON file of passphrase groups (and strategies)")] = None,
    json_path: JsonOption = None,
    trace: Annotated[
        Path | None, typer.Option(callback=writable_file, help="Write every KV event as JSON lines here")
    ] = None,
    report: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            callback=_report_folder,
            help="Write a self-contained HTML report in this folder (the 'report' extra: pip install 'kvlab[report]')",
        ),
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 if a safe strategy leaks or an unsafe one never does")
    ] = False,
    max_tokens: Annotated[int, typer.Option(min=1, help="Longest output of a request")] = 16,
    threads: ThreadsOption = None,
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = None,
    kv_cache_dtype: KvCacheDtypeOption = "auto",
) -> None:
    """The passphrase experiment: do concurrent requests that share a prefix leak K/V into each other?"""
    from kvlab.config import ConfigError
    from kvlab.experiment.harness import Experiment, ExperimentConfig
    from kvlab.experiment.report import json_payload, legend_lines, render_tables, summarize

    out = out_console(json_path)  # with --json -, stdout is the JSON's alone
    pset, known = _passphrases_and_strategies(passphrases)
    names = name_list(strategies, tuple(known), "strategies", flag="--strategies")  # before any model loads
    check_engine_mode(quantization, "reference")
    loaded = load_or_exit(model, dtype=dtype)
    set_threads(threads, loaded)
    cfg = ExperimentConfig(
        trials=trials,
        concurrency=concurrency,
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min(8, max_tokens),
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    with ExitStack() as stack:
        sink = _trace_sink(stack.enter_context(open(trace, "w", encoding="utf-8"))) if trace is not None else None
        exp = Experiment(loaded, pset, cfg, trace_sink=sink)
        t0 = time.perf_counter()
        try:
            results = _run(exp, [(n, known[n]) for n in names], trials, out)
        except ConfigError as exc:  # a mode this model cannot run (gguf on a model that is not a GGUF file)
            fail(str(exc))
        wall = time.perf_counter() - t0
    summaries = [summarize(known[n], results[n]) for n in names]
    title = f"{loaded.name}, {trials} trials x {concurrency} requests, seed {seed} ({wall:.1f}s)"
    for table in render_tables(summaries, title):
        out.print(table)
    for line in legend_lines():
        out.print(line, highlight=False, style="dim")
    for s in summaries:
        if s.drift_trials:
            out.print(
                f"{s.strategy}: {s.drift_trials} trials drifted from the alone run by rounding alone "
                f"({dtype}{', ' + quantization if quantization else ''}"
                f"{', kv ' + kv_cache_dtype if kv_cache_dtype != 'auto' else ''}): no foreign read, so not counted as "
                "contamination"
            )
    _print_root_causes(summaries, results, json_path is not None, out)
    dump_json(json_path, json_payload(cfg, loaded.name, summaries, results, wall))
    if report is not None:
        from kvlab.analysis.report_html import write_report

        page = write_report(report, exp, [known[n] for n in names], results, summaries, f"kvlab: {loaded.name}")
        out.print(f"report: {page}", highlight=False)
    if check:
        _check(summaries, out)


def _passphrases_and_strategies(path: Path | None) -> tuple[PassphraseSet, dict[str, Strategy]]:
    """The passphrase set (built-in unless ``path``) and every strategy it may run under, by name."""
    from kvlab.experiment.passphrases import PassphraseFileError, default_passphrases, load_passphrases

    try:
        pset = load_passphrases(path) if path else default_passphrases()
    except PassphraseFileError as exc:
        fail(str(exc))
    return pset, {**BUILTIN_STRATEGIES, **{s.name: s for s in pset.strategies}}


def _trace_sink(file: TextIO) -> Callable[[str, int, Trace], None]:
    """Writes each trial's events as JSON lines, tagged with strategy and trial and ``detail`` flattened: the
    format ``kvlab trace`` (kvlab.analysis.trace_explain.load_trace) reads."""

    def sink(strategy: str, trial: int, tr: Trace) -> None:
        for e in tr.events:
            row = {
                "strategy": strategy,
                "trial": trial,
                "step": e.step,
                "op": e.op,
                "request": e.request,
                "block": e.block,
                "refcount": e.refcount,
                **e.detail,
            }
            file.write(json.dumps(row) + "\n")

    return sink


def _run(
    exp: Experiment, strategies: list[tuple[str, Strategy]], trials: int, console: Console
) -> dict[str, list[TrialResult]]:
    from rich.progress import Progress

    results = {}
    with Progress(console=console, transient=True) as bar:
        for name, strategy in strategies:
            results[name] = exp.run_strategy(strategy, progress=partial(bar.advance, bar.add_task(name, total=trials)))
    return results


def _print_root_causes(
    summaries: list[StrategySummary], results: dict[str, list[TrialResult]], more_in_json: bool, console: Console
) -> None:
    for s in summaries:
        causes = [(t.index, c) for t in results[s.strategy] if t.contaminated for c in t.root_causes[:1]]
        if causes:
            console.print(f"[bold]{s.strategy}[/bold]: root cause of the first contaminated trials")
            for idx, cause in causes[:3]:
                console.print(f"  trial {idx}: {cause}", highlight=False)
            if len(causes) > 3:
                console.print(f"  ... {len(causes) - 3} more" + (" in --json" if more_in_json else ""))


def _check(summaries: list[StrategySummary], console: Console) -> None:
    problems = [p for s in summaries for p in s.problems()]
    for p in problems:
        console.print(f"[red]check failed:[/red] {p}", highlight=False)
    if problems:
        raise typer.Exit(1)
    console.print("[green]check passed[/green]: safe strategies stayed isolated, unsafe ones were caught leaking")
