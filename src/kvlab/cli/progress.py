"""A command's one-line progress display on a terminal: a spinner, the command, the phase it is in and the time
spent. Nothing is drawn where the console is not a terminal (a pipe, a CI log, a test), so piped output is the
same with or without it. ``kvlab bench`` runs every subcommand inside one (``kvlab.cli.commands.BenchCommand``);
the command says what it is doing with ``phase``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

# The display of the command running in this process (one at a time): ``phase`` finds it here, so the helpers a
# command calls (loading a model, say) can name their phase without being handed the display.
_shown: list[tuple[Progress, TaskID, str]] = []


@contextmanager
def command_progress(console: Console, title: str) -> Iterator[None]:
    """Show ``title`` and the current phase on ``console`` while the block runs, gone when it ends; nothing when
    ``console`` is not a terminal."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    # Writes to the display's own stream are drawn above it; the other stream is left alone, so nothing printed
    # moves between stdout and stderr (``--json -`` keeps stdout the JSON's).
    on_stdout = console.file is sys.stdout
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
        redirect_stdout=on_stdout,
        redirect_stderr=not on_stdout,
    )
    with bar:
        _shown.append((bar, bar.add_task(title, total=None), title))
        try:
            yield
        finally:
            _shown.pop()


def phase(text: str) -> None:
    """Say what the running command is doing now (drawn at once, not at the next tick); nothing without a
    display."""
    if not _shown:
        return
    bar, task, title = _shown[-1]
    bar.update(task, description=f"{title}: {text}")
    bar.refresh()
