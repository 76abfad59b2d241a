"""The command line a vLLM user types: positional serve MODEL, vLLM's flag names, lists checked up front."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli_output import words
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


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["bench", "throughput", "--peers", "hf-generate,sglang"],
         "Invalid value for '--peers': expected comma-separated peers from hf-generate,"),
        (["bench", "throughput", "--modes", "fp32,fp16"],
         "Invalid value for '--modes': mode 'fp16': unknown or repeated word 'fp16'"),
        (["bench", "step", "--modes", " , "],
         "expected a comma-separated list of modes, got ' , '"),
        (["bench", "fidelity", "--dtype", "float16"],
         "expected comma-separated dtypes from float32, bfloat16, got 'float16'"),
        (["bench", "fidelity", "--quantization", "none,q8"],
         "expected comma-separated quantization modes from none, int8, int4, gguf"),
        (["bench", "sweep", "--block-sizes", "8", "--workload", "medium"],
         "expected comma-separated workloads from short, long"),
        (["bench", "sweep", "--block-sizes", "8", "--granularity", "page"],
         "expected comma-separated prefix granularities from token, block"),
        (["bench", "sweep", "--cliff", "--strategies", "isolated,empty-request"],
         "expected comma-separated strategies from isolated,"),
        (["bench", "cow", "--workloads", "fork,tetris"],
         "expected comma-separated workloads from passphrase, fork, chat"),
        (["bench", "memory", "--sharing", "3:x"],
         "expected N:P:S triples of positive integers, got '3:x'"),
        (["experiment", "--strategies", "isolated,nope"],
         "Invalid value for --strategies: expected comma-separated strategies from"),
    ],
)  # fmt: skip
def test_names_are_checked_before_any_model_loads(no_model_loads, args: list[str], error: str) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert error in words(res.output)
    assert "Traceback" not in res.output


def test_every_list_of_names_shows_its_names_in_help() -> None:
    import typer.main

    from kvlab.bench.names import CLIFF_STRATEGIES, COW_WORKLOADS
    from kvlab.bench.peers.plan import PEERS
    from kvlab.config import GRANULARITIES, QUANTIZATION_MODES
    from kvlab.experiment.strategies import BUILTIN_STRATEGIES

    root = typer.main.get_command(app)
    bench = root.commands["bench"]  # type: ignore[attr-defined]
    expected = {
        ("throughput", "--peers"): PEERS,
        ("throughput", "--modes"): QUANTIZATION_MODES,
        ("fidelity", "--dtype"): ("float32", "bfloat16"),
        ("fidelity", "--quantization"): ("none", *QUANTIZATION_MODES),
        ("sweep", "--workload"): ("short", "long"),
        ("sweep", "--granularity"): GRANULARITIES,
        ("sweep", "--strategies"): CLIFF_STRATEGIES,
        ("cow", "--workloads"): COW_WORKLOADS,
    }
    for (command, flag), names in expected.items():
        (param,) = [p for p in bench.commands[command].params if flag in p.opts]
        assert all(n in param.help for n in names), (command, flag, param.help)
    (strategies,) = [p for p in root.commands["experiment"].params if "--strategies" in p.opts]  # type: ignore[attr-defined]
    assert all(n in strategies.help for n in BUILTIN_STRATEGIES), strategies.help


def test_serve_takes_the_model_positionally_and_refuses_two() -> None:
    res = CliRunner().invoke(app, ["serve", "smollm2", "--model", "mini"])
    assert res.exit_code == 2 and "two models" in res.output
    res = CliRunner().invoke(app, ["serve", "mini", "--dtype", "float8", "--port", "0"])
    assert res.exit_code == 2 and "is not one of" in res.output and "bfloat16" in res.output
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"}).output
    flags = ("MODEL", "--enable-prefix-caching", "--no-enable-prefix-caching", "--dtype", "--weights-seed", "--api-key")
    for flag in flags:
        assert flag in help_text, flag
