"""``kvlab trace summarize|explain|timeline``: read a KV trace written by ``kvlab experiment --trace`` or
``Trace(path)``."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvlab.cli.commands import KvlabCommand, KvlabGroup
from kvlab.cli.common import fail, plot_option

if TYPE_CHECKING:
    from kvlab.analysis.trace_explain import Replay, TrialKey
    from kvlab.instrument.trace import TraceEvent

trace_app = typer.Typer(
    cls=KvlabGroup, no_args_is_help=True, help="Read a KV trace: block histories, foreign reads, timelines."
)

# A missing file is refused while the command line is parsed (exit 2, one line), not by the reader's errno.
FileArg = Annotated[
    Path,
    typer.Argument(
        metavar="FILE",
        exists=True,
        dir_okay=False,
        readable=True,
        help="Trace JSON lines (kvlab experiment --trace, or Trace(path))",
    ),
]
RequestOpt = Annotated[str | None, typer.Option(help="Only this request")]
StrategyOpt = Annotated[str | None, typer.Option(help="Only trials of this strategy")]
TrialOpt = Annotated[int | None, typer.Option(help="Only this trial index")]


class Reads(StrEnum):
    """Which reads of another request's state ``explain`` shows (the values of trace_explain.READS)."""

    foreign = "foreign"
    shared = "shared"
    all = "all"


@trace_app.command("summarize", cls=KvlabCommand)
def trace_summarize(
    file: FileArg, request: RequestOpt = None, strategy: StrategyOpt = None, trial: TrialOpt = None
) -> None:
    """Each request's block history: every alloc, hit, write, CoW, fork, free and evict it caused."""
    from kvlab.analysis.trace_explain import summarize_text

    _each(file, request, strategy, trial, summarize_text)


@trace_app.command("explain", cls=KvlabCommand)
def trace_explain(
    file: FileArg,
    request: RequestOpt = None,
    strategy: StrategyOpt = None,
    trial: TrialOpt = None,
    reads: Annotated[
        Reads,
        typer.Option(
            help="foreign: contamination and unverified hits; shared: the reader's own prefix found by a verified "
            "hit (benign); all"
        ),
    ] = Reads.foreign,
) -> None:
    """Every read of state another request wrote, with the chain of block events that led to it; a prefix
    another request computed and the reader found by a verified hit is a shared read, not a foreign one."""
    from functools import partial

    from kvlab.analysis.trace_explain import explain_text

    _each(file, request, strategy, trial, partial(explain_text, reads=reads.value))


@trace_app.command("timeline", cls=KvlabCommand)
def trace_timeline(
    file: FileArg,
    strategy: StrategyOpt = None,
    trial: TrialOpt = None,
    plot: Annotated[Path, plot_option("PNG to write")] = Path("timeline.png"),
) -> None:
    """Block timeline of one trial: blocks x steps, coloured by holder, marks for hit/CoW/free/evict."""
    from kvlab.analysis.timeline import plot_timeline

    chosen = _trials(file, strategy, trial)
    if len(chosen) > 1:
        fail(f"{len(chosen)} trials match; pick one with --strategy and --trial")
    key, evs = chosen[0]
    plot_timeline(evs, plot, f"block timeline: {key[0]} trial {key[1]}" if key != (None, None) else "")
    typer.echo(f"timeline: {plot}")


def _trials(path: Path, strategy: str | None, trial: int | None) -> list[tuple[TrialKey, list[TraceEvent]]]:
    from kvlab.analysis.trace_explain import load_trace

    try:
        groups = load_trace(path)
    except (OSError, ValueError) as exc:
        fail(str(exc))
    chosen = [
        (k, evs)
        for k, evs in groups.items()
        if (strategy is None or k[0] == strategy) and (trial is None or k[1] == trial)
    ]
    if not chosen:
        have = ", ".join(f"{s}/{t}" for s, t in groups) or "none"
        fail(f"no trial matches --strategy {strategy} --trial {trial}; have {have}")
    return chosen


def _each(
    path: Path,
    request: str | None,
    strategy: str | None,
    trial: int | None,
    render: Callable[[Replay, str | None], str],
) -> None:
    """``render`` every selected trial that holds ``request`` (any trial if None), each under its header."""
    from kvlab.analysis.trace_explain import replay

    shown = 0
    for key, evs in _trials(path, strategy, trial):
        rep = replay(evs)
        if request is not None and request not in rep.history:
            continue
        if key != (None, None):  # a plain Trace(path) file holds one unnamed trial
            typer.echo(f"== strategy {key[0]}, trial {key[1]} ==")
        typer.echo(render(rep, request))
        shown += 1
    if not shown:
        fail(f"no request {request!r} in the selected trials")
