"""What every ``kvlab`` sub-command shares: the console, threads, loading a model or exiting with its reason,
the option types several commands take, the one parser of comma-separated lists, the one way to fail
(``fail``), drawing a benchmark's table (``render``) and writing ``--json`` output."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeVar, get_args

import typer
from rich.console import Console

from kvlab.cli.progress import phase
from kvlab.config import ChoiceError, ConfigError, ModeConfig, SpeculativeConfig
from kvlab.experiment.strategies import BuiltinStrategy

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
# What a seed seeds is in its name: --weights-seed a mini model's random weights (as LLM(weights_seed=...)); a
# command's --seed seeds its own randomness (trial plans, arrivals, texts), as vLLM's --seed seeds sampling.
WeightsSeedOption = Annotated[
    int, typer.Option("--weights-seed", help="Seed of a mini model's random weights (other models: no effect)")
]
DtypeOption = Annotated[DtypeName, typer.Option("--dtype", help="auto is float32, the reference mode")]
STDOUT = Path("-")  # --json -: the JSON is the command's stdout, everything else goes to stderr


def _writable_json(path: Path | None) -> Path | None:
    """--json's check while the command line is parsed: a path that cannot be written is refused before any
    model loads or any request is sent (never a traceback after the work)."""
    check_output_paths(json=path)
    return path


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config``: vLLM's JSON, refused while the command line is parsed."""
    try:
        return SpeculativeConfig.from_vllm(json.loads(text))
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}") from None
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


SpeculativeOption = Annotated[
    SpeculativeConfig | None,
    typer.Option(
        "--speculative-config",
        metavar="JSON",
        parser=parse_speculative_config,
        help='vLLM\'s speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        "\"prompt_lookup_max\": 4}': drafts from each request's own tokens, verified in one pass (greedy "
        "requests only; docs/speculative.md)",
    ),
]


