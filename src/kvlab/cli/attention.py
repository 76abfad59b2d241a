"""``kvlab attention``: per-head attention heatmaps of one prompt and the head diversity."""

from __future__ import annotations

from typing import Annotated

import typer

from kvlab.cli.common import ModelOption, check_int_list, int_list, load_or_exit


def attention_cli(
    prompt: Annotated[str, typer.Option(help="Prompt text")],
    model: ModelOption = "mini",
    layer: Annotated[
        int | None, typer.Option(help="Layer to plot (default: the last); diversity of all layers")
    ] = None,
    out: Annotated[str, typer.Option(help="PNG of the per-head heatmaps")] = "attention.png",
    compare_kv_heads: Annotated[
        str | None,
        typer.Option(
            callback=lambda v: v if v is None else check_int_list(v),
            help="e.g. 4,2,1: run the mini with that many KV heads and plot diversity",
        ),
    ] = None,
    compare_out: Annotated[str | None, typer.Option(help="PNG of the diversity comparison")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens generated (their decode rows count too)")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the mini models' weights")] = 0,
) -> None:
    """Per-head attention heatmaps of one prompt and the head diversity (mean pairwise JSD between heads)."""
    from kvlab.analysis.diversity import measure_diversity
    from kvlab.analysis.plots import attention_matrix, plot_heads

    loaded = load_or_exit(model, seed=seed)
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
        path = compare_out or out.removesuffix(".png") + "-kv-heads.png"
        _compare_kv_heads(prompt, compare_kv_heads, path, max_tokens, seed)


def _compare_kv_heads(prompt: str, kv_heads: str, path: str, max_tokens: int, seed: int) -> None:
    """The head diversity of the mini variants with these KV-head counts (e.g. "4,2,1"), plotted side by side."""
    from kvlab.analysis.diversity import measure_diversity
    from kvlab.analysis.plots import plot_diversity
    from kvlab.model.mini import MINI_VARIANTS

    by_kv = {kv: name for name, kv in MINI_VARIANTS.items()}
    wanted = int_list(kv_heads)
    missing = [k for k in wanted if k not in by_kv]
    if missing or not wanted:
        typer.echo(f"error: no mini variant with {missing or wanted} KV heads; have {sorted(by_kv)}", err=True)
        raise typer.Exit(2)
    results = []
    for kv in wanted:
        variant = load_or_exit(by_kv[kv], seed=seed)
        r, _, _ = measure_diversity(variant, variant.tokenizer.encode(prompt), max_tokens=max_tokens)
        results.append(r)
        typer.echo(
            f"  {r.model:<9} {kv} KV heads: mean {r.mean:.4f}  ("
            + ", ".join(f"L{k} {v:.4f}" for k, v in r.per_layer.items())
            + ")"
        )
    plot_diversity(results, path, f"head diversity by KV heads (seed {seed})")
    typer.echo(f"comparison: {path}")
