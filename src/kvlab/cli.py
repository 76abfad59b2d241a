"""The ``kvlab`` command."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from kvlab.clitools import console, load_or_exit, set_threads
from kvlab.memory import memory_cli

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvlab: shared state and isolation in the KV cache")

app.command("memory", help="KV cache size: MHA vs GQA vs MQA, paged vs contiguous, prefix sharing.")(memory_cli)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text")],
    model: Annotated[str, typer.Option(help="mini | mini-gqa | mini-mqa | smollm2 | PATH")] = "mini",
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate (greedy)")] = 32,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template")] = False,
    dense: Annotated[bool, typer.Option(help="Use the dense no-cache reference instead of the engine")] = False,
) -> None:
    """Print the greedy continuation of PROMPT."""
    from kvlab import LLM, SamplingParams
    from kvlab.model import dense_generate

    loaded = load_or_exit(model)
    set_threads(None, loaded)
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = loaded.tokenizer.encode(text)
    if not ids:
        console.print("[red]error:[/red] the prompt is empty")
        raise typer.Exit(2)
    t0 = time.perf_counter()
    if dense:
        out = dense_generate(loaded.model, ids, max_tokens, stop_token_ids=[loaded.tokenizer.eos_token_id])
    else:
        llm = LLM(loaded)
        res = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        if res.error:
            console.print(f"[red]error:[/red] {res.error}")
            raise typer.Exit(2)
        out = res.token_ids
    dt = time.perf_counter() - t0
    typer.echo(loaded.tokenizer.decode(out))
    console.print(f"[dim]{len(out)} tokens in {dt:.2f}s ({len(out) / dt:.1f} tok/s, {model})[/dim]", highlight=False)


@app.command()
def experiment(
    model: Annotated[str, typer.Option(help="mini | mini-gqa | mini-mqa | smollm2 | PATH")] = "mini",
    strategies: Annotated[
        str, typer.Option(help="Comma-separated strategy names (built-in or from --passphrases)")
    ] = "isolated,shared-no-cow,shared-cow,shared-no-refcount,weak-hash,empty-request",
    trials: Annotated[int, typer.Option(min=1, help="Trials per strategy")] = 100,
    concurrency: Annotated[int, typer.Option(min=1, max=26, help="Concurrent passphrase requests per trial")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the trial plans (arrivals, order, output lengths)")] = 0,
    passphrases: Annotated[
        str | None, typer.Option(help="YAML/JSON file of passphrase groups (and strategies)")
    ] = None,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the summary and every trial here")] = None,
    trace: Annotated[str | None, typer.Option(help="Write every KV event as JSON lines here")] = None,
    report: Annotated[str | None, typer.Option(help="Write a self-contained HTML report in this directory")] = None,
    check: Annotated[bool, typer.Option(help="Exit 1 if a safe strategy leaks or an unsafe one never does")] = False,
    max_tokens: Annotated[int, typer.Option(min=1, help="Longest output of a request")] = 16,
    threads: Annotated[int | None, typer.Option(help="Torch threads (default: 1 for tiny models)")] = None,
) -> None:
    """The passphrase experiment: do concurrent requests that share a prefix leak K/V into each other?"""
    import json as _json

    from rich.progress import Progress

    from kvlab.experiment.harness import Experiment, ExperimentConfig
    from kvlab.experiment.passphrases import PassphraseFileError, default_passphrases, load_passphrases
    from kvlab.experiment.report import render_table, summarize, write_json
    from kvlab.experiment.strategies import BUILTIN_STRATEGIES

    try:
        pset = load_passphrases(passphrases) if passphrases else default_passphrases()
    except PassphraseFileError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    known = {**BUILTIN_STRATEGIES, **{s.name: s for s in pset.strategies}}
    names = [n.strip() for n in strategies.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        console.print(f"[red]error:[/red] unknown strategy {unknown or names}; known: {', '.join(known)}")
        raise typer.Exit(2)
    loaded = load_or_exit(model)
    set_threads(threads, loaded)
    cfg = ExperimentConfig(
        trials=trials, concurrency=concurrency, seed=seed, max_tokens=max_tokens, min_tokens=min(8, max_tokens)
    )
    trace_file = open(trace, "w", encoding="utf-8") if trace else None  # noqa: SIM115

    def sink(strategy: str, trial: int, tr) -> None:
        for e in tr.events:
            trace_file.write(
                _json.dumps(
                    {
                        "strategy": strategy,
                        "trial": trial,
                        "step": e.step,
                        "op": e.op,
                        "request": e.request,
                        "block": e.block,
                        "refcount": e.refcount,
                        **e.detail,
                    }
                )
                + "\n"
            )

    exp = Experiment(loaded, pset, cfg, trace_sink=sink if trace_file else None)
    t0 = time.perf_counter()
    results = {}
    with Progress(console=console, transient=True) as bar:
        for name in names:
            task = bar.add_task(f"{name}", total=trials)
            results[name] = exp.run_strategy(known[name], progress=lambda t=task: bar.advance(t))
    wall = time.perf_counter() - t0
    if trace_file:
        trace_file.close()
    summaries = [summarize(known[n], results[n]) for n in names]
    console.print(
        render_table(
            summaries,
            f"passphrase experiment: {loaded.name}, {trials} trials x "
            f"{concurrency} concurrent requests, seed {seed} ({wall:.1f}s)",
        )
    )
    for s in summaries:
        causes = [(t.index, c) for t in results[s.strategy] if t.contaminated for c in t.root_causes[:1]]
        if causes:
            console.print(f"[bold]{s.strategy}[/bold]: root cause of the first contaminated trials")
            for idx, cause in causes[:3]:
                console.print(f"  trial {idx}: {cause}", highlight=False)
            if len(causes) > 3:
                console.print(f"  ... {len(causes) - 3} more" + (" in --json" if json_path else ""))
    if json_path:
        write_json(json_path, cfg, loaded.name, summaries, results, wall)
    if report:
        from kvlab.analysis.report_html import write_report

        page = write_report(report, exp, [known[n] for n in names], results, summaries, f"kvlab: {loaded.name}")
        console.print(f"report: {page}", highlight=False)
    problems = [p for s in summaries for p in s.problems()]
    if check:
        for p in problems:
            console.print(f"[red]check failed:[/red] {p}", highlight=False)
        if problems:
            raise typer.Exit(1)
        console.print("[green]check passed[/green]: safe strategies stayed isolated, unsafe ones were caught leaking")


from kvlab.bench.cli import bench_app  # noqa: E402
from kvlab.probe.cli import probe_cli  # noqa: E402
from kvlab.server.cli import serve_cli  # noqa: E402

app.add_typer(bench_app, name="bench")
app.command("serve")(serve_cli)
app.command("probe")(probe_cli)

from kvlab.observe.commands import attention_cli, trace_app  # noqa: E402

app.command("attention")(attention_cli)
app.add_typer(trace_app, name="trace")


def main() -> None:  # pragma: no cover
    app()
