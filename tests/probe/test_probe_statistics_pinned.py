"""The probe's verdicts on recorded samples, pinned before its statistics moved to ``scipy.stats`` (issue 38:
"statistics an auditor trusts"): no verdict may change silently.

Every number below is what the probe's hand-written statistics gave on these samples (recorded on the commit
before the move): the AUCs, the rank test's p-values and the smallest p-value each sample could give, the
smallest detectable AUC, Fisher's one-sided tail, the binomial tail of membership and the sign test of reuse;
and the verdicts and reasons the findings draw from them, as strings. p-values are held to a relative 1e-9 (the
hand-written sums and scipy's distributions differ in the last bits), AUCs to 1e-12, verdicts and reasons
exactly. docs/probe.md ("Which test backs each verdict") names the test behind each.

The TTFT samples are shaped on the probe's measurements in docs/probe.md (seconds, four decimals: vLLM's CPU
build with prefix caching, hits ~0.3 s against misses ~0.86 s; transformers' continuous batching, 0.50 s against
1.36 s; a server with nothing to find, both arms alike) at the sizes the probe plans (6, 8, 10 and 12 pairs;
60 pairs: past the exact test's ``EXACT_MAX`` samples, where the normal approximation decides). The
cached-token samples are negated as ``TimingRun.analyse`` negates them (more cached = smaller = hit) and are
all ties: whole blocks, or nothing.
"""

from __future__ import annotations

import pytest
from test_extract_fakes import TokenCache, run

from kvlab.probe.attacks.membership import binomial_tail
from kvlab.probe.bursts import BurstResult
from kvlab.probe.compare import Criterion, fisher_greater
from kvlab.probe.determinism import Determinism
from kvlab.probe.report import contamination_finding, reuse_finding
from kvlab.probe.reuse import ReuseResult, ReuseTrial
from kvlab.probe.timing import (
    EXACT_MAX,
    MIN_AUC,
    NOT_POWERED,
    SHAPES,
    TimingReport,
    TimingRun,
    auc,
    detectable_auc,
    rank_test,
    tied_p,
)

P_TOL = 1e-9  # relative, on p-values
AUC_TOL = 1e-12

