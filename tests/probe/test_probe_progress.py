"""The probe's progress: the callback ``run_probe`` and ``run_extract`` accept sees every phase of a run in order,
each started, counted and ended; ``kvlab probe`` shows them (on stderr with ``--json -``, whose stdout stays the
JSON alone)."""

from __future__ import annotations

import json
from itertools import groupby
from typing import Any

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.experiment.passphrases import default_passphrases
from kvlab.probe.attacks.base import ExtractConfig
from kvlab.probe.extract import run_extract
from kvlab.probe.material import default_reuse_groups
from kvlab.probe.probe import run_probe
from kvlab.probe.progress import PHASES, PhaseProgress, Phases
from kvlab.probe.timing import SHAPES

FAST: dict[str, Any] = dict(
    concurrency=2, rounds=2, reuse_trials=2, determinism_repeats=1, calibration_prompts=4, timing=False
)


def by_phase(events: list[PhaseProgress]) -> dict[str, list[PhaseProgress]]:
    """The events of each phase; a phase's events are contiguous (phases never interleave)."""
    runs = [(name, list(evs)) for name, evs in groupby(events, key=lambda e: e.phase)]
    assert len({name for name, _ in runs}) == len(runs), [name for name, _ in runs]
    return dict(runs)


def check_phase(evs: list[PhaseProgress], total: int | None) -> None:
    """Started at 0, one tick at a time, ended once; a counted phase ends at its total."""
    start, *moves, end = evs
    assert (start.done, start.finished) == (0, False) and end.finished and not any(e.finished for e in moves)
    assert [e.done for e in moves] == list(range(1, len(moves) + 1)) and end.done == len(moves)
    assert all(e.total == total for e in evs)
    if total is not None:
        assert end.done == total


def test_the_callback_sees_every_phase_in_order(standin) -> None:
    url = standin(report_cached="usage")
    events: list[PhaseProgress] = []
    timing = dict(timing=True, timing_trials=2, timing_prefix_chars=64, timing_shapes=SHAPES[:1])
    report = run_probe(url, "toy", default_passphrases(), progress=events.append, **{**FAST, **timing})
    phases = by_phase(events)
    expected = ["capabilities", "granularity", "salts", "references", "determinism", "bursts", "reuse", "timing"]
    expected.append("metrics")
    assert list(phases) == expected and [p for p in PHASES if p in phases] == expected  # PHASES' order
    groups = default_passphrases().groups
    assert report.capabilities.salt.accepted  # so timing runs without and with salts
    # 2 pairs could never reach alpha over 2 runs x 2 channels (1/C(4, 2) > 0.01/4): the probe raised them to 6.
    assert report.timing is not None and report.timing.trials_requested == 2 and report.timing.trials == 6
    totals = {
        "capabilities": None,
        "granularity": None,  # lengths until the block size is known: not known in advance
        "salts": None,
        "references": sum(len(g.prompts) for g in groups) + FAST["calibration_prompts"],
        "determinism": sum(len(g.prompts) for g in groups),
        "bursts": FAST["rounds"] * len(groups),
        "reuse": len(default_reuse_groups()) * (FAST["reuse_trials"] + 1),
        "timing": 2 * 1 * 6,
        "metrics": None,
    }
    for name, evs in phases.items():
        check_phase(evs, totals[name])
    # The counts are the work done: every burst observed, every timing pair sampled.
    assert len(report.observations) == FAST["rounds"] * len(groups) * FAST["concurrency"]
    assert sum(len(r.hit_ttft) for r in report.timing.runs) == 2 * 6


def test_phases_that_do_not_apply_are_skipped(standin) -> None:
    events: list[PhaseProgress] = []
    run_probe(standin(), "toy", default_passphrases(), progress=events.append, reuse_groups=[], **FAST)
    assert list(by_phase(events)) == ["capabilities", "salts", "references", "determinism", "bursts", "metrics"]


def test_the_extraction_attack_reports_its_steps(standin) -> None:
    events: list[PhaseProgress] = []
    cfg = ExtractConfig(alphabet="abcd", secret="dcb", seed=1)
    report = run_extract(standin(report_cached="usage"), "toy", cfg, progress=events.append)
    phases = by_phase(events)
    assert list(phases) == ["metrics", "extraction"]
    check_phase(phases["metrics"], None)
    check_phase(phases["extraction"], None)  # no count known in advance: the secret's length is the secret's
    assert phases["extraction"][-1].done == len(report.steps) >= 1


def test_a_phase_that_fails_never_ends() -> None:
    events: list[PhaseProgress] = []
    with pytest.raises(RuntimeError), Phases(events.append).phase("bursts", 3) as tick:
        tick()
        raise RuntimeError("server gone")
    assert events == [PhaseProgress("bursts", 0, 3), PhaseProgress("bursts", 1, 3)]
    with pytest.raises(ValueError, match="unknown probe phase"), Phases().phase("warmup"):
        pass


def test_cli_shows_the_phases_on_stderr_and_the_json_alone_on_stdout(standin) -> None:
    url = standin()
    args = ["probe", "--base-url", url, "--rounds", "1", "--concurrency", "2", "--no-reuse", "--no-timing"]
    res = CliRunner().invoke(app, [*args, "--determinism-repeats", "1", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["target"]["model"] == "toy" and data["verdict"] == "clean"
    shown = [line.split()[1] for line in res.stderr.splitlines() if line.startswith("probe: ")]
    assert shown == ["capabilities", "salts", "references", "determinism", "bursts", "metrics"]
    n = len(default_passphrases().groups)  # one round of bursts per group
    assert f"{n}/{n} bursts" in res.stderr
    # Without --json -, the phases and the report share stdout, the phases first.
    res = CliRunner().invoke(app, [*args, "--determinism-repeats", "1"])
    assert res.exit_code == 0 and res.stdout.index("probe: metrics") < res.stdout.index("verdict: CLEAN")
