"""Block timeline of one trial: blocks x steps, coloured by the request(s) holding each block, with marks
for hits, copy-on-write, frees and evictions. Built as a bare ``Figure`` like ``kvlab.analysis.plots``."""

from __future__ import annotations

import os

import numpy as np
from matplotlib.artist import Artist
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from kvlab.analysis.plots import save_png
from kvlab.analysis.trace_explain import replay
from kvlab.instrument.trace import TraceEvent

_MARKS = {"hit": ("o", "white"), "cow": ("^", "black"), "free": ("x", "red"), "evict": ("s", "orange")}
_FOREIGN = ("*", "magenta")  # a read of slots another request wrote while the reader held the block
_SHARED = "#7f7f7f"
_PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#d62728"]


def ownership_grid(events: list[TraceEvent]) -> tuple[list[int], list[int], list[str], np.ndarray]:
    """(blocks, steps, requests, grid[block, step]): 0 = nobody, 1..n = that request alone, n+1 = shared."""
    rep = replay(events)
    # Steps without events change nothing: they carry the previous holders forward.
    snaps = dict(rep.holders)
    steps = list(range(rep.holders[0][0], rep.holders[-1][0] + 1))
    blocks = sorted({e.block for e in events if e.block is not None})
    requests = rep.requests
    idx = {r: i + 1 for i, r in enumerate(requests)}
    grid = np.zeros((len(blocks), len(steps)), dtype=int)
    row = {b: i for i, b in enumerate(blocks)}
    held: dict[int, set[str]] = {}
    for j, step in enumerate(steps):
        held = snaps.get(step, held)
        for b, owners in held.items():
            if b in row and owners:
                grid[row[b], j] = idx[next(iter(owners))] if len(owners) == 1 else len(requests) + 1
    return blocks, steps, requests, grid


def timeline_figure(events: list[TraceEvent], title: str = "") -> Figure:
    """Blocks (rows) x engine steps (columns), coloured by holder; marks where requests hit, copied on
    write, freed, evicted, and read state another request wrote while they held the block."""
    if not events:
        raise ValueError("the trial has no trace events")
    blocks, steps, requests, grid = ownership_grid(events)
    overwritten = [f for f in replay(events).foreign if f.kind == "overwritten"]
    colours = ["#f2f2f2"] + [_PALETTE[i % len(_PALETTE)] for i in range(len(requests))] + [_SHARED]
    fig = Figure(figsize=(min(4 + 0.35 * len(steps), 18), min(2 + 0.3 * len(blocks), 12)))
    ax = fig.subplots()
    ax.imshow(
        grid,
        cmap=ListedColormap(colours),
        vmin=0,
        vmax=len(colours) - 1,
        aspect="auto",
        interpolation="nearest",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(blocks) - 0.5, -0.5),
    )
    row = {b: i for i, b in enumerate(blocks)}
    for op, (marker, colour) in _MARKS.items():
        pts = [(e.step, row[e.block]) for e in events if e.op == op and e.block is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            edge = None if marker == "x" else "black"  # an unfilled marker has no edge to draw
            ax.scatter(xs, ys, marker=marker, c=colour, edgecolors=edge, linewidths=0.5, s=36, zorder=3)
    if overwritten:
        ax.scatter(
            [f.step for f in overwritten],
            [row[f.block] for f in overwritten],
            marker=_FOREIGN[0],
            c=_FOREIGN[1],
            edgecolors="black",
            linewidths=0.5,
            s=140,
            zorder=4,
        )
    ax.set_yticks(range(len(blocks)), [str(b) for b in blocks])
    ax.set_xlabel("engine step")
    ax.set_ylabel("block")
    handles: list[Artist] = [Patch(color=colours[i + 1], label=f"held by {r}") for i, r in enumerate(requests)]
    handles.append(Patch(color=_SHARED, label="shared (2+ tables)"))
    handles += [
        Line2D([], [], marker=m, color="none", markerfacecolor=c, markeredgecolor="black", label=op)
        for op, (m, c) in [*_MARKS.items(), ("foreign write read", _FOREIGN)]
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title(title or "block timeline", fontsize=10)
    fig.tight_layout()
    return fig


def plot_timeline(events: list[TraceEvent], path: str | os.PathLike[str], title: str = "") -> None:
    """``timeline_figure`` written to a PNG file (``kvlab trace timeline``)."""
    save_png(timeline_figure(events, title), path)