# name: (hits, misses)
SAMPLES: dict[str, tuple[list[float], list[float]]] = {
    # vLLM, prefix caching on, no salts: every hit well below every miss.
    "vllm_hit_8": (
        [0.2897, 0.2856, 0.3082, 0.299, 0.3006, 0.2825, 0.2957, 0.2985],
        [0.8379, 0.8927, 0.8214, 0.9307, 0.7336, 0.8816, 0.8292, 0.8423],
    ),
    # The same server under distinct salts (honoured): both arms are misses.
    "vllm_salted_8": (
        [0.8135, 0.8201, 0.8987, 0.9073, 0.9083, 0.8636, 0.7859, 0.8427],
        [0.9268, 0.8426, 0.9161, 0.8687, 0.8599, 0.9429, 0.8767, 0.8468],
    ),
    # transformers serve --continuous-batching: a 4-token victim's prefix is cached, a 1-token victim's is not.
    "hf_4tok_6": ([0.5045, 0.467, 0.518, 0.5401, 0.4713, 0.5161], [1.3526, 1.445, 1.3422, 1.3155, 1.3187, 1.4024]),
    "hf_1tok_6": ([1.3719, 1.3201, 1.3787, 1.3607, 1.4321, 1.3135], [1.4706, 1.2827, 1.3509, 1.3235, 1.339, 1.2423]),
    # A small step under noise (12 pairs).
    "weak_12": (
        [0.8586, 0.7491, 0.7254, 0.9064, 0.8424, 0.7986, 0.8394, 0.8514, 0.7805, 0.7702, 0.7355, 0.7615],
        [0.8702, 0.828, 0.9061, 0.916, 0.8611, 0.7802, 0.858, 0.8131, 0.9498, 0.8788, 0.8515, 0.8487],
    ),
    # Nothing to find (10 pairs); the hits happen to be the slower arm.
    "noise_10": (
        [0.4664, 0.4398, 0.3829, 0.3704, 0.3963, 0.4519, 0.4419, 0.4055, 0.4009, 0.4146],
        [0.2824, 0.3816, 0.4678, 0.4361, 0.3691, 0.3731, 0.3466, 0.3325, 0.3968, 0.4512],
    ),
    # A clock too coarse to tell the arms apart: 14 of 16 samples alike.
    "coarse_clock_8": ([0.015] * 8, [0.015] * 6 + [0.016] * 2),
    # A millisecond clock: a hit ties two misses.
    "coarse_ms_8": (
        [0.031, 0.030, 0.031, 0.033, 0.035, 0.030, 0.041, 0.033],
        [0.041, 0.044, 0.041, 0.052, 0.039, 0.047, 0.045, 0.043],
    ),
    # cached_tokens, negated: every hit found a 128-token block, no miss did.
    "cached_all_8": ([-128.0] * 8, [0.0] * 8),
    # Five of eight hits found it (a victim shape the cache admits only sometimes).
    "cached_5_of_8": ([-128.0] * 5 + [0.0] * 3, [0.0] * 8),
    # Several block counts, and one miss that found a block.
    "cached_levels_8": ([-384.0] * 4 + [-256.0] * 2 + [0.0] * 2, [0.0] * 7 + [-128.0]),
    # A server that never reports a hit: nothing can be shown.
    "cached_none_8": ([0.0] * 8, [0.0] * 8),
    # A hit ties a miss at half a rank.
    "half_tie_4": ([1.0, 2.0, 3.0, 3.0], [3.0, 4.0, 5.0, 6.0]),
    # 60 pairs at a millisecond (ties within and across the arms): the normal approximation.
    "long_60": (
        [0.812, 0.914, 0.829, 0.948, 0.787, 0.851, 0.925, 0.776, 0.896, 0.771, 0.864, 0.895, 0.847, 0.946, 0.946]
        + [0.846, 0.866, 0.884, 0.778, 0.775, 0.764, 0.834, 0.771, 0.797, 0.88, 0.872, 0.917, 0.85, 0.828, 0.883]
        + [0.818, 0.981, 0.93, 0.933, 0.873, 0.817, 0.859, 0.805, 0.821, 0.816, 0.811, 0.904, 0.76, 0.919, 0.831]
        + [0.828, 0.815, 0.831, 0.867, 0.893, 0.81, 0.91, 0.944, 0.829, 0.73, 0.808, 0.887, 0.923, 0.981, 0.815],
        [0.78, 0.855, 0.812, 0.903, 0.892, 0.858, 0.886, 0.826, 0.789, 0.834, 0.926, 0.88, 1.003, 0.874, 0.933]
        + [0.83, 0.872, 0.764, 0.866, 0.882, 0.816, 0.904, 0.77, 0.864, 0.865, 0.783, 0.914, 0.861, 0.773, 0.769]
        + [0.956, 0.869, 0.806, 0.868, 0.894, 0.824, 0.869, 0.936, 0.838, 0.831, 0.813, 0.854, 0.863, 0.839, 0.899]
        + [0.803, 0.875, 0.91, 0.848, 0.788, 0.885, 0.882, 0.927, 0.892, 0.85, 0.834, 0.9, 0.795, 0.883, 0.822],
    ),
    # 60 pairs of cached_tokens: a third of the hits found a block, a few misses did too.
    "cached_long_60": ([-128.0] * 20 + [0.0] * 40, [0.0] * 56 + [-128.0] * 4),
}

# name: (AUC, the rank test's p, the smallest p these samples could give), as recorded.
PINNED: dict[str, tuple[float, float, float]] = {
    "vllm_hit_8": (1.0, 7.77000777000777e-05, 7.77000777000777e-05),  # 1 / C(16, 8)
    "vllm_salted_8": (0.703125, 0.09743589743589744, 7.77000777000777e-05),
    "hf_4tok_6": (1.0, 0.0010822510822510823, 0.0010822510822510823),  # 1 / C(12, 6)
    "hf_1tok_6": (0.3333333333333333, 0.8452380952380952, 0.0010822510822510823),
    "weak_12": (0.8055555555555556, 0.005022269425284636, 3.698011505253395e-07),
    "noise_10": (0.29, 0.9474387841260906, 5.412544112234515e-06),
    "coarse_clock_8": (0.625, 0.23333333333333334, 0.23333333333333334),  # C(14, 6) / C(16, 8)
    "coarse_ms_8": (0.96875, 0.0003108003108003108, 7.77000777000777e-05),
    "cached_all_8": (1.0, 7.77000777000777e-05, 7.77000777000777e-05),
    "cached_5_of_8": (0.8125, 0.01282051282051282, 0.01282051282051282),  # C(8, 5) / C(16, 5)
    "cached_levels_8": (0.859375, 0.0034965034965034965, 0.0006993006993006993),
    "cached_none_8": (0.5, 1.0, 1.0),
    "half_tie_4": (0.9375, 0.04285714285714286, 0.04285714285714286),
    "long_60": (0.5176388888888889, 0.3704425503055403, 1.7699507540270814e-21),
    "cached_long_60": (0.6333333333333333, 0.00014037169748814428, 2.5104556135187315e-08),
}


