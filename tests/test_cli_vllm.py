"""The command line a vLLM user types: positional serve MODEL, vLLM's flag names, lists checked up front."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvlab.cli import app


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if a command loads a model before refusing its arguments."""
    import kvlab.model as model_pkg
    import kvlab.model.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(model_pkg, "load_model", refuse)


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "throughput", "--requests", "abc"],
        ["bench", "throughput", "--requests", "16,-1"],
        ["bench", "sweep", "--max-num-seqs", "8,x"],
        ["bench", "step", "--batches", ""],
        ["attention", "--prompt", "hello", "--compare-kv-heads", "4,two"],
    ],
)
def test_lists_are_checked_before_any_model_loads(no_model_loads, args: list[str]) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "comma-separated integers" in res.output
    assert "Traceback" not in res.output


def test_serve_takes_the_model_positionally_and_refuses_two() -> None:
    res = CliRunner().invoke(app, ["serve", "smollm2", "--model", "mini"])
    assert res.exit_code == 2 and "two models" in res.output
    res = CliRunner().invoke(app, ["serve", "mini", "--dtype", "float8", "--port", "0"])
    assert res.exit_code == 2 and "is not one of" in res.output and "bfloat16" in res.output
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"}).output
    for flag in ("MODEL", "--enable-prefix-caching", "--no-enable-prefix-caching", "--dtype", "--seed", "--api-key"):
        assert flag in help_text, flag
