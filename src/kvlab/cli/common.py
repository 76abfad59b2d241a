"""What every ``kvlab`` sub-command shares: the console, threads, loading a model or exiting with its reason,
the option types several commands take, the one parser of comma-separated lists, the one way to fail
(``fail``), drawing a benchmark's table (``render``) and writing ``--json`` output."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeVar

import typer
from rich.console import Console

from kvlab.config import ChoiceError, ModeConfig

# What Typer's main catches and shows in its "Error" panel: the ClickException its own BadParameter derives from
# (since typer 0.26 a copy of click's inside typer, not click's; found through the public class, whichever it is).
ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

if TYPE_CHECKING:
    from kvlab.bench.table import ResultTable
    from kvlab.model.loader import LoadedModel

T = TypeVar("T")

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
STDOUT = Path("-")  # --json -: the JSON is the command's stdout, everything else goes to stderr


def _writable_json(path: Path | None) -> Path | None:
    """--json's check while the command line is parsed: a path that cannot be written is refused before any
    model loads or any request is sent (never a traceback after the work)."""
    check_output_paths(json=path)
    return path


JsonOption = Annotated[
    Path | None,
    typer.Option(
        "--json",
        help="Also write the results as JSON to this file ('-': the JSON alone on stdout)",
        callback=_writable_json,
    ),
]
# ModeConfig's choices (kvlab.config.QUANTIZATION_MODES and ATTENTION_BACKENDS; a test holds them equal).
QuantizationName = Literal["int8", "int4", "gguf"]
AttentionBackendName = Literal["reference", "cpp"]
QuantizationOption = Annotated[
    QuantizationName | None,
    typer.Option(
        "--quantization",
        help="Weight-only quantised linears with bf16 activations (gguf: a GGUF file's own Q4_1 codes); default: none",
    ),
]
AttentionBackendOption = Annotated[
    AttentionBackendName,
    typer.Option(
        "--attention-backend",
        help=(
            "reference: gather + SDPA; cpp: compiled CPU kernels, built on first use (paged attention reading "
            "K/V in place, fused norms, RoPE, SiLU)"
        ),
    ),
]


class CommandError(ClickException):  # type: ignore[misc,valid-type]  # a base found at run time
    """A command's error: Typer prints it in its boxed "Error" panel on stderr and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def fail(message: str, code: int = 2) -> NoReturn:
    """End the command with ``message`` as its error (Typer's "Error" panel, on stderr) and exit status
    ``code``: every error of the CLI looks the same, whether the command line was refused or the run failed."""
    raise CommandError(message, code)


def check_engine_mode(quantization: str | None, attention_backend: str) -> ModeConfig:
    """The engine mode of the options (``ModeConfig``, which validates them), or exit 2 with the allowed values
    before any model loads, the field named as its flag. (The option types already refuse other values while
    the command line is parsed; this holds for callers passing strings.)"""
    try:
        return ModeConfig(quantization=quantization, attention_backend=attention_backend)
    except ChoiceError as exc:
        flag = "--" + exc.field.replace("_", "-")
        allowed = ", ".join(str(a) for a in exc.allowed if a is not None)  # None: the option left out
        fail(f"{flag} must be one of {allowed}, got {exc.value!r}")


def load_or_exit(model: str, seed: int = 0, dtype: str = "float32") -> LoadedModel:
    """``load_model(model)``, or its one-line reason as the command's error (exit status 2). ``seed`` picks a
    mini model's weights; ``dtype`` is vLLM's string (float32, bfloat16, auto)."""
    from kvlab.engine.llm import resolve_dtype
    from kvlab.model import ModelLoadError, load_model

    try:
        return load_model(model, seed=seed, dtype=resolve_dtype(dtype))
    except (ModelLoadError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))


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


def list_items(text: str) -> list[str]:
    """The items of a comma-separated list, stripped, empty ones left out: how every list option is split."""
    return [x.strip() for x in text.split(",") if x.strip()]