def test_every_sample_is_pinned_and_the_long_ones_are_past_the_exact_test() -> None:
    assert set(PINNED) == set(SAMPLES)
    assert all(len(h) + len(m) > EXACT_MAX for h, m in (SAMPLES["long_60"], SAMPLES["cached_long_60"]))


@pytest.mark.parametrize("name", list(SAMPLES))
def test_the_auc_and_the_rank_test_on_recorded_samples(name: str) -> None:
    hits, misses = SAMPLES[name]
    want_auc, want_p, want_min = PINNED[name]
    assert auc(hits, misses) == pytest.approx(want_auc, rel=AUC_TOL, abs=AUC_TOL)
    p, smallest = rank_test(hits, misses)
    assert p == pytest.approx(want_p, rel=P_TOL) and smallest == pytest.approx(want_min, rel=P_TOL)


@pytest.mark.parametrize(
    ("pairs", "threshold", "want"),
    [
        (4, 0.01, None),
        (5, 0.005, 1.0),
        (5, 0.01, 0.96),
        (6, 0.01 / 3, 0.9722222222222222),
        (7, 0.01 / 12, 0.9795918367346939),
        (8, 0.01 / 12, 0.953125),  # the default plan: "an AUC >= 0.95 would show"
        (8, 0.01 / 6, 0.921875),
        (10, 0.01, 0.81),
        (12, 0.01 / 12, 0.8680555555555556),
        (30, 0.01 / 12, 0.7333333333333333),
        (50, 0.01 / 12, 0.6808),
        (60, 0.01 / 12, 0.6666666666666666),  # the normal approximation
    ],
)
def test_the_detectable_auc(pairs: int, threshold: float, want: float | None) -> None:
    got = detectable_auc(pairs, threshold)
    assert got == want if want is None else got == pytest.approx(want, rel=AUC_TOL)


def timing_run(shape: int, salted: bool, ttft: str, cached: str | None = None) -> TimingRun:
    hits, misses = SAMPLES[ttft]
    r = TimingRun(SHAPES[shape].name, salted, hit_ttft=list(hits), miss_ttft=list(misses))
    if cached is not None:
        neg_hits, neg_misses = SAMPLES[cached]
        r.hit_cached, r.miss_cached = [int(-c) for c in neg_hits], [int(-c) for c in neg_misses]
    r.analyse()
    return r


@pytest.mark.parametrize(
    ("ttft", "cached", "threshold", "seen"),
    [
        ("vllm_hit_8", "cached_all_8", 0.01 / 12, "REVEALED by TTFT, cached_tokens"),
        ("vllm_hit_8", "cached_5_of_8", 0.01 / 12, "REVEALED by TTFT"),
        ("vllm_salted_8", "cached_none_8", 0.01 / 12, "not revealed"),
        ("coarse_ms_8", "cached_levels_8", 0.01 / 12, "REVEALED by TTFT"),
        ("coarse_ms_8", "cached_levels_8", 0.01, "REVEALED by TTFT, cached_tokens"),
        ("coarse_clock_8", "cached_none_8", 0.01, f"{NOT_POWERED} (n=8, smallest reachable p=0.23)"),
        ("weak_12", None, 0.01, "REVEALED by TTFT"),
        ("weak_12", None, 0.01 / 12, "not revealed"),
        ("hf_4tok_6", None, 0.01 / 3, "REVEALED by TTFT"),
        ("hf_1tok_6", None, 0.01 / 3, "not revealed"),
        ("long_60", "cached_long_60", 0.01 / 2, "not revealed"),  # cached p below it, but its AUC below MIN_AUC
    ],
)
def test_each_runs_outcome(ttft: str, cached: str | None, threshold: float, seen: str) -> None:
    r = timing_run(1, False, ttft, cached)
    r.decide(threshold)
    assert r.seen() == seen
    if ttft == "long_60":
        assert r.cached_p_value is not None and r.cached_p_value < threshold and r.cached_auc < MIN_AUC


