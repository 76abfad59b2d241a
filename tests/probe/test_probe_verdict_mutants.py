"""The probe's verdict code pinned down where mutation testing found the suite silent (issue 40: the timing's
verdicts, src/kvlab/probe/timing.py, and the contamination criterion's, src/kvlab/probe/compare.py).

These tests were written against the mutants of the two files that survived the selected tests (112) or that no
selected test reached (448: the timing's traffic, its time budget and its report). Each one holds something a
user of ``kvlab probe`` relies on, and says which: a verdict (leak, exposure, clean, inconclusive) and the exact
words of its reason; the boundaries the timing promises (an AUC of exactly ``MIN_AUC`` and a p-value exactly at
alpha/tests reveal a hit, a run whose samples can just reach alpha/tests is powered, a run with an unreported
cached_tokens has no second channel); the Bonferroni threshold; what ``salt_handling`` tells the salts finding;
the power line; the counts the exact rank test is built on; every field of a contamination verdict (the report
prints them all); and, through ``run_timing`` against a fake server without a network (a prefix cache of whole
blocks, one namespace per salt, with hit and miss latencies it returns as numbers: nothing is timed), the
traffic the module docstring describes (who sends what, with which salt and how many tokens, hit or miss drawn
over the run from the seed, the prompts from the nonce) and what the time budget cuts and says.

Three tests are regression tests of defects these tests found, fixed since (each docstring says which).
docs/mutation-survivors.md ("The probe's verdict code") lists the mutants left and why each is equivalent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest
from test_probe_statistics_pinned import P_TOL, timing_run

from kvlab.probe.budget import Allowance
from kvlab.probe.client import Answer
from kvlab.probe.compare import Criterion, Verdict, calibrate, classify, reachable
from kvlab.probe.timing import (
    EXACT_MAX,
    MIN_AUC,
    OWN_KEY,
    SAME_KEY,
    SHAPES,
    Fit,
    TimingReport,
    TimingRun,
    _cut_note,
    auc,
    detectable_auc,
    fit_plan,
    plan_trials,
    rank_sums,
    rank_test,
    required_trials,
    run_timing,
    tied_p,
    timing_plan,
)


# ------------------------------------------------------------------ the contamination criterion (compare.py)
def ids(*xs: int) -> Answer:
    return Answer("", tuple(xs))


def text(s: str) -> Answer:
    return Answer(s, None)


OWN = ids(1, 2, 3, 4, 5, 6, 7)
OTHER = ids(1, 2, 9, 9, 9, 9, 9)  # parts from OWN after 2 tokens
TWIN = ids(1, 2, 9, 9, 9, 9, 9, 0)  # follows OTHER as far as an answer of 7 tokens can tell
PARTIAL = ids(1, 2, 9, 9, 5, 5, 5)  # follows OTHER for 2 tokens past the parting
CRIT = Criterion("tokens", 4, 2, 10, 4)


def test_every_field_of_a_contamination_verdict() -> None:
    """The report prints every field ("prompt 0 follows its own reference for 2 tokens, prompt 1's for 6 ..."):
    how far the answer follows its own reference, the other prompt it follows furthest beyond the references'
    parting, how far it follows that one, and the excess. Same, contaminated and diverged, each whole."""
    refs = [OWN, OTHER]
    assert classify(ids(1, 2, 3, 4, 5, 6, 7), 0, refs, CRIT) == Verdict("same", 7, None, 0, 0)
    assert classify(ids(1, 2, 9, 9, 9, 9, 0), 0, refs, CRIT) == Verdict("contaminated", 2, 1, 6, 4)
    # Two tokens of the other's continuation: below the criterion, reported with what it did follow.
    assert classify(ids(1, 2, 9, 9, 0, 0, 0), 0, refs, CRIT) == Verdict("diverged", 2, 1, 4, 2)
    # An answer that parts from both references before they part from each other: no excess, never negative.
    assert classify(ids(1, 5, 5), 0, refs, CRIT) == Verdict("diverged", 1, 1, 1, 0)


def test_an_answer_cut_short_is_compared_as_far_as_it_goes() -> None:
    """An answer shorter than its reference (an early stop) follows it for its own length; with no other
    reference to follow, the verdict names none and counts nothing."""
    assert classify(ids(1, 2, 3), 0, [OWN], CRIT) == Verdict("diverged", 3, None, 0, 0)


def test_a_reference_equal_to_ours_is_never_named() -> None:
    """A reference equal to the answer's own says nothing about where its tokens came from: it is skipped, so
    the verdict names no other prompt (not the twin with a negative excess)."""
    assert classify(ids(1, 2, 3, 0), 0, [OWN, OWN], CRIT) == Verdict("diverged", 3, None, 0, 0)


def test_the_prompt_named_is_the_first_followed_furthest() -> None:
    """Followed equally far beyond the parting (OTHER and TWIN, 4 tokens each), the first is named; one followed
    less far (PARTIAL, 2) never replaces it, whatever its index."""
    v = classify(ids(1, 2, 9, 9, 9, 9, 0), 0, [OWN, OTHER, TWIN, PARTIAL], CRIT)
    assert v == Verdict("contaminated", 2, 1, 6, 4)


def test_the_calibration_counts_chance_from_zero() -> None:
    """Unrelated references that share nothing: chance matched 0 tokens over 1 pair, so the floor decides;
    references all of one family: no pair to calibrate on. The floor is kept for the statement."""
    assert calibrate([("a", ids(1, 2)), ("b", ids(3, 4))], "tokens") == Criterion("tokens", 4, 0, 1, 4)
    assert calibrate([("a", text("x")), ("a", text("x y"))], "characters") == Criterion("characters", 16, 0, 0, 16)


def test_the_criterion_as_the_report_states_it() -> None:
    """The statement a reader is given, whole: calibrated (the rule of three: no chance match in n pairs puts the
    rate below 3/n at 95%) and uncalibrated (the floor alone)."""
    assert CRIT.statement() == (
        "contaminated = follows another prompt's reference for at least 4 tokens beyond where the two references "
        "part; unrelated references shared at most 2 tokens (longest common prefix over 10 pairs), so chance met "
        "the criterion in none of them (rate < 0.3 at 95%); floor 4 tokens"
    )
    assert Criterion("characters", 16, 0, 0, 16).statement() == (
        "contaminated = follows another prompt's reference for at least 16 characters beyond where the two "
        "references part (the floor: no unrelated references to calibrate on)"
    )


def test_a_group_can_show_contamination_exactly_when_a_reference_runs_min_match_past_another() -> None:
    """``reachable``: an answer can follow reference b past its parting from a by at most len(b) - cp(a, b); a
    group whose references allow exactly ``min_match`` can show contamination, one that allows 1 cannot."""
    assert reachable([ids(1, 2, 3, 4, 5, 6), ids(1, 2, 7, 8, 9, 10)], CRIT)  # 4 past the parting
    assert not reachable([ids(1, 2, 3, 4, 5, 6), ids(1, 2, 3, 4, 5, 7)], CRIT)  # 1 past it


# ------------------------------------------------------------------ the rank test's arithmetic (timing.py)
def test_the_auc_refuses_an_empty_arm_in_its_own_words() -> None:
    for hits, misses in ([], [1.0]), ([1.0], []), ([], []):
        with pytest.raises(ValueError, match=r"^the AUC needs at least one hit and one miss sample$"):
            auc(hits, misses)


def test_rank_sums_counts_the_subsets() -> None:
    """``ways[s]`` is how many k-subsets of the doubled ranks sum to s: counts, as its docstring says (the rank
    test divides them, so only their ratio reaches a verdict; the counts are the function's contract)."""
    assert rank_sums([2, 4, 6, 8], 3) == [0.0] * 12 + [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert rank_sums([2, 5, 5, 8], 1) == [0.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 1.0]


def test_a_tie_across_the_arms_at_half_a_rank_is_counted_exactly() -> None:
    """A millisecond clock, 6 pairs, hits tying misses at 34 and 35 ms (half ranks): p = 43/924 exactly (every
    split counted), so at alpha 0.05 the run reveals the hit."""
    hits, misses = [0.028, 0.030, 0.031, 0.034, 0.035, 0.035], [0.034, 0.034, 0.034, 0.038, 0.039, 0.041]
    assert tied_p(hits, misses) == pytest.approx(43 / 924, rel=P_TOL)
    run = TimingRun(SHAPES[1].name, False, hit_ttft=hits, miss_ttft=misses)
    run.analyse()
    report = TimingReport(6, 400, 0.05, runs=[run], salted_measured=False)
    report.conclude()
    assert report.verdict == "exposure" and run.seen() == "REVEALED by TTFT"


def test_exactly_exact_max_samples_take_the_exact_test() -> None:
    """Up to ``EXACT_MAX`` samples the p-value is exact: 50 hits below 50 misses give 1 / C(100, 50)."""
    hits, misses = [float(i) for i in range(50)], [float(i) for i in range(50, 100)]
    assert len(hits) + len(misses) == EXACT_MAX
    p, smallest = rank_test(hits, misses)
    assert p == pytest.approx(1 / math.comb(100, 50), rel=P_TOL, abs=0) and smallest == p  # asymptotic: 3.5e-18


def test_a_detectable_auc_whose_p_is_exactly_the_threshold_counts() -> None:
    """A p-value at the threshold reaches it (``decide`` reveals at p <= threshold): 5 pairs perfectly apart
    have p = 1/252, so at a threshold of 1/252 an AUC of 1 would show."""
    assert detectable_auc(5, 1 / 252) == 1.0


def test_the_pairs_planned_are_the_fewest_that_reach_alpha_over_the_tests() -> None:
    """``required_trials``: a smallest p exactly at the threshold reaches it (1/C(10, 5) = 1/252: 5 pairs; 1/C(6, 3)
    = 0.05: 3), and one pair can reach 0.5. ``plan_trials`` splits alpha over runs x channels tests (one test:
    alpha itself); ``timing_plan``: one run per shape, twice with salts, its pairs for all their tests."""
    assert required_trials(1 / 252) == 5 and required_trials(0.05) == 3 and required_trials(0.5) == 1
    assert plan_trials(1, 0.05, runs=1, channels=1) == 3
    assert timing_plan(8, 0.01, 3, True, True) == (6, 8)
    assert timing_plan(4, 0.01, 3, True, True) == (6, 7)  # 12 tests: 1/C(14, 7) <= 0.01/12 < 1/C(12, 6)
    assert timing_plan(4, 0.01, 3, False, False) == (3, 6)  # 3 tests
    assert timing_plan(4, 0.01, 1, False, True) == (1, 5)  # 2 tests: 1/252 <= 0.005


def test_a_miss_that_took_no_measurable_time_fits_the_whole_plan() -> None:
    """A pair that costs nothing at the pace measured (a clock too coarse to see the miss): every planned pair
    of every shape fits, whatever the budget left."""
    fit = fit_plan(8, 0.01, SHAPES, True, True, request_seconds=0.0, seconds=1.0)
    assert fit == Fit(shapes=3, pairs=8, planned=8, shapes_planned=3, seconds=0.0) and fit.whole


def test_at_an_alpha_one_pair_can_reach_one_pair_is_the_least() -> None:
    """alpha 0.6 over one test: a single pair (smallest p 1/2) can reach it, so one pair that fits the budget is
    measured, and where not even that fits the note says the least was 1."""
    assert fit_plan(1, 0.6, SHAPES[:1], False, False, request_seconds=1.0, seconds=4.0).pairs == 1
    none = fit_plan(1, 0.6, SHAPES[:1], False, False, request_seconds=1.0, seconds=3.0)
    assert none == Fit(shapes=0, pairs=0, planned=1, shapes_planned=1, seconds=0.0)  # nothing, at no cost
    assert _cut_note(none, 1.0, 3.0, 0.6, 1, 1) == (
        "not measured for the time budget (3 s left for the timing, a miss of its prefix took 1 s): not even one "
        "victim shape's runs at the fewest pairs that can reach alpha (1) fit (--max-seconds raises the budget)"
    )


# ------------------------------------------------------------------ one run's outcome (TimingRun)
def hand_run(**kw: Any) -> TimingRun:
    """A run with its statistics set by hand (8 pairs of samples, for ``seen``)."""
    return TimingRun(SHAPES[0].name, False, hit_ttft=[0.01] * 8, miss_ttft=[0.02] * 8, **kw)


@pytest.mark.parametrize(
    ("stats", "revealed"),
    [
        (dict(auc=MIN_AUC, p_value=0.001, min_p=1e-4), ["TTFT"]),  # the AUC exactly at MIN_AUC
        (dict(auc=0.9, p_value=0.01, min_p=1e-4), ["TTFT"]),  # p exactly at the threshold
        (dict(min_p=1e-4, cached_auc=MIN_AUC, cached_p_value=0.001, cached_min_p=1e-4), ["cached_tokens"]),
        (dict(min_p=1e-4, cached_auc=0.9, cached_p_value=0.01, cached_min_p=1e-4), ["cached_tokens"]),
        (dict(auc=0.7499, p_value=0.001, min_p=1e-4), []),
        (dict(auc=0.9, p_value=0.0101, min_p=1e-4), []),
        (dict(min_p=1e-4, cached_auc=0.9, cached_p_value=None, cached_min_p=1e-4), []),  # no p: nothing shown
    ],
)
def test_the_boundaries_of_a_reveal(stats: dict[str, Any], revealed: list[str]) -> None:
    """ "A run reveals the cache when an AUC is at least MIN_AUC and its p-value is at most alpha/tests": both
    boundaries included, in both channels, and the run then says it was revealed."""
    run = hand_run(**stats)
    run.decide(0.01)
    assert run.revealed_by == revealed
    assert run.detection == ("revealed" if revealed else "not revealed")
    assert run.seen() == (f"REVEALED by {revealed[0]}" if revealed else "not revealed")


def test_a_run_that_can_just_reach_the_threshold_is_powered() -> None:
    """Its smallest reachable p exactly alpha/tests: it could have shown a hit, so it is "not revealed", never
    "not detected at this power"."""
    run = hand_run(auc=0.5, p_value=0.5, min_p=0.01)
    run.decide(0.01)
    assert (run.detection, run.seen()) == ("not revealed", "not revealed")


def test_a_coarse_clock_is_powered_by_its_cached_tokens() -> None:
    """Every TTFT alike but a few (smallest reachable p 0.23), yet cached_tokens that could reach alpha/tests:
    the run could have shown a hit in its second channel, so nothing here is "not detected at this power" and
    the timing is clean."""
    coarse = timing_run(0, False, "coarse_clock_8", "cached_levels_8")
    quiet = timing_run(1, False, "vllm_salted_8", "cached_none_8")
    report = TimingReport(8, 400, 0.01, runs=[coarse, quiet], salted_measured=False)
    report.conclude()
    assert coarse.reachable() == pytest.approx(0.0006993006993006993, rel=P_TOL)
    assert coarse.detection == "not revealed" and report.powered is True
    assert report.verdict == "clean"


def test_a_run_whose_server_left_out_some_cached_tokens_has_no_cached_channel() -> None:
    """One probe of 16 without cached_tokens: the channel is not measured (no AUC, no p, no second test)."""
    run = TimingRun(
        SHAPES[0].name,
        False,
        hit_ttft=[0.01] * 8,
        miss_ttft=[0.05] * 8,
        hit_cached=[128] * 7 + [None],
        miss_cached=[0] * 8,
    )
    run.analyse()
    assert (run.cached_auc, run.cached_p_value, run.cached_min_p) == (None, None, None)
    report = TimingReport(8, 400, 0.01, runs=[run], salted_measured=False)
    report.conclude()
    assert (report.tests, report.threshold) == (1, 0.01)


def test_a_miss_that_found_a_block_counts_against_the_hits() -> None:
    """cached_tokens as the server reports them (more cached = the hit): one miss that found a 128-token block
    lowers the AUC and raises the p-value, as recorded in test_probe_statistics_pinned."""
    run = timing_run(0, False, "coarse_ms_8", "cached_levels_8")
    assert run.miss_cached == [0] * 7 + [128]
    assert run.cached_auc == pytest.approx(0.859375)
    assert run.cached_p_value == pytest.approx(0.0034965034965034965, rel=P_TOL)
    assert run.cached_min_p == pytest.approx(0.0006993006993006993, rel=P_TOL)


# ------------------------------------------------------------------ the timing's verdict (TimingReport)
def report_of(runs: list[TimingRun], trials: int = 8, salted: bool = True, **kw: Any) -> TimingReport:
    report = TimingReport(trials, 400, 0.01, runs=runs, salted_measured=salted, **kw)
    report.conclude()
    return report


def test_no_run_measured_is_inconclusive_and_says_why() -> None:
    report = report_of([])
    assert (report.verdict, report.reason) == ("inconclusive", "no timing run was measured")
    assert (report.tests, report.threshold) == (0, 0.01)  # alpha over max(tests, 1)
    cut = report_of([], cut="not measured for the time budget (...)")
    assert (cut.verdict, cut.reason) == ("inconclusive", "not measured for the time budget (...)")


def test_a_leak_across_tenants() -> None:
    """A hit visible across distinct salts with the victim on its own API key: a leak, across tenants, and the
    salts finding is told the salts are ignored."""
    runs = [timing_run(0, False, "vllm_hit_8"), timing_run(0, True, "vllm_hit_8")]
    report = report_of(runs, victim=OWN_KEY)
    assert (report.verdict, report.reason) == (
        "leak",
        "a cache hit is visible across distinct salts (the victim on its own API key: across tenants): 1-token "
        "victim, sent once (TTFT AUC 1.00, p 7.8e-05)",
    )
    assert report.salt_handling() == "ignored" and report.powered is True


EXPOSURE_UNPOWERED_SALTS = (
    "a cache hit is visible to clients without salts: revealed by 1-token victim, sent once (TTFT AUC 1.00, p "
    "7.8e-05); not revealed by: 4-token victim, sent once, 4-token victim, sent twice; not detected at this power "
    "(n=8, smallest reachable p=0.23 > alpha/tests=0.0017; ties in the samples): distinct salts, 1-token victim, "
    "sent once, distinct salts, 4-token victim, sent once"
)


def test_an_exposure_names_what_did_not_show_and_the_salted_runs_that_could_not() -> None:
    """Without salts one shape reveals the cache, two do not; with salts two runs' samples are too tied to reach
    alpha/tests. The reason names both, and the salts are neither honoured nor ignored: their runs could not
    have shown a hit."""
    plain = [
        timing_run(0, False, "vllm_hit_8"),
        timing_run(1, False, "vllm_salted_8"),
        timing_run(2, False, "noise_10"),
    ]
    salted = [
        timing_run(0, True, "coarse_clock_8"),
        timing_run(1, True, "coarse_clock_8"),
        timing_run(2, True, "vllm_salted_8"),
    ]
    report = report_of(plain + salted)
    assert (report.verdict, report.reason) == ("exposure", EXPOSURE_UNPOWERED_SALTS)
    assert (report.tests, report.threshold) == (6, 0.01 / 6)
    assert report.salt_handling() is None and report.powered is False


def test_an_unpowered_timing_names_every_run_that_could_not_reach_alpha() -> None:
    """Nothing revealed and three runs too tied to have shown anything: inconclusive, the worst of their
    smallest reachable p-values given, every such run named (salted ones as such)."""
    alike = TimingRun(SHAPES[1].name, True, hit_ttft=[0.015] * 8, miss_ttft=[0.015] * 8)
    alike.analyse()
    runs = [timing_run(0, False, "coarse_clock_8"), timing_run(1, True, "coarse_clock_8"), alike]
    report = report_of(runs)
    assert (report.verdict, report.reason) == (
        "inconclusive",
        "not detected at this power (n=8, smallest reachable p=1 > alpha/tests=0.0033; ties in the samples): "
        "1-token victim, sent once, distinct salts, 4-token victim, sent once, distinct salts, 4-token victim, "
        "sent once",
    )
    assert report.powered is False and report.salt_handling() is None


def test_a_blind_timing_names_its_best_shape() -> None:
    """No hit found up to the granularity search's bound, nothing revealed: inconclusive, with the bound's words
    and the run of the highest AUC (here the second)."""
    runs = [timing_run(0, False, "noise_10"), timing_run(1, False, "vllm_salted_8")]
    report = report_of(runs, salted=False, blind="no cache hit found up to 2048 tokens")
    assert (report.verdict, report.reason) == (
        "inconclusive",
        "no cache hit found up to 2048 tokens; no victim shape revealed one either (best: 4-token victim, sent "
        "once, median TTFT hit 853.2 ms, miss 872.7 ms, AUC 0.70 (p 0.097))",
    )


def test_clean_across_tenants_at_a_power_that_could_have_shown_a_hit() -> None:
    runs = [timing_run(0, False, "vllm_salted_8"), timing_run(0, True, "noise_10")]
    report = report_of(runs, victim=OWN_KEY)
    assert (report.verdict, report.reason) == (
        "clean",
        "no cache hit visible with any victim shape (the victim on its own API key: across tenants) at this power "
        "(n=8 pairs per run, smallest reachable p=7.8e-05 <= alpha/tests=0.01/2=0.005; an AUC >= 0.89 would show; "
        "best: 1-token victim, sent once, median TTFT hit 853.2 ms, miss 872.7 ms, AUC 0.70 (p 0.097)): no "
        "sharing, or hits below this machine's timing noise",
    )
    assert report.powered is True
    assert report.salt_handling() is None  # the cache never showed: nothing to say of the salts


def test_the_power_line() -> None:
    """Raised from the pairs asked for, or cut for the time budget; the smallest AUC that would show only where
    one would."""
    runs = [timing_run(0, False, "vllm_salted_8")]
    raised = report_of(runs, salted=False, trials_requested=4)
    assert raised.power() == (
        "n=8 pairs per run (raised from 4), smallest reachable p=7.8e-05 <= alpha/tests=0.01/1=0.01; an AUC >= "
        "0.86 would show"
    )
    cut = report_of(runs, salted=False, trials_requested=12)
    assert cut.power().startswith("n=8 pairs per run (cut from 12 for the time budget), smallest reachable p=")
    few = report_of(runs, trials=4, salted=False)
    assert few.detectable_auc is None and few.power().endswith("alpha/tests=0.01/1=0.01")


# ------------------------------------------------------------------ the timing's traffic (run_timing, Sampler)
HIT, MISS = 0.010, 0.050  # seconds the fake answers a 1-token request in, with something cached or not
BLOCK = 16  # characters a cache block of the fake holds


@dataclass(frozen=True)
class Sent:
    key: str  # the API key's owner: "probe" or "victim"
    prompt: str
    max_tokens: int
    salt: str | None
    cached: int  # characters found cached (whole blocks)
    seconds: float


class FakeServer:
    """A prefix cache of whole ``BLOCK``-character blocks, one namespace per salt where it honours them (and,
    with ``per_key``, per API key), every request's prompt entered; a request answers in ``HIT`` seconds if
    anything was cached, ``MISS`` otherwise, plus a jitter of a tenth of a microsecond per request (no two alike: a real
    clock ties nothing), and reports its cached characters as cached_tokens unless ``report`` is off."""

    def __init__(self, honour_salts: bool = True, per_key: bool = False, report: bool = True) -> None:
        self.honour_salts, self.per_key, self.report = honour_salts, per_key, report
        self.blocks: dict[tuple[str, str | None], set[str]] = defaultdict(set)
        self.log: list[Sent] = []

    def client(self, key: str = "probe") -> FakeClient:
        return FakeClient(self, key)


class FakeClient:
    def __init__(self, server: FakeServer, key: str) -> None:
        self.server, self.key = server, key

    def completion(self, prompt: str, max_tokens: int, salt: str | None = None) -> tuple[dict[str, Any], float]:
        s = self.server
        space = s.blocks[(self.key if s.per_key else "", salt if s.honour_salts else None)]
        heads = [prompt[:end] for end in range(BLOCK, len(prompt) + 1, BLOCK)]
        cached = max((len(h) for h in heads if h in space), default=0)
        space.update(heads)
        seconds = (HIT if cached else MISS) + 1e-7 * (len(s.log) + 1)
        s.log.append(Sent(self.key, prompt, max_tokens, salt, cached, seconds))
        return ({"usage": {"prompt_tokens_details": {"cached_tokens": cached}}} if s.report else {}), seconds


SHAPE = {s.name: s for s in SHAPES}


def samples(log: list[Sent], runs: list[TimingRun]) -> list[tuple[TimingRun, list[Sent], Sent]]:
    """The log cut into samples, run by run: (the run, the victim's requests, the attacker's probe)."""
    out, i = [], 0
    for run in runs:
        sends = SHAPE[run.shape].sends
        for _ in range(len(run.hit_ttft) + len(run.miss_ttft)):
            out.append((run, log[i : i + sends], log[i + sends]))
            i += sends + 1
    assert i == len(log)
    return out


def is_hit(probe: Sent) -> bool:
    """A hit's probe starts with the victim's prefix ("v"), a miss's with a fresh one ("m")."""
    return probe.prompt[0] == "v"


EXPOSURE_ALL_SHAPES = "a cache hit is visible to clients without salts: revealed by " + "; ".join(
    f"{s.name} (TTFT AUC 1.00, p 7.8e-05; cached_tokens AUC 1.00, p 7.8e-05)" for s in SHAPES
)


def test_the_timing_traffic_is_what_the_module_says() -> None:
    """Defaults (8 pairs, 400-character prefixes, every shape, without and then with distinct salts, one API
    key). A warm-up probe first; then each sample: the victim sends a fresh "v" prefix plus a suffix (as many
    times and with as many tokens as its shape says, under its own salt in a salted run), then the attacker a
    1-token probe under its own salt: the victim's prefix with another suffix (a hit) or a fresh "m" prefix
    (a miss: nothing cached). Salts are never reused across samples. Each run's hits and misses are the probes'
    latencies and cached counts, arm by arm; the progress is told once a pair. On a server that honours salts:
    exposure, the salts honoured."""
    server, ticks = FakeServer(), []
    report = run_timing(server.client(), nonce="n1", on_trial=lambda: ticks.append(1))
    assert [(r.shape, r.salted) for r in report.runs] == [(s.name, salted) for salted in (False, True) for s in SHAPES]
    assert len(ticks) == 6 * 8
    warm, log = server.log[0], server.log[1:]
    assert (warm.key, warm.prompt[0], warm.max_tokens, warm.salt) == ("probe", "w", 1, None)
    salts_seen: list[str] = []
    for run, victims, probe in samples(log, report.runs):
        shape = SHAPE[run.shape]
        assert {(v.key, v.prompt, v.max_tokens, v.salt) for v in victims} == {
            ("probe", victims[0].prompt, shape.max_tokens, victims[0].salt)
        }
        prefix = victims[0].prompt[:400]
        assert prefix[0] == "v" and victims[0].prompt != prefix
        assert (probe.key, probe.max_tokens) == ("probe", 1)
        if run.salted:
            assert victims[0].salt.startswith("victim-") and probe.salt.startswith("attacker-")
            salts_seen += [victims[0].salt, probe.salt]
        else:
            assert victims[0].salt is None and probe.salt is None
        if is_hit(probe):
            assert probe.prompt.startswith(prefix) and probe.prompt != victims[0].prompt
            assert probe.cached == (0 if run.salted else 400)
        else:
            assert probe.prompt[0] == "m" and probe.cached == 0
    # The hit's probe and the miss's are alike in length: the TTFT differs only by what was cached.
    assert {len(probe.prompt) for _, _, probe in samples(log, report.runs)} == {402}
    assert len(set(salts_seen)) == len(salts_seen) == 3 * 16 * 2
    for run in report.runs:
        mine = [(victims, probe) for r, victims, probe in samples(log, report.runs) if r is run]
        hits = [p for _, p in mine if is_hit(p)]
        misses = [p for _, p in mine if not is_hit(p)]
        assert (run.hit_ttft, run.hit_cached) == ([p.seconds for p in hits], [p.cached for p in hits])
        assert (run.miss_ttft, run.miss_cached) == ([p.seconds for p in misses], [p.cached for p in misses])
        assert len(hits) == len(misses) == 8
    assert (report.verdict, report.reason) == ("exposure", EXPOSURE_ALL_SHAPES)
    assert report.salt_handling() == "honoured"
    assert (report.trials, report.trials_requested, report.prefix_chars, report.alpha) == (8, 8, 400, 0.01)
    assert (report.victim, report.salted_measured, report.not_salted_because) == (SAME_KEY, True, "")
    assert (report.blind, report.granularity, report.prefix_tokens, report.cut, report.notes) == ("", "", None, "", [])


def test_a_server_that_ignores_salts_leaks() -> None:
    server = FakeServer(honour_salts=False)
    report = run_timing(server.client(), nonce="n1", shapes=SHAPES[1:2])
    assert [r.revealed_by for r in report.runs] == [["TTFT", "cached_tokens"]] * 2
    assert report.verdict == "leak" and report.salt_handling() == "ignored"


CLEAN_ACROSS_TENANTS = (
    "no cache hit visible with any victim shape (the victim on its own API key: across tenants) at this power (n=8 "
    "pairs per run, smallest reachable p=7.8e-05 <= alpha/tests=0.01/4=0.0025; an AUC >= 0.91 would show; best: "
    "4-token victim, sent once, median TTFT hit 50.0 ms, miss 50.0 ms, AUC 0.64 (p 0.19); cached_tokens AUC 0.50): "
    "no sharing, or hits below this machine's timing noise"
)


RENDER_ACROSS_TENANTS = """\
timing: 8 hit/miss pairs per run, 400-character prefixes; victim: its own API key (--victim-api-key): another tenant
  power: n=8 pairs per run, smallest reachable p=7.8e-05 <= alpha/tests=0.01/4=0.0025; an AUC >= 0.91 would show
  no salts       4-token victim, sent once    median TTFT hit 50.0 ms, miss 50.0 ms, AUC 0.61 (p 0.25); \
cached_tokens AUC 0.50: not revealed
  distinct salts 4-token victim, sent once    median TTFT hit 50.0 ms, miss 50.0 ms, AUC 0.64 (p 0.19); \
cached_tokens AUC 0.50: not revealed"""


def test_the_victim_on_its_own_key_sends_through_its_own_client() -> None:
    """``victim``: the victim's warm-up and every victim request go through its client (its API key), the probes
    through the attacker's. A cache per key shows the attacker nothing: clean, across tenants."""
    server = FakeServer(per_key=True)
    report = run_timing(server.client(), nonce="n1", shapes=SHAPES[1:2], victim=server.client("victim"))
    warm = server.log[1]
    assert (warm.key, warm.prompt[0], warm.max_tokens, warm.salt) == ("victim", "w", 1, None)
    for _, victims, probe in samples(server.log[2:], report.runs):
        assert [v.key for v in victims] == ["victim"] and probe.key == "probe"
    assert report.victim == OWN_KEY
    assert (report.verdict, report.reason) == ("clean", CLEAN_ACROSS_TENANTS)
    assert report.render() == RENDER_ACROSS_TENANTS


def arms(log: list[Sent]) -> str:
    return "".join(s.prompt[0] for s in log if s.max_tokens == 1)


def test_the_seed_draws_the_arms_and_the_nonce_the_prompts() -> None:
    """The same nonce and seed send the same requests (seed 0 by default); another seed draws other arms; another
    nonce shares no prompt and no salt with this run, nor the start of any prompt (its kind and sub-nonce: a
    re-run never meets the last run's entries)."""
    logs = []
    for nonce, seed in (("n1", None), ("n1", 0), ("n1", 1), ("n2", 0)):
        server = FakeServer()
        kw = {} if seed is None else {"seed": seed}
        run_timing(server.client(), nonce=nonce, trials=6, shapes=SHAPES[:1], **kw)
        logs.append(server.log)
    default, zero, one, other = logs
    assert [(s.prompt, s.salt) for s in default] == [(s.prompt, s.salt) for s in zero]
    assert arms(one) != arms(zero)
    assert not {s.prompt for s in other} & {s.prompt for s in zero}
    assert not {s.salt for s in other} & {s.salt for s in zero} - {None}
    assert not {s.prompt[:14] for s in other} & {s.prompt[:14] for s in zero}


RENDER_RAISED = """\
timing: 5 hit/miss pairs per run, 400-character prefixes (~100 tokens); victim: the probe's own API key (one tenant)
  power: n=5 pairs per run (raised from 4), smallest reachable p=0.004 <= alpha/tests=0.01/1=0.01; an AUC >= 0.96 \
would show
  cache granularity: 128-token blocks
  no salts       1-token victim, sent once    median TTFT hit 10.0 ms, miss 50.0 ms, AUC 1.00 (p 0.004): \
REVEALED by TTFT
  distinct salts: not measured (the server rejects cache_salt)
  note: raised from 4 to 5 hit/miss pairs per run: with 4 the smallest reachable p (1/C(8,4) = 0.014) is above \
alpha/tests = 0.01/1 = 0.01, so no hit could ever have shown"""


def test_too_few_pairs_are_raised_and_the_report_says_so() -> None:
    """4 pairs cannot reach alpha (1/C(8, 4) = 0.014 > 0.01): raised to 5, and the note, the power line and
    the run's line say it; the granularity found and the salts not measured are in the report as given."""
    server = FakeServer(report=False)
    report = run_timing(
        server.client(),
        nonce="n2",
        trials=4,
        shapes=SHAPES[:1],
        salts=False,
        cached_tokens=False,
        not_salted_because="the server rejects cache_salt",
        granularity="128-token blocks",
        prefix_tokens=100,
    )
    assert (report.trials, report.trials_requested) == (5, 4)
    assert report.render() == RENDER_RAISED
    assert report.verdict == "exposure"


def test_the_note_counts_every_test_the_pairs_were_raised_for() -> None:
    """4 pairs asked for, 3 shapes, with salts, cached_tokens reported: 12 tests, so 7 pairs, and the note's
    arithmetic is over those 12."""
    report = run_timing(FakeServer().client(), nonce="n6", trials=4)
    assert report.trials == 7 and report.notes == [
        "raised from 4 to 7 hit/miss pairs per run: with 4 the smallest reachable p (1/C(8,4) = 0.014) is above "
        "alpha/tests = 0.01/12 = 0.00083, so no hit could ever have shown"
    ]


def test_exactly_enough_pairs_are_not_raised() -> None:
    report = run_timing(
        FakeServer().client(), nonce="n2", trials=5, shapes=SHAPES[:1], salts=False, cached_tokens=False
    )
    assert (report.trials, report.notes) == (5, [])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


CUT = (
    "cut for the time budget (5 s left for the timing, a miss of its prefix took 0.05 s): 6 of 8 pairs per run, 2 "
    "of 3 victim shapes; an AUC >= 1.00 would show where the plan's would show 0.95 (--max-seconds raises the "
    "budget)"
)


def test_a_timing_cut_for_the_time_budget_says_what_it_cost() -> None:
    """5 s left and a miss taking 0.05 s: the whole plan (8 pairs, 3 shapes, 2 conditions) does not fit; 6 pairs
    of the first 2 shapes do (the fewest their 8 tests can reach alpha with). The report measures that, says the
    cut (and the power it cost) and the power line says the pairs were cut."""
    clock = FakeClock()
    server = FakeServer()
    report = run_timing(server.client(), nonce="n3", allowance=Allowance("timing", clock.now + 5.0, clock))
    assert (server.log[1].prompt[0], server.log[1].max_tokens, server.log[1].salt) == ("m", 1, None)  # the pace
    assert report.cut == CUT
    assert (report.trials, report.trials_requested, report.tests) == (6, 8, 8)
    assert [(r.shape, r.salted) for r in report.runs] == [(s.name, c) for c in (False, True) for s in SHAPES[:2]]
    assert report.power().startswith("n=6 pairs per run (cut from 8 for the time budget), smallest reachable p=")
    assert report.verdict == "exposure"


NOT_MEASURED = (
    "not measured for the time budget (0 s left for the timing, a miss of its prefix took 0.05 s): not even one "
    "victim shape's runs at the fewest pairs that can reach alpha (6) fit (--max-seconds raises the budget)"
)


def test_a_timing_that_cannot_afford_the_pairs_alpha_needs_is_not_measured() -> None:
    """The budget already overrun: no run is measured (only the warm-up and the miss that sets the pace are
    sent), the verdict is inconclusive, never clean, and the reason is the cut."""
    clock = FakeClock()
    server = FakeServer()
    report = run_timing(server.client(), nonce="n4", allowance=Allowance("timing", clock.now - 1.0, clock))
    assert len(server.log) == 2 and report.runs == []
    assert (report.verdict, report.reason, report.cut) == ("inconclusive", NOT_MEASURED, NOT_MEASURED)
    assert report.render() == f"timing: 400-character prefixes: {NOT_MEASURED}"


def test_a_budget_the_whole_plan_fits_cuts_nothing() -> None:
    clock = FakeClock()
    report = run_timing(
        FakeServer().client(), nonce="n5", shapes=SHAPES[:1], allowance=Allowance("timing", clock.now + 100.0, clock)
    )
    assert (report.cut, report.trials, len(report.runs)) == ("", 8, 2)


# ------------------------------------------------------------------ defects found, left for a fix
def test_a_cached_tokens_p_value_that_underflows_to_zero_still_reveals() -> None:
    """Past ``EXACT_MAX`` the p-value is scipy's normal approximation, which underflows to 0.0 from about 730
    pairs of a perfect cached_tokens channel; ``decide`` reads it as ``(self.cached_p_value or 1)``, so the
    strongest evidence counts as none: the run is "not revealed" and, with TTFT at chance, the timing says clean
    (--timing-trials 800 on a server that reports every hit). Fixed: ``is not None`` instead of ``or``."""
    n = 800
    run = TimingRun(
        SHAPES[0].name,
        False,
        hit_ttft=[0.5 + i * 1e-6 for i in range(n)],
        miss_ttft=[0.5 + i * 1e-6 + 1e-7 for i in range(n)],
        hit_cached=[128] * n,
        miss_cached=[0] * n,
    )
    run.analyse()
    assert run.cached_auc == 1.0 and run.cached_p_value == 0.0
    report = TimingReport(n, 400, 0.01, runs=[run], salted_measured=False)
    report.conclude()
    assert run.revealed_by == ["cached_tokens"] and report.verdict == "exposure"


def test_the_power_line_never_says_a_smallest_p_above_the_threshold_is_below_it() -> None:
    """``power()`` prints "smallest reachable p=X <= alpha/tests=Y" whatever X and Y: with pairs too few for the
    tests counted (e.g. the capability check missed cached_tokens, so the plan counted half the tests, with
    --timing-trials 6 or fewer) the rendered power line says "0.0011 <= ...=0.00083". The verdict itself is
    right (inconclusive); the line was false. Fixed: ">" where it is above."""
    few = report_of([timing_run(0, False, "vllm_salted_8")], trials=4, salted=False)
    assert "smallest reachable p=0.014 > alpha/tests=0.01/1=0.01" in few.power()


def test_a_tiny_alpha_past_the_exact_test_does_not_crash() -> None:
    """``ProbeConfig`` accepts any 0 < alpha < 1; below about 1e-16 per test ``1 - threshold`` rounds to 1.0 and
    ``detectable_auc``'s normal approximation (more than 50 pairs) raises StatisticsError from ``conclude``:
    ``--alpha 1e-16 --timing-trials 60`` ends the probe instead of reporting. (Its ``None`` branch, an AUC above 1,
    is unreachable for any threshold that does not raise.) Fixed: ``-inv_cdf(threshold)``, exact for any threshold."""
    assert detectable_auc(60, 1e-17) == pytest.approx(0.9497, abs=1e-4)
    assert detectable_auc(60, 1e-30) is None  # past every AUC 60 pairs can show: none reaches it
