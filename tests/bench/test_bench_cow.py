"""``kvlab bench cow`` on the mini model with tiny sizes: the counts must be consistent and both modes must give
the same tokens (timings are printed, never checked)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import kvlab.bench.studies.cow as cow
from kvlab.cli import app

runner = CliRunner()
TINY = ["--trials", "2", "--num-prompts", "2", "--n", "3", "--sessions", "2", "--turns", "2", "--max-tokens", "4"]


def test_bench_cow_runs_both_modes_on_every_workload(tmp_path) -> None:
    out = tmp_path / "cow.json"
    res = runner.invoke(app, ["bench", "cow", *TINY, "--repeats", "1", "--threads", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert [r["workload"] for r in rows] == ["passphrase", "fork", "chat"]
    for row in rows:
        assert row["identical"] and row["mismatches"] == []
        write, alloc = row["runs"]
        assert (write["cow_check"], alloc["cow_check"]) == ("write", "allocate")
        assert row["extra_copies"] == alloc["cow_copies"] - write["cow_copies"] >= 0
        assert write["cow_copies_eager"] == write["cow_copies_unneeded"] == 0
        for run in (write, alloc):
            assert run["cow_copies"] >= run["cow_copies_eager"] >= run["cow_copies_unneeded"] >= 0
            assert run["cow_bytes"] == run["storage_bytes_copied"] == run["cow_copies"] * run["block_nbytes"]
            assert run["steps"] > 0 and run["kv_seconds"] > 0 and run["total_seconds"] > 0
        assert write["output_tokens"] == alloc["output_tokens"] and write["steps"] == alloc["steps"]
    passphrase, fork, chat = rows
    assert passphrase["runs"][0]["requests"] == 4  # 2 trials x 2 concurrent requests
    assert fork["runs"][1]["sequences"] == 6 and fork["runs"][1]["cow_copies_eager"] > 0  # copies at the forks
    assert chat["runs"][0]["requests"] == 4  # 2 sessions x 2 turns
    assert "cow: mini, blocks of 16 tokens (64 KiB each)" in res.output


def test_a_token_mismatch_between_the_modes_is_reported_loudly(monkeypatch) -> None:
    real = cow._run_fork

    def broken(loaded, cache, sizes, run) -> None:
        real(loaded, cache, sizes, run)
        if cache.cow_check == "allocate":
            run.tokens["prompt 1"] = [(1, 2, 3)]

    monkeypatch.setitem(cow._RUNNERS, "fork", broken)
    res = runner.invoke(app, ["bench", "cow", *TINY, "--workloads", "fork", "--repeats", "1", "--threads", "1"])
    assert res.exit_code == 1
    assert "MISMATCH fork: 1 request(s) got different tokens" in " ".join(res.output.split())
    assert "prompt 1" in res.output


def test_an_unknown_workload_is_refused_before_any_model_loads() -> None:
    res = runner.invoke(app, ["bench", "cow", "--workloads", "fork,tetris"])
    assert res.exit_code == 2 and "tetris" in res.output
