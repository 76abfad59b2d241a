"""``kvlab --help`` must not load torch (it took ~3 s when ``import kvlab`` pulled in the engine)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def test_importing_kvlab_and_its_cli_does_not_import_torch() -> None:
    code = "import sys, kvlab, kvlab.cli; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_still_resolve() -> None:
    import kvlab

    assert kvlab.LLM.__name__ == "LLM" and kvlab.SamplingParams().n == 1
    assert set(kvlab.__all__) >= {"LLM", "Engine", "SamplingParams", "CacheConfig"}


def test_version_short_help_and_a_bare_memory_command() -> None:
    from importlib.metadata import version

    from typer.testing import CliRunner

    from kvlab.cli import app

    runner = CliRunner()
    for flag in ("--version", "-V"):
        res = runner.invoke(app, [flag])
        assert res.exit_code == 0 and res.output.strip() == f"kvlab {version('kvlab')}"
    for args in (["-h"], ["serve", "-h"], ["bench", "-h"], ["trace", "explain", "-h"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "Usage:" in res.output, args
    # Bare `kvlab memory` shows an example instead of an error.
    res = runner.invoke(app, ["memory"])
    assert res.exit_code == 0 and "an example with --preset llama-2-7b" in res.output and "KV cache" in res.output
    # Every visible serve option has its help, and the flag column is not cut at 120 columns.
    import typer.main

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    bare = [p.opts[0] for p in serve.params if p.param_type_name == "option" and not p.hidden and not p.help]
    assert bare == [], f"serve options without help: {bare}"
    res = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "120"}, terminal_width=120)
    assert "…" not in res.output


def test_choice_types_list_exactly_what_the_code_accepts() -> None:
    from typing import get_args

    from typer.testing import CliRunner

    from cli_output import words
    from kvlab.bench.serve_results import PROMPT_FORMATS, PromptFormat
    from kvlab.cli import app
    from kvlab.cli.common import AttentionBackendName, DtypeName, QuantizationName
    from kvlab.config import ATTENTION_BACKENDS, QUANTIZATION_MODES
    from kvlab.engine.llm import DTYPES
    from kvlab.experiment.strategies import BUILTIN_STRATEGIES, BuiltinStrategy

    assert get_args(BuiltinStrategy) == tuple(BUILTIN_STRATEGIES)
    assert set(get_args(DtypeName)) == set(DTYPES)
    assert get_args(QuantizationName) == QUANTIZATION_MODES
    assert get_args(AttentionBackendName) == ATTENTION_BACKENDS
    assert get_args(PromptFormat) == PROMPT_FORMATS
    # A wrong choice fails while the command line is parsed (exit 2 naming the allowed values), nothing loaded.
    for args in (
        ["serve", "--prefix-sharing", "bogus"],
        ["serve", "--unsafe-strategy", "nope"],
        ["generate", "--dtype", "fp8", "hi"],
        ["generate", "--quantization", "fp8", "hi"],
        ["generate", "--attention-backend", "flash", "hi"],
        ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--prompt-format", "chat"],
    ):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and "is not one of" in words(res.output), args


def test_a_missing_optional_dependency_names_its_extra(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The base install runs every command; one that needs an extra says which, in one line, exit 2."""
    import kvlab.cli as cli

    def missing(name: str) -> Callable[[], None]:
        def run() -> None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        return run

    monkeypatch.setattr(cli, "app", missing("fastapi.responses"))
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    assert "needs fastapi, which the 'serve' extra installs: pip install 'kvlab[serve]'" in capsys.readouterr().err
    monkeypatch.setattr(cli, "app", missing("not_an_extra"))  # anything else is a bug: its traceback stands
    with pytest.raises(ModuleNotFoundError):
        cli.main()


def test_the_extras_named_are_the_ones_declared() -> None:
    import tomllib

    from kvlab.cli import EXTRAS

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    extras = declared["project"]["optional-dependencies"]
    for module, extra in EXTRAS.items():
        names = {re.split(r"[<>=\[ ]", d)[0].replace("-", "_").lower() for d in extras[extra]}
        assert module in names, (module, extra, names)