def report(runs: list[TimingRun], trials: int = 8, salted: bool = True) -> TimingReport:
    rep = TimingReport(trials, 400, 0.01, runs=runs, salted_measured=salted)
    rep.conclude()
    return rep


# The reasons the timing gave, as recorded: each p-value and AUC as the report prints it.
EXPOSURE = (
    "a cache hit is visible to clients without salts: revealed by 1-token victim, sent once (TTFT AUC 1.00, p 7.8e-05; "
    "cached_tokens AUC 1.00, p 7.8e-05); 4-token victim, sent once (TTFT AUC 1.00, p 7.8e-05; cached_tokens AUC 0.81, "
    "p 0.013)"
)
LEAK = (
    "a cache hit is visible across distinct salts: 1-token victim, sent once (TTFT AUC 1.00, p 7.8e-05; cached_tokens "
    "AUC 1.00, p 7.8e-05); 4-token victim, sent once (TTFT AUC 0.97, p 0.00031; cached_tokens AUC 0.50, p 1)"
)
CLEAN = (
    "no cache hit visible with any victim shape at this power (n=8 pairs per run, smallest reachable p=7.8e-05 <= "
    "alpha/tests=0.01/6=0.0017; an AUC >= 0.92 would show; best: 1-token victim, sent once, median TTFT hit 853.2 ms, "
    "miss 872.7 ms, AUC 0.70 (p 0.097); cached_tokens AUC 0.50): no sharing, or hits below this machine's timing noise"
)
INCONCLUSIVE = (
    "not detected at this power (n=8, smallest reachable p=0.23 > alpha/tests=0.0017; ties in the samples): 1-token "
    "victim, sent once"
)
HF_EXPOSURE = (
    "a cache hit is visible to clients without salts: revealed by 4-token victim, sent once (TTFT AUC 1.00, p 0.0011); "
    "4-token victim, sent twice (TTFT AUC 1.00, p 0.0011); not revealed by: 1-token victim, sent once"
)


def test_the_timing_verdicts() -> None:
    plain = [timing_run(0, False, "vllm_hit_8", "cached_all_8"), timing_run(1, False, "vllm_hit_8", "cached_5_of_8")]
    honoured = [timing_run(0, True, "vllm_salted_8", "cached_none_8"), timing_run(1, True, "noise_10", "cached_none_8")]
    exposure = report(plain + honoured)
    assert (exposure.verdict, exposure.reason) == ("exposure", EXPOSURE)
    assert exposure.salt_handling() == "honoured"
    ignored = [timing_run(0, True, "vllm_hit_8", "cached_all_8"), timing_run(1, True, "coarse_ms_8", "cached_none_8")]
    leak = report(plain + ignored)
    assert (leak.verdict, leak.reason) == ("leak", LEAK)
    clean = report([timing_run(0, False, "vllm_salted_8", "cached_none_8"), *honoured])
    assert (clean.verdict, clean.reason) == ("clean", CLEAN)
    coarse = report([timing_run(0, False, "coarse_clock_8", "cached_none_8"), *honoured])
    assert (coarse.verdict, coarse.reason) == ("inconclusive", INCONCLUSIVE)
    continuous = [
        timing_run(0, False, "hf_1tok_6"),
        timing_run(1, False, "hf_4tok_6"),
        timing_run(2, False, "hf_4tok_6"),
    ]
    hf = report(continuous, trials=6, salted=False)
    assert (hf.verdict, hf.reason) == ("exposure", HF_EXPOSURE)


