"""``kvlab fuzz``: the summary, exit codes, saved cases and ``--replay``."""

from __future__ import annotations

import json

from fuzz_rig import needs_row_invariant_kernels
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.fuzz import FuzzCase, FuzzConfig, FuzzRequest

cli = CliRunner()


def test_safe_campaign_exits_0_with_a_json_summary(tmp_path):
    out = tmp_path / "summary.json"
    res = cli.invoke(app, ["fuzz", "--trials", "6", "--json", str(out), "--cases-dir", str(tmp_path / "cases")])
    assert res.exit_code == 0, res.output
    assert "6 trials" in res.output and "0 failing" in res.output and "trials/s" in res.output
    summary = json.loads(out.read_text())
    assert summary["trials"] == 6 and summary["failures"] == 0 and summary["failing"] == []
    assert summary["executor"] == "serial" and summary["trials_per_s"] > 0
    assert not (tmp_path / "cases").exists()


def test_a_campaign_over_one_cache_dtype_runs_every_trial_over_it_on_the_same_workloads(tmp_path):
    """--kv-cache-dtype fixes every trial's pool dtype and nothing else: the trials are the drawn ones (the dtype is
    still drawn, then overridden), and the summary says which dtype and how many trials rounded."""
    from kvlab.fuzz import CaseMeta, draw_case

    out = tmp_path / "summary.json"
    res = cli.invoke(app, ["fuzz", "--trials", "6", "--kv-cache-dtype", "fp8", "--json", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert summary["kv_cache_dtype"] == "fp8" and summary["coverage"]["rounding-cache"] == 1.0
    assert summary["failures"] == 0
    for i in range(20):
        drawn, fixed = draw_case(CaseMeta(), 0, i), draw_case(CaseMeta(kv_cache_dtype="fp8_e5m2"), 0, i)
        assert fixed.choices == drawn.choices and fixed.case.requests == drawn.case.requests
        assert fixed.case.config.kv_cache_dtype == "fp8_e5m2"
    res = cli.invoke(app, ["fuzz", "--trials", "1", "--kv-cache-dtype", "fp16"])
    assert res.exit_code == 2 and "kv-cache-dtype" in res.output


@needs_row_invariant_kernels
def test_a_campaign_in_the_row_invariant_precision_runs_every_trial_in_it(tmp_path):
    """--precision fixes every trial's precision (the draws as they were, the mode's kernels and layout set); the
    CLI's choices are the fuzzer's precisions; a precision it does not know is refused before anything runs."""
    import typing

    from kvlab.cli.fuzz import FuzzPrecision
    from kvlab.fuzz import PRECISIONS, ROW_INVARIANT

    assert typing.get_args(FuzzPrecision) == PRECISIONS
    out = tmp_path / "summary.json"
    res = cli.invoke(app, ["fuzz", "--trials", "6", "--precision", ROW_INVARIANT, "--json", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert summary["precision"] == ROW_INVARIANT and summary["coverage"][ROW_INVARIANT] == 1.0
    assert summary["failures"] == 0
    res = cli.invoke(app, ["fuzz", "--trials", "1", "--precision", "bf16"])
    assert res.exit_code == 2 and "precision" in res.output


def test_unsafe_campaign_exits_1_saves_the_shrunk_case_and_it_replays(tmp_path):
    cases = tmp_path / "cases"
    args = ["fuzz", "--unsafe-strategy", "shared-no-refcount", "--trials", "30", "--max-failures", "1"]
    res = cli.invoke(app, [*args, "--shrink-budget", "40", "--cases-dir", str(cases)])
    assert res.exit_code == 1, res.output
    assert "1 failing" in res.output and "kvlab fuzz --replay" in res.output
    [shrunk] = sorted(cases.glob("trial-*[0-9].json"))
    assert (cases / shrunk.name.replace(".json", ".original.json")).exists()
    case = FuzzCase.load(shrunk)
    assert case.strategy == "shared-no-refcount" and case.note["failures"]

    replay = cli.invoke(app, ["fuzz", "--replay", str(shrunk)])
    assert replay.exit_code == 1, replay.output
    assert "sanitizer root cause" in replay.output and "written by request" in replay.output
    assert "first wrong token" in replay.output


def test_replay_of_a_passing_case_exits_0(tmp_path):
    case = FuzzCase(FuzzConfig(block_size=2, num_blocks=12), (FuzzRequest((97, 98, 97), max_tokens=2, n=2),))
    res = cli.invoke(app, ["fuzz", "--replay", str(case.save(tmp_path / "ok.json"))])
    assert res.exit_code == 0, res.output
    assert "passes" in res.output and "r0: prompt [97, 98, 97]" in res.output


def test_bad_arguments_exit_2(tmp_path):
    res = cli.invoke(app, ["fuzz", "--unsafe-strategy", "no-such", "--trials", "1"])
    assert res.exit_code == 2 and "strategy" in res.output
    (tmp_path / "bad.json").write_text("{not json")
    res = cli.invoke(app, ["fuzz", "--replay", str(tmp_path / "bad.json")])
    assert res.exit_code == 2 and "cannot read the case" in res.output


def test_a_ray_address_nobody_answers_fails_at_once_with_the_address_and_a_hint():
    """Ray retries an unreachable address for minutes; kvlab checks it first (a refused port, a bad name)."""
    for address in ("127.0.0.1:1", "not-an-address"):
        res = CliRunner().invoke(app, ["fuzz", "--ray", address, "--trials", "1"])
        assert res.exit_code == 2, res.output
        assert repr(address) in res.output and "ray start --head" in res.output and "--ray local" in res.output