JsonOption = Annotated[
    Path | None,
    typer.Option(
        "--json",
        help="Also write the results as JSON to this file ('-': the JSON alone on stdout)",
        callback=_writable_json,
    ),
]
# ModeConfig's and CacheConfig's choices (kvlab.config.QUANTIZATION_MODES, ATTENTION_BACKENDS and KV_CACHE_DTYPES;
# a test holds them equal).
QuantizationName = Literal["int8", "int4", "gguf", "int8-w8a8", "int8-w8a8-head"]
AttentionBackendName = Literal["reference", "cpp"]
KvCacheDtypeName = Literal["auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
KvCacheDtypeOption = Annotated[
    KvCacheDtypeName,
    typer.Option(
        "--kv-cache-dtype",
        help="K/V storage: auto (the model's dtype), float32, bfloat16, or fp8 (= fp8_e4m3) / fp8_e5m2, unscaled as "
        "vLLM's without calibrated scales",
    ),
]
QuantizationOption = Annotated[
    QuantizationName | None,
    typer.Option(
        "--quantization",
        help="Quantised linears: weight-only with bf16 activations (gguf: a GGUF file's own Q4_1 codes), or int8-w8a8 "
        "(int8 weights and per-token int8 activations; int8-w8a8-head: the LM head too); default: none",
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


# The modules each optional extra of pyproject.toml brings (the base install has the rest, matplotlib among them:
# every command that draws a PNG runs on it).
EXTRAS = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "prometheus_fastapi_instrumentator": "serve",
    "transformers": "models",
    "tokenizers": "models",
    "gguf": "models",
    "safetensors": "models",
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


def extra_missing(extra: str) -> str | None:
    """What is missing for the optional ``extra`` ("needs jinja2, which the 'report' extra installs: pip install
    ..."): its modules that are not installed and the install line; None when every one is."""
    import importlib.util

    missing = [m for m, e in EXTRAS.items() if e == extra and importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"needs {', '.join(missing)}, which the {extra!r} extra installs: pip install 'kvlab[{extra}]'"


def check_extra(extra: str, what: str) -> None:
    """Exit 2 before any work when a module the optional ``extra`` brings is not installed, naming ``what``
    needs it (``kvlab experiment --report``) and the install line."""
    why = extra_missing(extra)
    if why is not None:
        fail(f"{what} {why}")


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


def load_or_exit(model: str, weights_seed: int = 0, dtype: str = "float32") -> LoadedModel:
    """``load_model(model)``, or its one-line reason as the command's error (exit status 2). ``weights_seed``
    picks a mini model's weights; ``dtype`` is vLLM's string (float32, bfloat16, auto)."""
    from kvlab.engine.llm import resolve_dtype
    from kvlab.model import ModelLoadError, load_model

    phase(f"loading {model}")
    try:
        loaded = load_model(model, seed=weights_seed, dtype=resolve_dtype(dtype))
    except (ModelLoadError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    phase("running")
    return loaded


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


def int_pair(text: str) -> tuple[int, int]:
    """``MIN,MAX``: a range of integers >= 1 said as every list is, comma-separated (``--system-tokens
    200,2000``); ``typer.BadParameter`` otherwise."""
    values = int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise typer.BadParameter(f"expected MIN,MAX: two comma-separated integers, MIN <= MAX, got {text!r}")
    return values[0], values[1]


def int_list_option(help: str, lo: int = 1, **kwargs: Any) -> Any:
    """A ``typer.Option`` of comma-separated integers >= ``lo`` (``int_list``), checked when the command line
    is parsed; the option keeps its text."""
    return typer.Option(callback=list_callback(lambda text: int_list(text, lo)), metavar="N,...", help=help, **kwargs)


def int_range_option(help: str, **kwargs: Any) -> Any:
    """A ``typer.Option`` of a ``MIN,MAX`` range (``int_pair``), checked when the command line is parsed; the
    option keeps its text."""
    return typer.Option(callback=list_callback(int_pair), metavar="MIN,MAX", help=help, **kwargs)


def names_option(
    allowed: Sequence[str], what: str, help: str | None = None, allow_empty: bool = False, **kwargs: Any
) -> Any:
    """A ``typer.Option`` of a comma-separated list of names from ``allowed``: checked by ``name_list`` when
    the command line is parsed, and listed in --help after ``help`` (default: "Comma-separated {what}")."""
    check = list_callback(lambda text: name_list(text, allowed, what, allow_empty))
    kwargs.setdefault("metavar", "NAME,...")
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
    return stderr_console()


@cache
def stderr_console() -> Console:
    """The one console on stderr: a progress display and the tables printed while it runs must share it, or
    the display is drawn over them."""
    return Console(stderr=True, width=None if sys.stderr.isatty() else 140)


def progress_console(json_path: Path | None) -> Console:
    """Where a command's progress display goes: on its tables' console when that is a terminal (the tables
    print above it), else on stderr, as with ``kvlab bench ... > results.txt`` watched on a terminal."""
    out = out_console(json_path)
    return out if out.is_terminal else stderr_console()


def check_output_paths(**paths: Path | None) -> None:
    """Exit 2 before any work if an output file cannot be written: its folder is missing or not writable, or
    the path is a folder (``--json -`` is stdout). ``paths``: option name (``json``, ``sarif``) -> path."""
    for option, path in paths.items():
        if path is not None and path != STDOUT:
            _check_output_file("--" + option.replace("_", "-"), path)


def _check_output_file(flag: str, path: Path) -> None:
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        fail(f"{flag} {path}: is a folder, not a file")
    if not folder.is_dir():
        fail(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"{flag} {path}: cannot be written (permissions)")


def writable_file(param: typer.CallbackParam, path: Path | None) -> Path | None:
    """Option callback: an output file (a PNG, a trace) checked as ``check_output_paths`` checks ``--json``,
    while the command line is parsed: a run never ends in a traceback after its work for want of a folder."""
    if path is not None:
        _check_output_file(param.opts[0], path)
    return path


def writable_folder(param: typer.CallbackParam, path: Path | None) -> Path | None:
    """Option callback: an output folder (made if missing) whose nearest existing parent is a folder that can
    be written, checked while the command line is parsed."""
    if path is None:
        return path
    flag = param.opts[0]
    if path.exists() and not path.is_dir():
        fail(f"{flag} {path}: is a file, not a folder")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        fail(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        fail(f"{flag} {path}: {existing} cannot be written (permissions)")
    return path


def strategy_option(help: str) -> Any:
    """The ``typer.Option`` of one built-in experiment strategy: STRATEGY in --help's flag column and the names
    after ``help`` (listed in the flag column they ran past the help's width)."""
    return typer.Option(metavar="STRATEGY", help=f"{help}: {' | '.join(get_args(BuiltinStrategy))}")


def plot_option(help: str) -> Any:
    """The ``typer.Option`` of a PNG a command writes: ``--plot PNG`` in every command, its folder checked when
    the command line is parsed."""
    return typer.Option("--plot", metavar="PNG", callback=writable_file, help=help)


def input_file(help: str, **kwargs: Any) -> Any:
    """The ``typer.Option`` of a file a command reads: one that is missing or a folder is refused when the
    command line is parsed (exit 2, naming the option), before anything loads."""
    return typer.Option(exists=True, dir_okay=False, readable=True, help=help, **kwargs)


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
