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
    from kvlab.cli.common import AttentionBackendName, DtypeName, KvCacheDtypeName, QuantizationName
    from kvlab.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_MODES
    from kvlab.engine.llm import DTYPES
    from kvlab.experiment.strategies import BUILTIN_STRATEGIES, BuiltinStrategy

    assert get_args(BuiltinStrategy) == tuple(BUILTIN_STRATEGIES)
    assert set(get_args(DtypeName)) == set(DTYPES)
    assert get_args(QuantizationName) == QUANTIZATION_MODES
    assert get_args(AttentionBackendName) == ATTENTION_BACKENDS
    assert get_args(KvCacheDtypeName) == KV_CACHE_DTYPES
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


def test_the_console_script_names_the_extra_a_command_misses(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The base install runs every command; one that needs an extra says which, in one line, exit 2. The console
    script is ``kvlab.cli:app`` itself (a ``main`` beside it, which said this before, was never what ran)."""
    from importlib.metadata import entry_points

    import kvlab.cli as cli
    import kvlab.cli.memory as memory

    (script,) = entry_points(group="console_scripts", name="kvlab")
    assert script.load() is cli.app

    def missing(name: str) -> Callable[..., None]:
        def run(*args: object) -> None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        return run

    monkeypatch.setattr(memory, "resolve_shape", missing("fastapi.responses"))
    with pytest.raises(SystemExit) as exited:
        cli.app(["memory", "--preset", "llama-2-7b"], prog_name="kvlab")
    assert exited.value.code == 2
    assert "needs fastapi, which the 'serve' extra installs: pip install 'kvlab[serve]'" in capsys.readouterr().err
    monkeypatch.setattr(memory, "resolve_shape", missing("not_an_extra"))  # anything else is a bug: its traceback
    with pytest.raises(ModuleNotFoundError):
        cli.app(["memory", "--preset", "llama-2-7b"], prog_name="kvlab")


# The console script as the base install (pip install -e .) runs it: every extra's module absent.
BASE_INSTALL = """
import sys
from importlib.metadata import entry_points
from kvlab.cli.common import EXTRAS
for module in EXTRAS:
    sys.modules[module] = None  # import fails, find_spec finds nothing: as if never installed
(script,) = entry_points(group="console_scripts", name="kvlab")
sys.argv = ["kvlab", *sys.argv[1:]]
script.load()()
"""


def _base_install(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BASE_INSTALL, *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_base_install_names_the_extra_of_experiment_report_before_the_work(tmp_path: Path) -> None:
    """It crashed on "No module named 'matplotlib'" after every trial had run."""
    res = _base_install("experiment", "--report", "report", "--trials", "1", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    said = " ".join(res.stderr.replace("│", " ").split())
    assert "kvlab experiment --report needs jinja2, which the 'report' extra installs" in said
    assert "pip install 'kvlab[report]'" in said
    assert "Traceback" not in res.stderr and res.stdout == "" and not (tmp_path / "report").exists()


def test_the_base_install_draws_pngs_and_skips_peers_it_cannot_run(tmp_path: Path) -> None:
    """matplotlib is a base dependency; the HF peers are skipped with their extra named, as llama.cpp is."""
    import tomllib

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    assert any(d.startswith("matplotlib") for d in declared["project"]["dependencies"])
    res = _base_install("attention", "--prompt", "hello there", "--max-tokens", "1", "--plot", "a.png", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    args = ("bench", "throughput", "--requests", "1", "--max-tokens", "1", "--threads", "1")
    res = _base_install(*args, "--peers", "hf-generate", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    said = " ".join(res.stdout.split())
    assert "hf-generate skipped: needs transformers" in said and "pip install 'kvlab[models]'" in said


def test_the_extras_named_are_the_ones_declared() -> None:
    import tomllib

    from kvlab.cli import EXTRAS

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    extras = declared["project"]["optional-dependencies"]
    for module, extra in EXTRAS.items():
        names = {re.split(r"[<>=\[ ]", d)[0].replace("-", "_").lower() for d in extras[extra]}
        assert module in names, (module, extra, names)
