"""Figures: per-head attention heatmaps and head diversity side by side.

Builders return a ``matplotlib.figure.Figure`` made without pyplot: pyplot keeps global figure state and
picks a backend on first use, while a bare Figure renders through Agg in ``savefig`` on any machine
(headless CI included) and is garbage-collected like any object. Callers save it or embed it.
"""

from __future__ import annotations

import functools
import os
import unicodedata
from collections.abc import Sequence

import torch
from matplotlib import font_manager
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.ft2font import FT2Font

from kvlab.analysis.diversity import DiversityResult
from kvlab.experiment.divergence import DivergencePoint
from kvlab.instrument.attention import AttentionCapture
from kvlab.tokenizer import Tokenizer

DPI = 100
MAX_TOKEN_LABELS = 32  # per axis of a heatmap: a longer sequence labels every k-th position
MAX_LABEL_CHARS = 12
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_INVISIBLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}  # control, format, surrogate, private, unassigned, breaks


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


def decode_tokens(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token decoded on its own (a byte of a multi-byte character shows as U+FFFD); a token that decodes
    to nothing (a special token the tokenizer skips) shows as ``<id>``."""
    return [tokenizer.decode([i]) or f"<{i}>" for i in ids]


@functools.cache
def _font_chars() -> frozenset[int]:
    """The code points the default font draws: any other would render as an empty box."""
    return frozenset(FT2Font(font_manager.findfont(font_manager.FontProperties())).get_charmap())


def token_label(text: str) -> str:
    """A tick label for one token: newlines, tabs and other control characters (and characters the font
    cannot draw) written as escapes, a token of spaces as open boxes, long tokens cut short. Applying it to
    its own output changes nothing."""
    drawable = _font_chars()
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif unicodedata.category(ch) in _INVISIBLE or ord(ch) not in drawable:
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    label = "".join(out)
    if not label.strip():
        label = "\u2423" * len(label) if label else "\u2205"  # open box per space; empty set for nothing
    return label if len(label) <= MAX_LABEL_CHARS else label[: MAX_LABEL_CHARS - 1] + "\u2026"


def label_positions(n: int, limit: int = MAX_TOKEN_LABELS) -> list[int]:
    """The positions labelled on an axis of ``n`` tokens: all of them up to ``limit``, else every k-th."""
    step = max(1, -(-n // limit))
    return list(range(0, n, step))


def heads_figure(matrix: torch.Tensor, title: str = "", tokens: Sequence[str] | None = None) -> Figure:
    """A grid of per-head heatmaps (query position x key position) with a colour bar of the attention
    probability; ``tokens`` (the decoded token at each position, ``decode_tokens``) label both axes, thinned
    to at most ``MAX_TOKEN_LABELS`` a side."""
    h, t = matrix.shape[0], matrix.shape[-1]
    if tokens is not None and len(tokens) < t:
        raise ValueError(f"{len(tokens)} tokens to label {t} positions")
    cols = min(h, 4)
    rows = -(-h // cols)
    panel = (4.2, 4.0) if tokens is not None else (3.2, 3.0)  # room for a column of token labels
    fig = Figure(figsize=(panel[0] * cols + 0.8, panel[1] * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    # sqrt scale: the first token and the diagonal would otherwise wash out everything else. One norm for
    # every head, so the one colour bar reads them all (in probabilities, not their square roots).
    norm = PowerNorm(0.5, vmin=0.0, vmax=max(float(matrix.max()), 1e-6))
    ticks = label_positions(t)
    labels = [token_label(tokens[p]) for p in ticks] if tokens is not None else []
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.axis("off")
            continue
        image = ax.imshow(matrix[i].numpy(), cmap="viridis", norm=norm, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {i}", fontsize=9)
        if tokens is None:
            ax.set_xlabel("key position", fontsize=8)
            ax.set_ylabel("query position", fontsize=8)
            ax.tick_params(labelsize=7)
            continue
        # Token labels on the outer panels only: the bottom panel of each column, the first of each row.
        bottom, left = i + cols >= h, i % cols == 0
        ax.set_xticks(ticks, labels, rotation=90, fontsize=6)
        ax.set_yticks(ticks, labels, fontsize=6)
        ax.tick_params(labelbottom=bottom, labelleft=left)
        if bottom:
            ax.set_xlabel("key token", fontsize=8)
        if left:
            ax.set_ylabel("query token", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), label="attention probability", shrink=0.9)
    if title:
        fig.suptitle(title, fontsize=10)
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


def plot_heads(
    matrix: torch.Tensor, path: str | os.PathLike[str], title: str = "", tokens: Sequence[str] | None = None
) -> None:
    """``heads_figure`` written to a PNG file (``kvlab attention``)."""
    save_png(heads_figure(matrix, title, tokens), path)


def plot_diversity(results: Sequence[DiversityResult], path: str | os.PathLike[str], title: str = "") -> None:
    """``diversity_figure`` written to a PNG file (``kvlab attention --compare-kv-heads``)."""
    save_png(diversity_figure(results, title), path)
