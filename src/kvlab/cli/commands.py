"""The command classes every ``kvlab`` command is built with (``cls=`` where it is registered): what its --help
shows for a switch, options that take several values after one flag, and the progress display of ``kvlab
bench``."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import typer
import typer.core

from kvlab.cli.common import progress_console
from kvlab.cli.progress import command_progress

# typer's labels of an option's type (``<str>``, ``<int range>``: Python's type names) said in click's words; a
# choice keeps its values, which are words already, and a list option names its items itself (``N,...``).
_TYPE_WORDS = {
    "str": "TEXT",
    "int": "INTEGER",
    "int range": "INTEGER",
    "float": "NUMBER",
    "float range": "NUMBER",
    "path": "PATH",
    "file": "FILE",
    "directory": "DIRECTORY",
}


def _metavars_in_words(params: Sequence[Any], ctx: typer.Context) -> list[Any]:
    """``params`` with each option's value said in words: none for a switch (typer shows a flag's type as
    ``<bool>``, which reads as an option taking a value: ``--save-result true`` then fails), and a word for
    the value of the others that name none (``--port INTEGER``, not ``--port <int range>``)."""
    for p in params:
        if p.param_type_name != "option" or p.metavar is not None:
            continue
        if p.is_flag:
            p.metavar = ""
        else:
            label = p.display_type(ctx).strip("<>")
            p.metavar = _TYPE_WORDS.get(label)
    return list(params)


def spread_values(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``args`` with each of ``flags`` followed by several values (argparse's ``nargs='+'``, as vLLM's
    ``--api-key k1 k2``) written as that flag once per value, which click reads. A flag's values run to the next
    word starting with ``-`` (or ``--``, which ends the options); ``--flag=value`` stays one value."""
    out: list[str] = []
    flag: str | None = None
    for word in args:
        if word == "--":
            flag = None
        elif word.startswith("-"):
            flag = word if word in flags else None
        elif flag is not None and out[-1] != flag:
            out.append(flag)  # a further value of the flag just given
        out.append(word)
    return out


@contextmanager
def _plain(command: typer.core.TyperCommand | typer.core.TyperGroup) -> Iterator[None]:
    """``command`` formatted as click does for the time of the block. Typer's rich help is a table whose
    columns shrink together: at 80 columns it cut option names (``--served-model-…``) and wrapped the help
    into a narrow column. Click's layout keeps every name whole at any width (a long one puts its help on the
    next line), as argparse's --help does; errors keep typer's "Error" panel."""
    mode = command.rich_markup_mode
    command.rich_markup_mode = None
    try:
        yield
    finally:
        command.rich_markup_mode = mode


class KvlabCommand(typer.core.TyperCommand):
    """A ``kvlab`` command: its --help in click's layout, switches shown without a value; ``nargs_plus``
    options take several values after one flag (as vLLM's argparse options do) besides the flag repeated."""

    nargs_plus: ClassVar[tuple[str, ...]] = ()

    # typer's Context base class lives in its private click copy; typer.Context is the public name of it.
    def get_params(self, ctx: typer.Context) -> list[Any]:  # type: ignore[override]
        return _metavars_in_words(super().get_params(ctx), ctx)

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        return super().parse_args(ctx, spread_values(args, self.nargs_plus))

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:  # type: ignore[override]
        with _plain(self):
            super().format_help(ctx, formatter)


class KvlabGroup(typer.core.TyperGroup):
    """A group of ``kvlab`` commands (``kvlab``, ``kvlab bench``, ``kvlab trace``), its --help as its
    commands'."""

    def get_params(self, ctx: typer.Context) -> list[Any]:  # type: ignore[override]
        return _metavars_in_words(super().get_params(ctx), ctx)

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:  # type: ignore[override]
        with _plain(self):
            super().format_help(ctx, formatter)


class BenchCommand(KvlabCommand):
    """A ``kvlab bench`` subcommand: it runs inside a progress display on a terminal (``kvlab.cli.progress``),
    on the console its tables go to when that is one, else on stderr (``common.progress_console``)."""

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        from kvlab.bench.peers.vllm_peer import preload_warning

        if (warning := preload_warning(os.environ)) is not None:
            typer.echo(warning, err=True)
        json_path = next((ctx.params.get(p.name or "") for p in self.params if "--json" in p.opts), None)
        with command_progress(progress_console(json_path if isinstance(json_path, Path) else None), ctx.command_path):
            return super().invoke(ctx)
