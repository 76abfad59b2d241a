"""What every ``kvlab`` sub-command shares: the console, threads, loading a model or exiting with its reason,
the option types several commands take, and writing ``--json`` output."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console

from kvlab.config import ChoiceError, ModeConfig

if TYPE_CHECKING:
    from kvlab.model.loader import LoadedModel

# Piped output (CI logs, `| tee`) would otherwise be cut to 80 columns and truncate the tables.
console = Console(width=None if sys.stdout.isatty() else 140)

ModelOption = Annotated[str, typer.Option("--model", help="mini | mini-gqa | mini-mqa | smollm2 | PATH")]
ThreadsOption = Annotated[
    int | None, typer.Option("--threads", help="Torch threads (default: every core, 1 for a tiny model)")
]
# Choice options are Literal types: their values appear in --help, and a wrong one fails when the command line
# is parsed, before anything loads. vLLM's dtype strings (kvlab.engine.llm.DTYPES, which needs torch to import;
# a test holds the two equal).
DtypeName = Literal["auto", "float32", "bfloat16"]
DtypeOption = Annotated[DtypeName, typer.Option("--dtype", help="auto is float32, the reference mode")]
JsonOption = Annotated[
    Path | None,
    typer.Option("--json", help="Also write the results as JSON to this file ('-': the JSON alone on stdout)"),
]
STDOUT = Path("-")  # --json -: the JSON is the command's stdout, everything else goes to stderr
QuantizationOption = Annotated[
    str | None,
    typer.Option(
        "--quantization",
        help="int8 | int4 | gguf: weight-only quantised linears with bf16 activations (gguf: a GGUF file's own "
        "Q4_1 codes); default: none",
    ),
]
AttentionBackendOption = Annotated[
    str,
    typer.Option(
        "--attention-backend",
        help=(
            "reference (gather + SDPA) | cpp (compiled CPU kernels, built on first use: paged attention reading "
            "K/V in place, fused norms, RoPE, SiLU)"
        ),
    ),
]


def check_engine_mode(quantization: str | None, attention_backend: str) -> ModeConfig:
    """The engine mode of the options (``ModeConfig``, which validates them), or exit 2 with the allowed values
    before any model loads, the field named as its flag."""
    try:
        return ModeConfig(quantization=quantization, attention_backend=attention_backend)
    except ChoiceError as exc:
        flag = "--" + exc.field.replace("_", "-")
        allowed = ", ".join(str(a) for a in exc.allowed if a is not None)  # None: the option left out
        console.print(f"[red]error:[/red] {flag} must be one of {allowed}, got {exc.value!r}")
        raise typer.Exit(2) from exc


def load_or_exit(model: str, seed: int = 0, dtype: str = "float32") -> LoadedModel:
    """``load_model(model)``, or a red one-line reason and exit status 2. ``seed`` picks a mini model's weights;
    ``dtype`` is vLLM's string (float32, bfloat16, auto)."""
    from kvlab.engine.llm import resolve_dtype
    from kvlab.model import ModelLoadError, load_model

    try:
        return load_model(model, seed=seed, dtype=resolve_dtype(dtype))
    except (ModelLoadError, ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def set_threads(threads: int | None, loaded: LoadedModel | None = None) -> int:
    """Torch intra-op threads: the given number; by default every core, but one for a tiny model."""
    import torch

    if threads is None:
        # Tiny matmuls (the mini model) spend more time in OpenMP fork/join than in arithmetic: one thread is
        # faster there; real models use every core.
        tiny = loaded is not None and loaded.config.hidden_size <= 256
        threads = 1 if tiny else (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def int_list(text: str, lo: int = 1) -> list[int]:
    """A comma-separated list of integers >= ``lo``; ``typer.BadParameter`` names what is wrong."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < lo:
        raise typer.BadParameter(f"expected comma-separated integers >= {lo}, got {text!r}")
    return values


def check_int_list(text: str) -> str:
    """An option callback: the list is checked when the command line is parsed, before any model loads."""
    int_list(text)
    return text


def out_console(json_path: Path | None) -> Console:
    """Where a command prints its tables: stdout, or stderr when ``--json -`` makes stdout the JSON's."""
    if json_path != STDOUT:
        return console
    return Console(stderr=True, width=None if sys.stderr.isatty() else 140)


def dump_json(path: Path | None, obj: object) -> None:
    """Write ``obj`` to the ``--json`` path, if one was given; ``-`` prints it alone on stdout (one meaning of
    ``--json -`` in every command)."""
    if path is None:
        return
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    if path == STDOUT:
        typer.echo(text)
        return
    path.write_text(text, encoding="utf-8")
    out_console(path).print(f"wrote {path}", highlight=False)
