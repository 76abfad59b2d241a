"""``--json -`` means the same in every command: the JSON alone on stdout (tables and progress on stderr), and
no file named ``-``. Every command with ``--json`` runs here on the mini model at its smallest sizes, except
``probe`` and ``bench serve``: they need a server and have their own tests against one (tests/server/test_probe.py,
tests/bench/test_bench_serve.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_output import words
from kvlab.cli import app

ONE = ["--threads", "1"]
COMMANDS = {
    "experiment": ["experiment", "--strategies", "isolated", "--trials", "2"],
    "divergence": ["divergence", "--trials", "1"],
    "fuzz": ["fuzz", "--trials", "2"],
    "bench throughput": ["bench", "throughput", "--requests", "2", "--max-tokens", "2", "--peers", "", *ONE],
    "bench fidelity": ["bench", "fidelity", "--num-prompts", "1", "--max-tokens", "2", "--quantization", "int8",
                       "--no-hf", *ONE],
    "bench sweep": ["bench", "sweep", "--num-prompts", "2", "--max-tokens", "2", "--max-num-seqs", "1",
                    "--max-num-batched-tokens", "64", "--plot", "s.png", *ONE],
    "bench sweep --block-sizes": ["bench", "sweep", "--block-sizes", "16", "--workload", "short", "--granularity",
                                  "token", "--block-requests", "2", "--plot", "b.png", *ONE],
    "bench sweep --cliff": ["bench", "sweep", "--cliff", "--concurrency", "1", "--kv-blocks", "20", "--rounds", "1",
                            "--strategies", "isolated", "--plot", "c.png", *ONE],
    "bench layout": ["bench", "layout", "--batches", "1", "--contexts", "16", "--min-run-time", "0.01", *ONE],
    "bench memory": ["bench", "memory", "--sequences", "4", "--max-seq-len", "64", "--sharing", "2:20:2"],
    "bench step": ["bench", "step", "--batches", "1", "--context", "8", "--steps", "1", *ONE],
    "bench cow": ["bench", "cow", "--workloads", "fork", "--num-prompts", "1", "--n", "2", "--max-tokens", "2",
                  "--repeats", "1", *ONE],
    "bench manager": ["bench", "manager", "--num-requests", "4", "--prompt-tokens", "16", "--shared-prefixes", "0",
                      "--decode-tokens", "1", "--num-blocks", "16", "--repeats", "1", "--lengths", "16",
                      "--lookup-repeats", "1", "--live-requests", "4", "--admit-per-step", "2", "--live-repeats", "1"],
    "bench tenants": ["bench", "tenants", "--tenants", "2", "--requests-per-tenant", "1", "--declared", "1",
                      "--undeclared", "0", "--system-tokens", "16,32", "--document-tokens", "8,16",
                      "--question-tokens", "2,4", "--max-tokens", "2", *ONE],
    "bench speculative": ["bench", "speculative", "--workloads", "shared-prefix", "--num-prompts", "2",
                          "--max-tokens", "4", *ONE],
    "bench scaling": ["bench", "scaling", "--batches", "1", "--contexts", "16", "--context-batch", "1",
                      "--prompt-lengths", "16", "--steps", "1", "--repeats", "1", *ONE],
}  # fmt: skip


@pytest.mark.parametrize("name", list(COMMANDS))
def test_json_dash_is_the_json_alone_on_stdout(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, [*COMMANDS[name], "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # nothing else on stdout
    assert isinstance(data, dict | list) and data
    assert res.stderr.strip()  # the tables went there
    assert not (tmp_path / "-").exists()
    # A path is a file, as before, and stdout keeps the tables.
    res = CliRunner().invoke(app, [*COMMANDS[name], "--json", "out.json"])
    assert res.exit_code == 0 and json.loads((tmp_path / "out.json").read_text()) and res.stdout.strip()


def test_every_command_with_json_is_run_here() -> None:
    """A new command with --json needs its line in COMMANDS (or a reason to be left out)."""
    import typer.main

    def walk(cmd, path: tuple[str, ...]):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, (*path, name))
        if any("--json" in p.opts for p in cmd.params):
            yield " ".join(path)

    with_json = set(walk(typer.main.get_command(app), ()))
    covered = {name.split(" --")[0] for name in COMMANDS}
    assert with_json - covered == {"probe", "bench serve"}, with_json - covered  # tested against a server


@pytest.mark.parametrize("command", [["experiment", "--trials", "1"], ["bench", "manager"], ["bench", "layout"]])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_work(tmp_path, monkeypatch, command):
    """Every command's --json is checked while the command line is parsed: exit 2 naming the path, and no model
    loaded (the work would otherwise run to its end and then fail writing)."""
    import kvlab.model as model

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before --json was checked")

    monkeypatch.setattr(model, "load_model", no_model)
    res = CliRunner().invoke(app, [*command, "--json", str(tmp_path / "missing" / "out.json")])
    assert res.exit_code == 2 and "does not exist" in words(res.output), res.output
