"""The probe's time budget (``--max-seconds``): the cuttable phases share it, a slow server gets fewer lengths,
prompts, rounds, trials and pairs, and every cut is said where its verdict is made — a search stopped by the
budget is never clean, a timing that cannot afford the pairs alpha needs is not measured, never clean.

Units run on a fake clock; the end-to-end test on a stand-in whose every request stays in flight 40 ms, so the
default plan (hundreds of requests) cannot fit a budget of a few seconds on any machine (what is asserted is
that cuts happen and are said, never how long anything took)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.experiment.passphrases import default_passphrases
from kvlab.probe.budget import SHARES, Allowance, Budget
from kvlab.probe.probe import ProbeConfig, plan_requests, run_probe
from kvlab.probe.timing import SHAPES, fit_plan, plan_trials, smallest_p


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ shares and pace
def test_each_phase_gets_its_share_of_what_is_left_and_an_early_finish_rolls_forward() -> None:
    clock = FakeClock()
    b = Budget(100.0, clock)
    g = b.allowance("granularity")
    assert g.left() == pytest.approx(100 * SHARES["granularity"])
    clock.now += 5  # the search needed 5 s of its 15
    d = b.allowance("determinism")
    rest = sum(v for k, v in SHARES.items() if k != "granularity")
    assert d.left() == pytest.approx(95 * SHARES["determinism"] / rest)
    clock.now += 200  # a phase that overran leaves nothing for the next: they measure their first unit only
    t = b.allowance("timing")
    assert t.left() == 0 and t.affords(0)
    clock.now += 1  # its first unit took a second
    assert not t.affords(1)


def test_a_phase_that_will_not_run_leaves_its_share_to_the_others() -> None:
    """Without reuse and timing (--no-reuse --no-timing) their 60% is not held back for phases that never come."""
    clock = FakeClock()
    b = Budget(100.0, clock)
    b.skip("reuse")
    b.skip("timing")
    b.allowance("granularity")
    b.allowance("determinism")
    assert b.allowance("bursts").left() == pytest.approx(100.0)  # the last phase to run gets what is left


def test_a_unit_is_afforded_at_the_pace_measured_so_far() -> None:
    clock = FakeClock()
    a = Allowance("bursts", clock() + 10, clock)
    assert a.affords(0)  # the first unit always runs
    clock.now += 3  # one unit took 3 s: a second ends at 6, a third at 9, a fourth would end at 12
    assert a.affords(1) and a.affords(1, more=2) and not a.affords(1, more=3)
    clock.now += 3
    assert a.affords(2) and not a.affords(2, more=2)
    later = a.from_now()  # another kind of unit: its pace from now, the same end
    assert later.end == a.end and later.affords(0)


def test_no_budget_never_cuts() -> None:
    clock = FakeClock()
    b = Budget(None, clock)
    a = b.allowance("timing")
    clock.now += 1e9
    assert not a.bounded and a.affords(1, more=10**6) and math.isinf(b.left())


def test_a_budget_must_be_positive_and_phases_named() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        Budget(0.0)
    with pytest.raises(ValueError, match="no share of the time budget for phase 'salts'"):
        Budget(10.0).allowance("salts")
    with pytest.raises(ValueError, match="max_seconds must be > 0"):
        ProbeConfig(max_seconds=-1).validate()


# ------------------------------------------------------------------ what of the timing fits
def test_the_whole_plan_when_it_fits() -> None:
    fit = fit_plan(8, 0.01, SHAPES, True, True, request_seconds=0.01, seconds=1000)
    assert fit.whole and fit.shapes == len(SHAPES) and fit.pairs == 8


def test_fewer_pairs_then_fewer_shapes_then_none() -> None:
    pair = 2 * sum(2 * (s.sends + 1) for s in SHAPES)  # requests per pair over every shape, both salt conditions
    fewer = fit_plan(8, 0.01, SHAPES, True, True, request_seconds=1.0, seconds=7.5 * pair)
    assert (fewer.shapes, fewer.pairs) == (len(SHAPES), 7) and not fewer.whole  # 7: the least 12 tests need
    one = 2 * 2 * (SHAPES[0].sends + 1)
    shapes = fit_plan(8, 0.01, SHAPES, True, True, request_seconds=1.0, seconds=7 * one)
    assert shapes.shapes == 1 and shapes.pairs >= plan_trials(1, 0.01, 2, 2)
    none = fit_plan(8, 0.01, SHAPES, True, True, request_seconds=1.0, seconds=one)
    assert none.shapes == 0 and none.pairs == 0


@settings(max_examples=200, deadline=None)
@given(
    trials=st.integers(1, 16),
    alpha=st.sampled_from([0.001, 0.01, 0.05]),
    salts=st.booleans(),
    cached=st.booleans(),
    request_seconds=st.floats(0.001, 10),
    seconds=st.floats(0, 5000),
)
def test_what_fits_costs_at_most_the_budget_and_every_test_can_reach_alpha(
    trials: int, alpha: float, salts: bool, cached: bool, request_seconds: float, seconds: float
) -> None:
    fit = fit_plan(trials, alpha, SHAPES, salts, cached, request_seconds, seconds)
    conditions, channels = (2 if salts else 1), 1 + cached

    def pair_cost(shapes: int) -> float:
        return conditions * sum(2 * (s.sends + 1) for s in SHAPES[:shapes]) * request_seconds

    if fit.shapes == 0:  # not even the first shape at the fewest pairs its tests need
        assert plan_trials(1, alpha, conditions, channels) * pair_cost(1) > seconds
        return
    tests = conditions * fit.shapes * channels
    assert fit.seconds <= seconds + 1e-9
    assert smallest_p(fit.pairs) <= alpha / tests  # never a run that could not show a hit
    assert fit.pairs <= fit.planned
    want = plan_trials(trials, alpha, conditions * fit.shapes, channels)
    assert fit.pairs == want or (fit.pairs + 1) * pair_cost(fit.shapes) > seconds  # as many pairs as fit
    if fit.shapes < len(SHAPES):  # one more shape at its fewest pairs would not have fit
        more = fit.shapes + 1
        assert plan_trials(1, alpha, conditions * more, channels) * pair_cost(more) > seconds


# ------------------------------------------------------------------ end to end: a slow server
SLOW: dict[str, Any] = dict(cache=False, report_cached="usage", max_model_len=4096, busy=0.04)


def test_a_slow_server_is_cut_to_the_budget_and_nothing_cut_says_clean(standin) -> None:
    """Every request stays 40 ms in flight: the plan (hundreds of requests, most one at a time) cannot fit
    3 seconds. The run measures the first unit of every phase, says each cut, and no verdict of a cut
    phase is clean: the search stopped short of the context by the budget, the timing unaffordable."""
    cfg = ProbeConfig(max_seconds=3.0)
    url = standin(**SLOW)
    plan = plan_requests(cfg, default_passphrases(), None)
    r = run_probe(url, "toy", default_passphrases(), cfg)
    assert r.requests is not None
    sent = {phase: r.requests.phase(phase).sent for phase in plan}
    assert sum(sent.values()) < sum(plan.values()) / 2, (sent, plan)
    assert {"granularity", "determinism", "bursts", "reuse"} <= set(r.cuts), r.cuts
    assert r.granularity is not None and r.granularity.bound_by == "time"
    assert r.granularity.bound < 4096 - 64
    found = {f.name: f for f in r.findings}
    assert found["cached tokens"].verdict == "inconclusive"
    assert "the time budget" in found["cached tokens"].reason and "--max-seconds" in found["cached tokens"].reason
    assert r.timing is not None and r.timing.cut and found["timing"].verdict == "inconclusive"
    assert "time budget" in r.timing.reason
    assert r.determinism.left_out > 0 and r.bursts.rounds < cfg.rounds
    assert r.verdict != "clean"


def test_the_cli_says_the_bound_and_zero_lifts_it(standin) -> None:
    url = standin(token_ids=True, report_cached="usage", max_model_len=1024)
    small = ["--rounds", "1", "--concurrency", "2", "--determinism-repeats", "1", "--no-reuse", "--no-timing"]
    res = CliRunner().invoke(app, ["probe", "--base-url", url, *small, "--max-seconds", "0"])
    assert "no time bound (--max-seconds 0)" in res.output, res.output
    res = CliRunner().invoke(app, ["probe", "--base-url", url, *small, "--max-seconds", "120", "--json", "-"])
    assert "about 120 s" in res.output
    res = CliRunner().invoke(app, ["probe", "--base-url", url, "--max-seconds", "-1"])
    assert res.exit_code == 2 and "--max-seconds" in res.output