def check_probability(value: float) -> float:
    """A probability strictly between 0 and 1 (a significance level); ``typer.BadParameter`` otherwise."""
    if not 0.0 < value < 1.0:
        raise typer.BadParameter(f"expected a probability strictly between 0 and 1, got {value:g}")
    return value


def int_list(text: str, lo: int = 1) -> list[int]:
    """A comma-separated list of integers >= ``lo``; ``typer.BadParameter`` names what is wrong."""
    try:
        values = [int(x) for x in list_items(text)]
    except ValueError as exc:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < lo:
        raise typer.BadParameter(f"expected comma-separated integers >= {lo}, got {text!r}")
    return values


def name_list(
    text: str, allowed: Sequence[str], what: str, allow_empty: bool = False, flag: str | None = None
) -> list[str]:
    """A comma-separated list of names from ``allowed`` (``what`` they are, plural), in order, without repeats;
    ``typer.BadParameter`` (against ``flag`` when raised outside an option's callback) names what is wrong.
    ``allow_empty``: an empty list is a choice (no peers, say)."""
    names = list(dict.fromkeys(list_items(text)))
    if (not names and not allow_empty) or set(names) - set(allowed):
        raise typer.BadParameter(
            f"expected comma-separated {what} from {', '.join(allowed)}, got {text!r}", param_hint=flag
        )
    return names


def parsed_list(text: str, parse: Callable[[str], T], what: str) -> list[T]:
    """A comma-separated list of ``what`` (plural), each item read by ``parse`` (its ValueError says what is
    wrong), in order, without repeats; ``typer.BadParameter`` otherwise."""
    try:
        values = [parse(x) for x in list_items(text)]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if not values:
        raise typer.BadParameter(f"expected a comma-separated list of {what}, got {text!r}")
    return list(dict.fromkeys(values))


def list_callback(check: Callable[[str], object]) -> Callable[[str | None], str | None]:
    """An option callback: ``check(text)`` (which raises ``typer.BadParameter``) runs when the command line is
    parsed, before any model loads; the option keeps its text (None: left out)."""

    def callback(text: str | None) -> str | None:
        if text is not None:
            check(text)
        return text

    return callback


check_int_list = list_callback(int_list)


def names_option(
    allowed: Sequence[str], what: str, help: str | None = None, allow_empty: bool = False, **kwargs: Any
) -> Any:
    """A ``typer.Option`` of a comma-separated list of names from ``allowed``: checked by ``name_list`` when
    the command line is parsed, and listed in --help after ``help`` (default: "Comma-separated {what}")."""
    check = list_callback(lambda text: name_list(text, allowed, what, allow_empty))
    return typer.Option(callback=check, help=f"{help or f'Comma-separated {what}'}: {' | '.join(allowed)}", **kwargs)


def render(out: Console, table: ResultTable) -> None:
    """Draw a benchmark's table (``kvlab.bench.table``): its heading, the rich table, then its notes."""
    from rich.table import Table

    if table.heading:
        out.print(table.heading, highlight=False)
    t = Table(title=table.title)
    for col in table.columns:
        t.add_column(col.header, justify=col.justify, no_wrap=col.no_wrap)
    for row in table.rows:
        t.add_row(*row)
    out.print(t)
    for note in table.notes:
        out.print(note)


def out_console(json_path: Path | None) -> Console:
    """Where a command prints its tables: stdout, or stderr when ``--json -`` makes stdout the JSON's."""
    if json_path != STDOUT:
        return console
    return Console(stderr=True, width=None if sys.stderr.isatty() else 140)


def check_output_paths(**paths: Path | None) -> None:
    """Exit 2 before any work if an output file cannot be written: its folder is missing or not writable, or
    the path is a folder (``--json -`` is stdout). ``paths``: option name (``json``, ``sarif``) -> path."""
    for option, path in paths.items():
        if path is None or path == STDOUT:
            continue
        flag = "--" + option.replace("_", "-")
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            fail(f"{flag} {path}: is a folder, not a file")
        if not folder.is_dir():
            fail(f"{flag} {path}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            fail(f"{flag} {path}: cannot be written (permissions)")


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
