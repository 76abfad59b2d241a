"""``kvlab fuzz``: differential fuzzing of the engine against the dense oracle, with the sanitizer on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from kvlab.cli.common import (
    JsonOption,
    KvCacheDtypeName,
    ModelOption,
    ThreadsOption,
    console,
    dump_json,
    fail,
    input_file,
    load_or_exit,
    out_console,
    set_threads,
    strategy_option,
    writable_folder,
)
from kvlab.experiment.strategies import BuiltinStrategy

# kvlab.fuzz.case.PRECISIONS (checked in tests/fuzz/test_cli.py: the CLI imports the fuzzer only when it runs).
FuzzPrecision = Literal["fp32", "bf16+int8-w8a8-head"]

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console
    from rich.progress import Progress, TaskID

    from kvlab.fuzz import CampaignSummary, FuzzCase, Reducer, Verdict


def fuzz_cli(
    model: ModelOption = "mini",
    trials: Annotated[int, typer.Option(min=1, help="Trials to run (trial i is drawn from --seed and i)")] = 2000,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the campaign: each trial's workload and cache config")] = 0,
    unsafe_strategy: Annotated[
        BuiltinStrategy | None,
        strategy_option("Run under an experiment strategy (they break isolation on purpose)"),
    ] = None,
    unsafe_commit_rejected_drafts: Annotated[
        bool,
        typer.Option(
            "--unsafe-commit-rejected-drafts",
            help="Every trial speculates, and rejected draft tokens stay findable in the prefix cache (the "
            "sanitizer must catch the reads)",
        ),
    ] = False,
    kv_cache_dtype: Annotated[
        KvCacheDtypeName | None,
        typer.Option(
            "--kv-cache-dtype",
            help="Every trial's pool stores K/V in this dtype, judged against the oracle that rounds alike (default: "
            "drawn per trial: the model's in 70%, bfloat16, fp8 and fp8_e5m2 10% each)",
        ),
    ] = None,
    precision: Annotated[
        FuzzPrecision | None,
        typer.Option(
            help="Every trial computes in it: fp32 (judged by the dense oracle) or bf16+int8-w8a8-head (bf16 "
            "weights, int8 linears and head, the compiled kernels: a mode that computes every row on its own, so each "
            "request is judged by its own run alone in it; default: drawn per trial, fp32 in 80%)",
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Worker processes (default: run in this process; with --ray: one per CPU)")
    ] = None,
    ray: Annotated[
        str | None, typer.Option(help="Run on Ray: 'auto' (running cluster), 'local' (start one here) or ADDRESS")
    ] = None,
    replay: Annotated[Path | None, input_file("Rerun one saved case and explain it", metavar="CASE")] = None,
    cases_dir: Annotated[
        Path,
        typer.Option(
            metavar="DIR", callback=writable_folder, help="Where failing cases are written (shrunk and original)"
        ),
    ] = Path("fuzz-cases"),
    max_failures: Annotated[int, typer.Option(min=1, help="Stop after this many failing trials")] = 10,
    shrink: Annotated[bool, typer.Option(help="Shrink failing trials to a minimal case")] = True,
    shrink_budget: Annotated[int, typer.Option(min=1, help="Engine runs one shrink may spend")] = 300,
    chunk_size: Annotated[int, typer.Option(min=1, help="Trials per task sent to a worker")] = 8,
    json_path: JsonOption = None,
    threads: ThreadsOption = None,
) -> None:
    """Random workloads and cache configs, every output checked against the dense oracle; exit 1 on a failure."""
    if replay is not None:
        _replay(replay, threads)
        return
    from kvlab.config import ConfigError
    from kvlab.fuzz import FuzzSettings, ScaleOptions, TrialRunner, run_campaign
    from kvlab.fuzz.dispatch import WorkersDying
    from kvlab.fuzz.ray_exec import RayUnavailable

    out = out_console(json_path)  # with --json -, stdout is the JSON's alone

    try:
        settings = FuzzSettings(
            model=model,
            seed=seed,
            strategy=unsafe_strategy,
            shrink=shrink,
            shrink_budget=shrink_budget,
            commit_rejected_drafts=unsafe_commit_rejected_drafts,
            kv_cache_dtype=kv_cache_dtype,
            precision=precision,
        )
        # In-process trials go one at a time (the progress bar moves per trial); workers get chunks.
        opts = ScaleOptions(workers=workers, ray=ray, chunk_size=1 if workers is None and ray is None else chunk_size)
    except ConfigError as exc:
        fail(str(exc))
    runner = None
    if opts.executor == "serial":  # workers load their own model; only the serial run needs one here
        loaded = load_or_exit(model)
        set_threads(threads, loaded)
        runner = TrialRunner(settings, loaded)
    with _progress_bar(out) as bar:
        name = "commit-rejected-drafts" if settings.commit_rejected_drafts else settings.strategy
        task = bar.add_task(_title(name, opts.executor, workers), total=trials, failures=0, rate="")
        try:
            summary = run_campaign(settings, trials, opts, max_failures, _on_progress(bar, task), runner)
        except (RayUnavailable, WorkersDying) as exc:
            fail(str(exc))
    _report(summary, cases_dir, out)
    dump_json(json_path, summary.to_dict())
    if summary.failures:
        raise typer.Exit(1)


def _title(strategy: str | None, executor: str, workers: int | None) -> str:
    where = executor if workers is None else f"{executor} x{workers}"
    return f"fuzz {strategy or 'safe configs'} ({where})"


def _progress_bar(console: Console) -> Progress:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        # Average over the whole run, not rich's short window: chunks arrive in bursts from the workers.
        TextColumn("{task.fields[rate]}"),
        TextColumn("[red]{task.fields[failures]} failing[/red]"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _on_progress(bar: Progress, task: TaskID) -> Callable[[Reducer], None]:
    t0 = time.perf_counter()

    def update(reducer: Reducer) -> None:
        rate = reducer.arrived / max(time.perf_counter() - t0, 1e-9)
        bar.update(task, completed=reducer.arrived, failures=reducer.failures_seen, rate=f"{rate:.1f} trials/s")

    return update


def _report(summary: CampaignSummary, cases_dir: Path, console: Console) -> None:
    s = summary
    console.print(
        f"{s.trials} trials ({s.trials_requested} requested), {s.failures} failing, {s.trials_per_s:.1f} trials/s "
        f"({s.wall_s:.1f}s, first result after {s.first_result_s:.1f}s; {s.executor}, {s.workers} "
        f"worker{'s' if s.workers > 1 else ''}); results digest "
        f"{s.digest}",
        highlight=False,
    )
    if s.worker_deaths or s.retried_trials:
        console.print(
            f"[yellow]{s.worker_deaths} worker death(s): {s.retried_trials} trials retried on other workers, "
            "none lost[/yellow]"
        )
    if s.trials:
        paths = ", ".join(f"{k} {100 * n / s.trials:.0f}%" for k, n in s.coverage.items())
        console.print(f"trials that exercised: {paths}", highlight=False)
    if s.kinds:
        console.print("failure kinds: " + ", ".join(f"{k} x{n}" for k, n in s.kinds.items()), highlight=False)
    if not s.failing:
        return
    cases_dir.mkdir(parents=True, exist_ok=True)
    for r in s.failing:
        assert r.case is not None and r.shrunk is not None
        path = r.shrunk.save(cases_dir / f"trial-{r.index:07d}.json")
        r.case.save(cases_dir / f"trial-{r.index:07d}.original.json")
        size = r.shrunk.size()
        console.print(
            f"[red]trial {r.index}[/red]: {r.failures[0]}\n  shrunk to {size[0]} request(s), {size[1]} prompt "
            f"tokens in {r.shrink_runs} runs: kvlab fuzz --replay {path}",
            highlight=False,
        )


def _replay(path: Path, threads: int | None) -> None:
    from kvlab.config import ConfigError
    from kvlab.fuzz import FuzzCase, Oracle, run_case

    try:
        case = FuzzCase.load(path)
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        fail(f"cannot read the case {path}: {exc}")
    loaded = load_or_exit(case.model, weights_seed=case.model_seed)
    set_threads(threads, loaded)
    verdict = run_case(loaded, case, Oracle(loaded.model))
    _print_case(case, verdict)
    if verdict.ok:
        judge = "the oracle's" if case.config.precision == "fp32" else "its request's alone"
        console.print(f"[green]passes[/green] ({verdict.steps} steps): no foreign read, every token {judge}")
        return
    for f in verdict.failures:
        console.print(f"[red]{f.kind}[/red]: {f.message}", highlight=False)
    if verdict.root_causes:
        console.print("[bold]sanitizer root cause[/bold] (first foreign read of each reader):")
        for cause in verdict.root_causes:
            console.print(f"  {cause}", highlight=False)
    wrong = verdict.first("wrong-token") or verdict.first("batch-variance")
    console.print(f"[bold]first wrong token[/bold]: {wrong.message if wrong else 'none (the tokens were right)'}")
    raise typer.Exit(1)


def _print_case(case: FuzzCase, verdict: Verdict) -> None:
    from kvlab.experiment.strategies import BUILTIN_STRATEGIES

    c = case.config
    strategy = "(safe)"
    if case.strategy is not None:
        st = BUILTIN_STRATEGIES[case.strategy]
        # The strategy's knobs win over the case's config (its hash_algo, say): show what really ran.
        knobs = {k: v for k, v in {**st.cache, **st.scheduler}.items() if k != "unsafe"}
        strategy = f"{case.strategy} ({', '.join(f'{k}={v!r}' for k, v in knobs.items())} over the config)"
    console.print(
        f"case: model {case.model} in {c.precision}, strategy {strategy}, block_size {c.block_size}, "
        f"num_blocks {c.num_blocks}, max_num_seqs {c.max_num_seqs}, max_num_batched_tokens "
        f"{c.max_num_batched_tokens}, {c.layout}, prefix {c.prefix_granularity}, {c.hash_algo}; {verdict.steps} steps",
        highlight=False,
    )
    for i, r in enumerate(case.requests):
        rid = case.request_id(i)
        extra = "".join(
            [
                f" n={r.n}" if r.n > 1 else "",
                f" abort@{r.abort_at}" if r.abort_at is not None else "",
                f" salt={r.salt}" if r.salt else "",
                f" temperature={r.temperature} seed={r.seed}" if r.sampled else "",
                f" top_k={r.top_k}" if r.top_k else "",
                f" top_p={r.top_p}" if r.top_p < 1 else "",
            ]
        )
        console.print(
            f"  {rid}: prompt {list(r.prompt)} ({len(r.prompt)} tokens) arrives @{r.arrival}, "
            f"max_tokens {r.max_tokens}{extra} -> {verdict.outputs.get(rid, '?')}",
            highlight=False,
        )