# ------------------------------------------------------------------ Fisher's exact test (bursts, reuse)
@pytest.mark.parametrize(
    ("table", "want"),
    [
        ((0, 10, 0, 10), 1.0),
        ((10, 10, 0, 10), 5.412544112234515e-06),  # 1 / C(20, 10)
        ((3, 10, 1, 10), 0.29102167182662536),
        ((2, 10, 2, 10), 0.7089783281733746),
        ((6, 6, 0, 6), 0.0010822510822510823),
        ((9, 9, 0, 9), 2.0567667626491154e-05),
        ((3, 9, 0, 9), 0.10294117647058823),
        ((72, 120, 10, 60), 1.6938435479462463e-08),
        ((24, 120, 10, 60), 0.37322034004803967),
        ((21, 72, 9, 60), 0.041065242512292065),
        ((25, 96, 7, 80), 0.0023292642492889638),
        ((5, 10, 0, 0), 1.0),  # no control to compare with
        ((0, 5, 3, 5), 1.0),
    ],
)
def test_fisher_greater(table: tuple[int, int, int, int], want: float) -> None:
    assert fisher_greater(*table) == pytest.approx(want, rel=P_TOL)


# ------------------------------------------------------------------ binomial tails (membership, reuse's sign test)
@pytest.mark.parametrize(
    ("k", "n", "q", "want"),
    [
        (3, 3, 1 / 8, 0.001953125),  # 1/512: vLLM's membership row, 3 of 3 among 8
        (1, 1, 1 / 5, 0.2),
        (2, 3, 1 / 8, 0.04296875),
        (1, 3, 1 / 8, 0.330078125),
        (0, 3, 1 / 2, 1.0),
        (9, 9, 1 / 2, 0.001953125),  # llama.cpp --cache-reuse's row: 9 of 9 trials
        (7, 9, 1 / 2, 0.08984375),
        (5, 10, 1 / 10, 0.0016349374000000007),
    ],
)
def test_binomial_tail(k: int, n: int, q: float, want: float) -> None:
    assert binomial_tail(k, n, q) == pytest.approx(want, rel=P_TOL)


@pytest.mark.parametrize(("shared", "verdict", "chance"), [(True, "leak", 1 / 512), (False, "no leak", 1.0)])
def test_the_membership_verdicts(shared: bool, verdict: str, chance: float) -> None:
    r = run(TokenCache(None, report="block", shared=shared), strategy="membership")
    assert (r.verdict, r.candidates) == (verdict, 8) and r.chance == pytest.approx(chance, rel=P_TOL)


def test_one_round_among_five_is_within_chance() -> None:
    prompts = tuple(f"System: you are the assistant of customer {i:03d}; be brief and polite always." for i in range(5))
    r = run(TokenCache(None, report="exact"), candidates=prompts, strategy="auto")
    assert r.verdict == "inconclusive" and r.chance == pytest.approx(0.2, rel=P_TOL)
    assert "probability 0.2 by chance > 0.01" in r.reason


# ------------------------------------------------------------------ the findings that consume them
def reuse(victim: int, control: int, trials: int, cached: list[tuple[int, int]] | None = None) -> ReuseResult:
    rows = []
    for t in range(trials):
        after_v, after_c = cached[t] if cached else (None, None)
        rows.append(
            ReuseTrial(
                "g",
                t,
                "diverged" if t < control else "same",
                "diverged" if t < victim else "same",
                cached_after_victim=after_v,
                cached_after_control=after_c,
            )
        )
    return ReuseResult(groups=["g"], trials=rows, trials_run=trials)


@pytest.mark.parametrize(
    ("result", "p", "sign_p", "verdict"),
    [
        (reuse(6, 0, 6), 0.0010822510822510823, 1.0, "leak"),
        (reuse(3, 0, 9), 0.10294117647058823, 1.0, "inconclusive"),
        (reuse(3, 1, 10), 0.29102167182662536, 1.0, "inconclusive"),
        (reuse(0, 0, 9), 1.0, 1.0, "clean"),
        (reuse(0, 0, 9, [(260, 0)] * 9), 1.0, 0.001953125, "leak"),  # llama.cpp --cache-reuse
        (reuse(0, 0, 9, [(64, 0)] * 7 + [(0, 64)] * 2), 1.0, 0.08984375, "inconclusive"),
        (reuse(0, 0, 9, [(4, 0)] * 9), 1.0, 1.0, "clean"),  # within CACHED_SLACK: bookkeeping
    ],
)
def test_the_reuse_verdicts(result: ReuseResult, p: float, sign_p: float, verdict: str) -> None:
    assert result.p_value() == pytest.approx(p, rel=P_TOL)
    assert result.cached_p_value() == pytest.approx(sign_p, rel=P_TOL)
    assert reuse_finding(result).verdict == verdict


