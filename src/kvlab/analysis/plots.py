"""Figures: per-head attention heatmaps and head diversity side by side.

Builders return a ``matplotlib.figure.Figure`` made without pyplot: pyplot keeps global figure state and
picks a backend on first use, while a bare Figure renders through Agg in ``savefig`` on any machine
(headless CI included) and is garbage-collected like any object. Callers save it or embed it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from matplotlib.figure import Figure

from kvlab.analysis.diversity import DiversityResult
from kvlab.experiment.divergence import DivergencePoint
from kvlab.instrument.attention import AttentionCapture

DPI = 100


def save_png(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Write a figure as a PNG file (the CLI commands' output)."""
    fig.savefig(path, format="png", dpi=DPI)


def attention_matrix(capture: AttentionCapture, request_id: str, layer: int) -> torch.Tensor:
    """[H, T, T]: row p is the attention of the query at position p, assembled from the prefill chunks and
    decode steps of one request (rows never computed, e.g. a cached prefix, stay 0)."""
    recs = [r for r in capture.records.get(request_id, []) if r.layer == layer]
    if not recs:
        raise ValueError(f"no attention captured for request {request_id!r} at layer {layer}")
    t = max(max(r.q_positions) for r in recs) + 1
    h = recs[0].probs.shape[0]
    out = torch.zeros(h, t, t)
    for r in recs:
        ctx = min(r.probs.shape[-1], t)
        for i, p in enumerate(r.q_positions):
            out[:, p, :ctx] = r.probs[:, i, :ctx]
    return out


def heads_figure(matrix: torch.Tensor, title: str = "") -> Figure:
    """A grid of per-head heatmaps (query position x key position)."""
    h = matrix.shape[0]
    cols = min(h, 4)
    rows = -(-h // cols)
    fig = Figure(figsize=(3.2 * cols, 3.0 * rows + 0.6))
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.axis("off")
            continue
        # sqrt scale: the first token and the diagonal would otherwise wash out everything else.
        ax.imshow(matrix[i].sqrt().numpy(), cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(f"head {i}", fontsize=9)
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel("query position", fontsize=8)
        ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def diversity_figure(results: Sequence[DiversityResult], title: str = "") -> Figure:
    """Grouped bars: head diversity per layer, one bar per model variant, plus each variant's mean."""
    layers = sorted({layer for r in results for layer in r.per_layer})
    groups = [*(f"L{layer}" for layer in layers), "mean"]
    width = 0.8 / max(len(results), 1)
    fig = Figure(figsize=(1.2 * len(groups) + 5, 3.6))
    ax = fig.subplots()
    for k, r in enumerate(results):
        vals = [r.per_layer.get(layer, float("nan")) for layer in layers] + [r.mean]
        xs = [g + (k - (len(results) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, vals, width, label=f"{r.model} ({r.num_kv_heads} KV heads)")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("mean pairwise JSD between heads (bits)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: bars fill the axes
    ax.set_title(title or "head diversity", fontsize=10)
    fig.tight_layout()
    return fig


def divergence_figure(points: Sequence[DivergencePoint], block_size: int, title: str = "") -> Figure:
    """Share of trials whose answers changed (and took the other's) against where the prompts part inside a
    block: 0 is a block boundary."""
    fig = Figure(figsize=(7, 3.4))
    ax = fig.subplots()
    xs = [p.offset for p in points]
    for label, values in (
        ("output changed", [100 * p.output_changed / p.trials for p in points]),
        ("took the other's answer", [100 * p.took_other / p.trials for p in points]),
        ("foreign read (sanitizer)", [100 * p.foreign_read / p.trials for p in points]),
    ):
        ax.plot(xs, values, marker="o", label=label)
    ax.set_xticks(range(block_size))
    ax.set_xlim(-0.5, block_size - 0.5)
    ax.set_ylim(-3, 103)
    ax.set_xlabel(f"common prefix tokens mod block_size ({block_size}): where the prompts part inside a block")
    ax.set_ylabel("% of trials")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(title or "pollution by divergence offset", fontsize=10)
    fig.tight_layout()
    return fig


def plot_heads(matrix: torch.Tensor, path: str | os.PathLike[str], title: str = "") -> None:
    """``heads_figure`` written to a PNG file (``kvlab attention``)."""
    save_png(heads_figure(matrix, title), path)


def plot_diversity(results: Sequence[DiversityResult], path: str | os.PathLike[str], title: str = "") -> None:
    """``diversity_figure`` written to a PNG file (``kvlab attention --compare-kv-heads``)."""
    save_png(diversity_figure(results, title), path)
