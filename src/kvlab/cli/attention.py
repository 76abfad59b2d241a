"""``kvlab attention``: per-head attention heatmaps of one prompt and the head diversity."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvlab.cli.common import (
    ModelOption,
    WeightsSeedOption,
    fail,
    int_list,
    int_list_option,
    load_or_exit,
    plot_option,
    writable_file,
)

if TYPE_CHECKING:
    from kvlab.analysis.diversity import DiversityResult


def attention_cli(
    prompt: Annotated[str, typer.Option(help="Prompt text")],
    model: ModelOption = "mini",
    layer: Annotated[
        int | None, typer.Option(help="Layer to plot (default: the last); diversity of all layers")
    ] = None,
    plot: Annotated[Path, plot_option("PNG of the per-head heatmaps")] = Path("attention.png"),
    compare_kv_heads: Annotated[
        str | None,
        int_list_option("e.g. 4,2,1: run the mini with that many KV heads and plot diversity"),
    ] = None,
    compare_plot: Annotated[
        Path | None,
        typer.Option(
            "--compare-plot",
            metavar="PNG",
            callback=writable_file,
            help="PNG of the diversity comparison (default: --plot's name ending -kv-heads.png)",
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens generated (their decode rows count too)")] = 8,
    weights_seed: WeightsSeedOption = 0,
) -> None:
    """Per-head attention heatmaps of one prompt and the head diversity (mean pairwise JSD between heads)."""
    from kvlab.analysis.diversity import measure_diversity
    from kvlab.analysis.plots import attention_matrix, decode_tokens, plot_heads

    loaded = load_or_exit(model, weights_seed=weights_seed)
    ids = loaded.tokenizer.encode(prompt)
    if len(ids) < 2:
        fail("the prompt needs at least 2 tokens for attention to have a choice")
    n = loaded.config.num_layers
    if layer is not None and not -n <= layer < n:
        fail(f"--layer {layer} out of range for {n} layers")
    shown = (n - 1) if layer is None else layer % n
    res, cap, rid = measure_diversity(loaded, ids, max_tokens=max_tokens)
    matrix = attention_matrix(cap, rid, shown)
    plot_heads(
        matrix,
        plot,
        f"{loaded.name}: layer {shown}, {loaded.config.num_heads} heads / {loaded.config.num_kv_heads} KV heads, "
        f"diversity {res.per_layer[shown]:.4f}",
        decode_tokens(loaded.tokenizer, res.tokens[: matrix.shape[-1]]),
    )
    typer.echo(f"{loaded.name}: head diversity (mean pairwise JSD, bits) layer {shown}: {res.per_layer[shown]:.4f}")
    typer.echo(
        "  per layer: " + ", ".join(f"L{k} {v:.4f}" for k, v in res.per_layer.items()) + f"; mean {res.mean:.4f}"
    )
    for line in group_lines(res, loaded.config.num_heads):
        typer.echo(line)
    typer.echo(f"heatmaps: {plot}")
    if compare_kv_heads:
        path = compare_plot or plot.with_name(plot.name.removesuffix(".png") + "-kv-heads.png")
        _compare_kv_heads(prompt, compare_kv_heads, path, max_tokens, weights_seed)


def _compare_kv_heads(prompt: str, kv_heads: str, path: Path, max_tokens: int, seed: int) -> None:
    """The head diversity of the mini variants with these KV-head counts (e.g. "4,2,1"), plotted side by side."""
    from kvlab.analysis.diversity import measure_diversity
    from kvlab.analysis.plots import plot_diversity
    from kvlab.model.mini import MINI_VARIANTS

    by_kv = {kv: name for name, kv in MINI_VARIANTS.items()}
    wanted = int_list(kv_heads)
    missing = [k for k in wanted if k not in by_kv]
    if missing or not wanted:
        fail(f"no mini variant with {missing or wanted} KV heads; have {sorted(by_kv)}")
    results = []
    for kv in wanted:
        variant = load_or_exit(by_kv[kv], weights_seed=seed)
        r, _, _ = measure_diversity(variant, variant.tokenizer.encode(prompt), max_tokens=max_tokens)
        results.append(r)
        typer.echo(
            f"  {r.model:<9} {kv} KV heads: mean {r.mean:.4f}  ("
            + ", ".join(f"L{k} {v:.4f}" for k, v in r.per_layer.items())
            + f"); {_within_across(r)}"
        )
    plot_diversity(results, path, f"head diversity by KV heads (weights seed {seed})")
    typer.echo(f"comparison: {path}")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _within_across(r: DiversityResult) -> str:
    """One phrase: the overall within-group vs across-group diversity, or why there is none."""
    if r.within_mean is None:
        return "no groups (every head has its own KV head)"
    if r.across_mean is None:
        return f"one group (every head shares the KV head): every pair is within, {r.within_mean:.4f}"
    return f"within KV group {r.within_mean:.4f} vs across {r.across_mean:.4f}"


def group_lines(r: DiversityResult, num_heads: int) -> list[str]:
    """The text report of head diversity by KV group: pairs of heads that share a KV head vs pairs that do
    not, per layer and over the layers."""
    head = f"  by KV group ({num_heads} query heads over {r.num_kv_heads} KV heads): "
    if not r.by_group or r.within_mean is None or r.across_mean is None:
        return [head + _within_across(r)]
    g0 = next(iter(r.by_group.values()))
    lines = [
        head + f"{g0.within_pairs} pairs share a KV head, {g0.across_pairs} do not",
        f"    overall: within {r.within_mean:.4f}, across {r.across_mean:.4f} "
        f"(within/across {r.within_mean / r.across_mean:.2f})",
    ]
    lines.append(
        "    per layer (within/across): "
        + ", ".join(f"L{k} {_fmt(g.within)}/{_fmt(g.across)}" for k, g in r.by_group.items())
    )
    return lines
