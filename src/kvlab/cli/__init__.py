"""The ``kvlab`` command: one module per sub-command, assembled here.

Every command imports torch, the engine and the rest of its machinery inside its function, so
``kvlab --help`` and the argument errors stay fast.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvlab.cli.attention import attention_cli
from kvlab.cli.bench import bench_app
from kvlab.cli.commands import KvlabCommand, KvlabGroup
from kvlab.cli.common import EXTRAS, missing_extra
from kvlab.cli.divergence import divergence_cli
from kvlab.cli.experiment import experiment_cli
from kvlab.cli.fuzz import fuzz_cli
from kvlab.cli.generate import generate_cli
from kvlab.cli.memory import memory_cli
from kvlab.cli.probe import probe_cli
from kvlab.cli.serve import ServeCommand, serve_cli
from kvlab.cli.trace import trace_app


class _Kvlab(typer.Typer):
    """The ``kvlab`` app, the console script itself: a module an optional extra brings that is missing is said
    as one line naming the extra (exit 2), not a traceback."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ModuleNotFoundError as exc:
            why = missing_extra(exc)
            if why is None:
                raise
            typer.echo(f"Error: {why}", err=True)
            raise SystemExit(2) from None


app = _Kvlab(
    cls=KvlabGroup,
    no_args_is_help=True,
    help="kvlab: shared state and isolation in the KV cache",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"kvlab {version('kvlab')}")
        except PackageNotFoundError:  # a source tree that was never installed
            typer.echo("kvlab (not installed)")
        raise typer.Exit()


@app.callback()
def _main(
    _: Annotated[
        bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print kvlab's version and exit")
    ] = False,
) -> None:
    """kvlab: shared state and isolation in the KV cache."""


app.command("memory", cls=KvlabCommand, help="KV cache size: MHA vs GQA vs MQA, paged vs contiguous, prefix sharing.")(
    memory_cli
)
app.command("generate", cls=KvlabCommand)(generate_cli)
app.command("experiment", cls=KvlabCommand)(experiment_cli)
app.command("divergence", cls=KvlabCommand)(divergence_cli)
app.add_typer(bench_app, name="bench")
app.command("serve", cls=ServeCommand)(serve_cli)
app.command("probe", cls=KvlabCommand)(probe_cli)
app.command("attention", cls=KvlabCommand)(attention_cli)
app.add_typer(trace_app, name="trace")
app.command("fuzz", cls=KvlabCommand)(fuzz_cli)

__all__ = ["EXTRAS", "app", "main", "missing_extra"]


def main() -> None:
    """Run the app (the console script calls ``app`` itself, which says a missing extra as ``main`` did)."""
    app()