def test_the_reuse_reason_states_both_p_values() -> None:
    f = reuse_finding(reuse(6, 0, 6, [(260, 0)] * 6))
    assert f.verdict == "leak" and "(Fisher p = 0.0011;" in f.reason and "sign test p = 0.016)" in f.reason


CRIT = Criterion("tokens", 4, 2, 10, 4)


@pytest.mark.parametrize(
    ("diverged", "total", "det", "verdict", "shown"),
    [
        # A server that varies on its own (10 of 60 copies in bursts): 72 of 120 under cross-traffic is beyond it.
        (72, 120, Determinism(prompts=12, alone=24, burst=60, burst_differ=10), "leak", "Fisher p = 1.7e-08"),
        (25, 96, Determinism(prompts=10, alone=20, burst=80, burst_differ=7), "leak", "Fisher p = 0.0023"),
        (24, 120, Determinism(prompts=12, alone=24, burst=60, burst_differ=10), "inconclusive", "none beyond chance"),
        (21, 72, Determinism(prompts=10, alone=20, burst=60, burst_differ=9), "inconclusive", "none beyond chance"),
    ],
)
def test_the_contamination_verdicts(diverged: int, total: int, det: Determinism, verdict: str, shown: str) -> None:
    bursts = BurstResult(counts={"same": total - diverged, "diverged": diverged})
    f = contamination_finding(bursts, det, CRIT)
    assert f.verdict == verdict and shown in f.reason


# ------------------------------------------------------------------ scipy as the reference
TIED = [name for name, (h, m) in SAMPLES.items() if len(set(h + m)) < len(h + m) and len(h + m) <= 16]


def test_samples_with_ties_take_the_exact_test_of_their_ties_as_scipy_enumerates_it() -> None:
    """With ties the rank test counts every split of the samples given their ties (``tied_p``): scipy's exact
    enumeration (``PermutationMethod`` over every split) gives the same p. scipy's ``method="exact"`` does not:
    it takes the distribution without ties and rounds a half-integer U down, too small here (0.029 for 0.043)."""
    import numpy as np
    from scipy.stats import PermutationMethod, mannwhitneyu

    assert len(TIED) == 7
    every_split = PermutationMethod(n_resamples=np.inf)
    for name in TIED:
        hits, misses = SAMPLES[name]
        want = mannwhitneyu(misses, hits, alternative="greater", method=every_split).pvalue
        assert tied_p(hits, misses) == pytest.approx(want, rel=P_TOL), name
    hits, misses = SAMPLES["half_tie_4"]
    untied = mannwhitneyu(misses, hits, alternative="greater", method="exact").pvalue
    assert untied == pytest.approx(4 / 140) and rank_test(hits, misses)[0] == pytest.approx(6 / 140)


def untied_split(pairs: int, u: int) -> tuple[list[float], list[float]]:
    """``pairs`` hits and misses, no two alike, in which a miss is the slower in exactly ``u`` hit/miss pairs."""
    hits = [2.0 * j for j in range(pairs)]
    beaten = ([pairs] * (u // pairs) + [u % pairs] + [0] * pairs)[:pairs]  # how many hits each miss is above
    return hits, [2 * b - 1 + i / (2 * pairs) for i, b in enumerate(beaten)]


@pytest.mark.parametrize(("pairs", "threshold"), [(5, 0.01), (6, 0.01 / 3), (8, 0.01 / 12), (12, 0.01 / 12)])
def test_the_detectable_auc_is_where_scipys_exact_test_starts_to_reach_the_threshold(
    pairs: int, threshold: float
) -> None:
    from scipy.stats import mannwhitneyu

    def p_at(u: int) -> float:
        hits, misses = untied_split(pairs, u)
        assert auc(hits, misses) == u / pairs**2
        return float(mannwhitneyu(misses, hits, alternative="greater", method="exact").pvalue)

    found = detectable_auc(pairs, threshold)
    assert found is not None
    u = round(found * pairs**2)
    assert p_at(u) <= threshold < p_at(u - 1)
