"""CLI commands of the observe package: ``kvlab attention`` and ``kvlab trace summarize|explain|timeline``."""

from __future__ import annotations

from typing import Annotated

import typer

from kvlab.instrument.trace import TraceEvent


def attention_cli(
    prompt: Annotated[str, typer.Option(help="Prompt text")],
    model: Annotated[str, typer.Option(help="mini | mini-gqa | mini-mqa | smollm2 | PATH")] = "mini",
    layer: Annotated[
        int | None, typer.Option(help="Layer to plot (default: the last); diversity of all layers")
    ] = None,
    out: Annotated[str, typer.Option(help="PNG of the per-head heatmaps")] = "attention.png",
    compare_kv_heads: Annotated[
        str | None, typer.Option(help="e.g. 4,2,1: run the mini with that many KV heads and plot diversity")
    ] = None,
    compare_out: Annotated[str | None, typer.Option(help="PNG of the diversity comparison")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens generated (their decode rows count too)")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the mini models' weights")] = 0,
) -> None:
    """Per-head attention heatmaps of one prompt and the head diversity (mean pairwise JSD between heads)."""
    from kvlab.analysis.diversity import measure_diversity
    from kvlab.analysis.plots import attention_matrix, plot_diversity, plot_heads
    from kvlab.clitools import load_or_exit
    from kvlab.model.mini import MINI_VARIANTS

    def load(spec: str):
        return load_or_exit(spec, seed=seed)

    loaded = load(model)
    ids = loaded.tokenizer.encode(prompt)
    if len(ids) < 2:
        typer.echo("error: the prompt needs at least 2 tokens for attention to have a choice", err=True)
        raise typer.Exit(2)
    n = loaded.config.num_layers
    if layer is not None and not -n <= layer < n:
        typer.echo(f"error: --layer {layer} out of range for {n} layers", err=True)
        raise typer.Exit(2)
    shown = (n - 1) if layer is None else layer % n
    res, cap, rid = measure_diversity(loaded, ids, max_tokens=max_tokens)
    plot_heads(
        attention_matrix(cap, rid, shown),
        out,
        f"{loaded.name}: layer {shown}, {loaded.config.num_heads} heads / {loaded.config.num_kv_heads} KV heads, "
        f"diversity {res.per_layer[shown]:.4f}",
    )
    typer.echo(f"{loaded.name}: head diversity (mean pairwise JSD, bits) layer {shown}: {res.per_layer[shown]:.4f}")
    typer.echo(
        "  per layer: " + ", ".join(f"L{k} {v:.4f}" for k, v in res.per_layer.items()) + f"; mean {res.mean:.4f}"
    )
    typer.echo(f"heatmaps: {out}")
    if compare_kv_heads:
        by_kv = {kv: name for name, kv in MINI_VARIANTS.items()}
        try:
            wanted = [int(x) for x in compare_kv_heads.split(",") if x.strip()]
        except ValueError as exc:
            typer.echo(f"error: --compare-kv-heads takes integers, got {compare_kv_heads!r}", err=True)
            raise typer.Exit(2) from exc
        missing = [k for k in wanted if k not in by_kv]
        if missing or not wanted:
            typer.echo(f"error: no mini variant with {missing or wanted} KV heads; have {sorted(by_kv)}", err=True)
            raise typer.Exit(2)
        results = []
        for kv in wanted:
            variant = load(by_kv[kv])
            r, _, _ = measure_diversity(variant, variant.tokenizer.encode(prompt), max_tokens=max_tokens)
            results.append(r)
            typer.echo(
                f"  {r.model:<9} {kv} KV heads: mean {r.mean:.4f}  ("
                + ", ".join(f"L{k} {v:.4f}" for k, v in r.per_layer.items())
                + ")"
            )
        path = compare_out or out.removesuffix(".png") + "-kv-heads.png"
        plot_diversity(results, path, f"head diversity by KV heads (seed {seed})")
        typer.echo(f"comparison: {path}")


trace_app = typer.Typer(no_args_is_help=True, help="Read a KV trace: block histories, foreign reads, timelines.")


def _trials(path: str, strategy: str | None, trial: int | None) -> list[tuple[tuple, list[TraceEvent]]]:
    from kvlab.analysis.trace_explain import load_trace

    try:
        groups = load_trace(path)
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    chosen = [
        (k, evs)
        for k, evs in groups.items()
        if (strategy is None or k[0] == strategy) and (trial is None or k[1] == trial)
    ]
    if not chosen:
        have = ", ".join(f"{s}/{t}" for s, t in groups) or "none"
        typer.echo(f"error: no trial matches --strategy {strategy} --trial {trial}; have {have}", err=True)
        raise typer.Exit(2)
    return chosen


def _header(key: tuple) -> str:
    return "" if key == (None, None) else f"== strategy {key[0]}, trial {key[1]} =="


FileArg = Annotated[str, typer.Argument(help="Trace JSON lines (kvlab experiment --trace, or Trace(path))")]
RequestOpt = Annotated[str | None, typer.Option(help="Only this request")]
StrategyOpt = Annotated[str | None, typer.Option(help="Only trials of this strategy")]
TrialOpt = Annotated[int | None, typer.Option(help="Only this trial index")]


def _each(path: str, request: str | None, strategy: str | None, trial: int | None, render) -> None:
    from kvlab.analysis.trace_explain import replay

    shown = 0
    for key, evs in _trials(path, strategy, trial):
        rep = replay(evs)
        if request is not None and request not in rep.history:
            continue
        if _header(key):
            typer.echo(_header(key))
        typer.echo(render(rep, request))
        shown += 1
    if not shown:
        typer.echo(f"error: no request {request!r} in the selected trials", err=True)
        raise typer.Exit(2)


@trace_app.command("summarize")
def trace_summarize(
    file: FileArg, request: RequestOpt = None, strategy: StrategyOpt = None, trial: TrialOpt = None
) -> None:
    """Each request's block history: every alloc, hit, write, CoW, fork, free and evict it caused."""
    from kvlab.analysis.trace_explain import summarize_text

    _each(file, request, strategy, trial, summarize_text)


@trace_app.command("explain")
def trace_explain(
    file: FileArg, request: RequestOpt = None, strategy: StrategyOpt = None, trial: TrialOpt = None
) -> None:
    """Every read of state another request wrote, with the chain of block events that led to it."""
    from kvlab.analysis.trace_explain import explain_text

    _each(file, request, strategy, trial, explain_text)


@trace_app.command("timeline")
def trace_timeline(
    file: FileArg,
    strategy: StrategyOpt = None,
    trial: TrialOpt = None,
    out: Annotated[str, typer.Option(help="PNG to write")] = "timeline.png",
) -> None:
    """Block timeline of one trial: blocks x steps, coloured by holder, marks for hit/CoW/free/evict."""
    from kvlab.analysis.timeline import plot_timeline

    chosen = _trials(file, strategy, trial)
    if len(chosen) > 1:
        typer.echo(f"error: {len(chosen)} trials match; pick one with --strategy and --trial", err=True)
        raise typer.Exit(2)
    key, evs = chosen[0]
    plot_timeline(evs, out, f"block timeline: {key[0]} trial {key[1]}" if key != (None, None) else "")
    typer.echo(f"timeline: {out}")
