"""The ``kvlab`` command: one module per sub-command, assembled here.

Every command imports torch, the engine and the rest of its machinery inside its function, so
``kvlab --help`` and the argument errors stay fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvlab.cli.attention import attention_cli
from kvlab.cli.bench import bench_app
from kvlab.cli.divergence import divergence_cli
from kvlab.cli.experiment import experiment_cli
from kvlab.cli.fuzz import fuzz_cli
from kvlab.cli.generate import generate_cli
from kvlab.cli.memory import memory_cli
from kvlab.cli.probe import probe_cli
from kvlab.cli.serve import serve_cli
from kvlab.cli.trace import trace_app

app = typer.Typer(
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


app.command("memory", help="KV cache size: MHA vs GQA vs MQA, paged vs contiguous, prefix sharing.")(memory_cli)
app.command("generate")(generate_cli)
app.command("experiment")(experiment_cli)
app.command("divergence")(divergence_cli)
app.add_typer(bench_app, name="bench")
app.command("serve")(serve_cli)
app.command("probe")(probe_cli)
app.command("attention")(attention_cli)
app.add_typer(trace_app, name="trace")
app.command("fuzz")(fuzz_cli)

__all__ = ["EXTRAS", "app", "main", "missing_extra"]

# The modules each optional extra of pyproject.toml brings (the base install has the rest).
EXTRAS = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "transformers": "models",
    "tokenizers": "models",
    "gguf": "models",
    "safetensors": "models",
    "matplotlib": "plots",
    "jinja2": "report",
    "hypothesis": "fuzz",
    "ray": "ray",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The error line for a module an optional extra brings, naming the extra to install; None for any other."""
    name = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        return None
    return f"this command needs {name}, which the {extra!r} extra installs: pip install 'kvlab[{extra}]'"


def main() -> None:
    """The console script: the app, with a missing optional dependency said as one line naming its extra
    (exit 2) instead of a traceback."""
    try:
        app()
    except ModuleNotFoundError as exc:
        why = missing_extra(exc)
        if why is None:
            raise
        typer.echo(f"Error: {why}", err=True)
        raise SystemExit(2) from None
