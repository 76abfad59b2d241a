"""The probe's prompts must fill the server's cache blocks, and its statistics must be able to fire (issue: a
false CLEAN on vLLM's CPU build, whose 128-token blocks the old 400-character timing prefixes never filled, and
``--timing-trials 4``, whose smallest reachable p-value was above alpha). A vLLM-like stand-in (4 characters a
token, cached_tokens in whole 128-token blocks, cache_salt honoured, max_model_len in /v1/models) and its
variants; every verdict asserted. The stand-ins' own sleeps make every hit/miss difference unambiguous."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.experiment.passphrases import default_passphrases
from kvlab.probe import granularity as granularity_module
from kvlab.probe.client import ProbeClient
from kvlab.probe.granularity import Granularity, Sample, block_candidates, measure_granularity, telling_length
from kvlab.probe.material import new_nonce, tag
from kvlab.probe.probe import ProbeReport, run_probe
from kvlab.probe.timing import (
    NOT_POWERED,
    OWN_KEY,
    SAME_KEY,
    SHAPES,
    TimingReport,
    TimingRun,
    detectable_auc,
    midranks,
    plan_trials,
    rank_test,
    required_trials,
    run_timing,
    smallest_p,
)

FAST: dict[str, Any] = dict(
    concurrency=2, rounds=1, reuse_groups=[], determinism_repeats=1, calibration_prompts=4, timing=False
)
# One victim shape, 10 pairs: 8 would do for 2 runs x 2 channels (1/C(16, 8) = 7.8e-5 <= 1e-3/4), but only
# with a near-perfect separation, and a loaded machine adds the odd 40 ms to a hit. alpha 1e-3: a run with nothing
# to find reveals a hit by chance at most that often (so a test asserting that it does not fails that rarely).
TIMING: dict[str, Any] = dict(timing=True, timing_trials=10, timing_shapes=SHAPES[1:2], alpha=1e-3)
# vLLM 0.32 on a CPU: 4 characters a token here, 128-token blocks, --enable-prompt-tokens-details on. A miss
# costs 40 us per uncached character: a 1,300-character timing prefix ~50 ms, a hit on its 2 blocks ~10 ms.
VLLM_CPU: dict[str, Any] = dict(chars_per_token=4, block=128, max_model_len=2048, report_cached="usage", per_char=4e-5)


def probe(url: str, **kw: Any) -> ProbeReport:
    return run_probe(url, "toy", default_passphrases(), **{**FAST, **kw})


def verdicts(r: ProbeReport) -> dict[str, str]:
    return {f.name: f.verdict for f in r.findings}


# ------------------------------------------------------------------ the vLLM-like stand-in
def test_the_stand_in_reports_like_vllm(standin) -> None:
    """The issue's numbers: a 201-token prompt sent twice reports 0, then 128 cached tokens."""
    with ProbeClient(standin(**VLLM_CPU), "toy") as client:
        prompt = "abcd" * 201
        first, second = (client.completion(prompt, 1)[0]["usage"] for _ in range(2))
    assert first["prompt_tokens"] == 201 and first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 128


def test_granularity_of_vllm_cpu_blocks_is_measured(standin) -> None:
    with ProbeClient(standin(**VLLM_CPU), "toy") as client:
        g = measure_granularity(client, new_nonce(), cached_tokens=True, ttft=False)
    assert g is not None and g.channel == "cached_tokens" and g.found
    assert g.block == 128 and g.candidates == [128] and g.first_hit is not None and g.first_hit >= 128
    assert g.last_miss is not None and g.last_miss < 128
    assert g.context == 2048 and g.context_source == "/v1/models" and g.chars_per_token == pytest.approx(4, 0.01)
    # Sized prompts fill 2 blocks, whatever the floor asked.
    assert g.prompt_tokens() >= 256 and g.prompt_chars(400) >= 256 * 4
    assert "blocks of 128 tokens" in g.summary() and not g.blind


@pytest.mark.parametrize(("block", "chars_per_token"), [(1, 1), (16, 1), (32, 4)])
def test_granularity_per_token_and_small_blocks(standin, block, chars_per_token) -> None:
    """llama.cpp (per token), kvlab (16-token blocks), vLLM --block-size 32."""
    url = standin(block=block, chars_per_token=chars_per_token, report_cached="usage")
    with ProbeClient(url, "toy") as client:
        g = measure_granularity(client, new_nonce(), cached_tokens=True, ttft=False)
    assert g is not None and g.block == block and g.candidates == [block], g.samples
    assert g.context is None and g.bound_by == ""  # a hit was found: the bound never mattered


def test_the_vllm_stand_in_before_and_after(standin) -> None:
    """The issue's false CLEAN: 400-character prefixes (~100 tokens) and 300-character salt prompts never fill a
    128-token block. Sized from the measured granularity, the salts show as honoured and the unsalted hits as
    exposure, in both channels."""
    r = probe(standin(**VLLM_CPU), **TIMING)
    assert r.salts.handling == "honoured" and r.salts.channel == "cached_tokens", r.salts
    assert r.salts.other_salt_cached == 0 and (r.salts.same_salt_cached or 0) >= 256
    assert r.salts.prompt_chars is not None and r.salts.prompt_chars >= 256 * 4
    assert r.timing is not None and r.timing.prefix_chars >= 256 * 4 and "blocks of 128 tokens" in r.timing.granularity
    plain = next(run for run in r.timing.runs if not run.salted)
    salted = next(run for run in r.timing.runs if run.salted)
    assert set(plain.revealed_by) == {"TTFT", "cached_tokens"} and salted.detection == "not revealed"
    assert all(c is not None and c >= 256 for c in plain.hit_cached)
    v = verdicts(r)
    assert v["salts"] == "clean" and v["timing"] == "exposure" and r.verdict == "exposure" and r.exit_code == 3


def test_the_vllm_stand_in_without_prompt_tokens_details_is_measured_by_ttft(standin) -> None:
    """No cached_tokens: the step shows in TTFT, and the prefixes are sized from it."""
    r = probe(standin(**{**VLLM_CPU, "report_cached": None}), **TIMING)
    assert r.timing is not None and "TTFT steps from a" in r.timing.granularity
    assert r.timing.prefix_chars >= 256 * 4
    assert [run.revealed_by for run in r.timing.runs] == [["TTFT"], []], r.timing.render()
    assert r.salts.handling == "honoured" and r.salts.channel == "TTFT"
    assert r.finding("timing").verdict == "exposure" and r.verdict == "exposure" and r.exit_code == 3


def test_prefix_caching_off_is_clean_with_enough_power(standin) -> None:
    """No hit for prompts up to the model's whole context: no prompt could show one, and the timing runs had
    the power to see a hit had there been one."""
    r = probe(standin(**{**VLLM_CPU, "cache": False, "max_model_len": 1024, "per_char": 1e-5}), **TIMING)
    assert r.timing is not None and not r.timing.blind and r.timing.powered
    assert "the server keeps no prefix cache its clients can see" in r.timing.granularity
    timing = r.finding("timing")
    assert timing.verdict == "clean" and "at this power (n=10 pairs per run" in timing.reason
    assert r.salts.handling == "undetermined" and "whole context" in r.salts.detail
    assert r.verdict == "clean" and r.exit_code == 0


def test_a_context_named_only_by_the_refusal_bounds_the_search(standin) -> None:
    url = standin(**{**VLLM_CPU, "cache": False, "max_model_len": 600, "offer_max_model_len": False})
    with ProbeClient(url, "toy") as client:
        g = measure_granularity(client, new_nonce(), cached_tokens=True, ttft=False)
    assert g is not None and g.context == 600 and "maximum context length" in g.context_source
    assert g.no_cache and g.bound_by == "context" and g.bound >= 0.8 * (600 - 32)


def test_no_hit_up_to_the_probes_own_bound_is_never_clean(standin) -> None:
    """The server names no context, and nothing hits up to the probe's bound: blocks may be larger. Not clean."""
    r = probe(
        standin(**{**VLLM_CPU, "cache": False, "max_model_len": None, "per_char": 1e-5}), **TIMING, search_tokens=600
    )
    timing = r.finding("timing")
    assert timing.verdict == "inconclusive", timing
    assert "not measured: no cache hit found for prompts up to" in timing.reason
    assert "the server may not cache, or its blocks are larger" in timing.reason
    assert r.salts.handling == "undetermined" and "not measured: no cache hit found" in r.salts.detail
    assert r.verdict == "inconclusive" and r.exit_code == 0  # the probe's code for inconclusive


# ------------------------------------------------------------------ power
def test_four_trials_are_raised_until_the_test_can_fire(standin) -> None:
    """Hits 8 ms, misses 50 ms (AUC 1.00), --timing-trials 4: with 4 pairs the smallest p is 1/70 = 0.014 >
    alpha. The probe raises the pairs (and says so) and reports the exposure; the old probe said CLEAN. (--alpha
    1e-3: the salted runs, where nothing hits, reveal a hit by chance at most that often.)"""
    url = standin(fixed_latency=(0.008, 0.05))
    args = ["probe", "--base-url", url, "--rounds", "1", "--concurrency", "2", "--no-reuse", "--alpha", "1e-3"]
    res = CliRunner().invoke(app, [*args, "--determinism-repeats", "1", "--timing", "--timing-trials", "4"])
    assert res.exit_code == 3, res.output
    assert "raised from 4 to 8 hit/miss pairs per run" in res.output  # 6 tests: 1/C(16, 8) <= 1e-3/6 < 1/C(14, 7)
    assert "timing: EXPOSURE" in res.output and "timing: CLEAN" not in res.output


class Rhythmic:
    """A server without a cache on a machine with a rhythm: its 1-token probes answer fast, slow, fast, ... (another
    job's bursts), whatever they ask."""

    def __init__(self) -> None:
        self.probes = 0

    def completion(self, prompt: str, max_tokens: int, salt: str | None = None) -> tuple[dict[str, Any], float]:
        if max_tokens != 1:
            return {}, 0.0
        self.probes += 1
        return {}, 0.01 if self.probes % 2 else 0.05


def test_a_rhythm_of_the_machine_reveals_no_hit_beyond_alpha() -> None:
    """The regression (a CI run's false LEAK): the hits were drawn arm by arm within pairs, so a rhythm in step with
    the pairs put every hit on a fast beat in 1 run of 2^n, while the rank test assumed 1 in C(2n, n). Drawn over
    the whole run, the rank test's p is exact: a false reveal at most alpha of the time, whatever the rhythm."""
    seeds, alpha = 2000, 0.01
    runs = [
        run_timing(
            Rhythmic(),  # type: ignore[arg-type]
            nonce=f"rhythm{seed}",
            trials=6,
            prefix_chars=64,
            seed=seed,
            salts=False,
            alpha=alpha,
            shapes=SHAPES[1:2],
            cached_tokens=False,
        ).runs[0]
        for seed in range(seeds)
    ]
    revealed = sum(bool(run.revealed_by) for run in runs)
    # Only a perfect separation passes with 6 pairs: 1 run in C(12, 6) = 924 drawn over the whole run, about 2 of
    # these 2,000 (1 with these seeds); never more than alpha promises. Arm by arm: 32.
    assert revealed <= min(alpha * seeds, 6), revealed


def test_the_power_arithmetic() -> None:
    assert smallest_p(4) == pytest.approx(1 / 70) and smallest_p(10) == pytest.approx(1 / math.comb(20, 10))
    assert required_trials(0.01) == 5 and required_trials(0.01 / 12) == 7 and required_trials(0.5) == 1
    assert plan_trials(4, 0.01, runs=2, channels=1) == 5 and plan_trials(12, 0.01, runs=6, channels=2) == 12
    assert plan_trials(2, 0.01, runs=2, channels=2) == 6
    assert detectable_auc(4, 0.01) is None  # 4 pairs can never reach 0.01
    # 5 pairs: a perfect separation has p = 1/252 = 0.004, one swapped pair 2/252 = 0.008.
    assert detectable_auc(5, 0.005) == 1.0 and detectable_auc(5, 0.01) == pytest.approx(24 / 25)
    aucs = [detectable_auc(n, 0.01 / 12) or 0.0 for n in (7, 12, 30, 60)]  # 60: the normal approximation
    assert aucs[0] == pytest.approx(48 / 49) and aucs == sorted(aucs, reverse=True) and aucs[-1] > 0.6


def brute_force_p(pos: list[float], neg: list[float]) -> float:
    ranks = midranks([*pos, *neg])
    observed = sum(ranks[len(pos) :])
    splits = list(itertools.combinations(range(len(ranks)), len(neg)))
    return sum(sum(ranks[i] for i in s) >= observed - 1e-9 for s in splits) / len(splits)


def test_the_rank_test_is_exact() -> None:
    cases = [([1.0, 2.0], [3.0, 4.0]), ([1.0, 1.0, 2.0], [2.0, 3.0, 3.0, 5.0]), ([4.0, 1.0], [1.0, 4.0, 2.0])]
    cases.append(([-256.0] * 4, [0.0] * 4))  # cached_tokens: every hit alike, every miss alike
    for pos, neg in cases:
        p, smallest = rank_test(pos, neg)
        assert p == pytest.approx(brute_force_p(pos, neg)) and smallest <= p
    assert rank_test([-256.0] * 4, [0.0] * 4) == (pytest.approx(1 / 70), pytest.approx(1 / 70))
    assert rank_test([1.0] * 5, [1.0] * 5) == (1.0, 1.0)  # all tied: nothing can be shown


def test_a_run_that_could_not_reach_alpha_is_not_clean() -> None:
    """A clock too coarse to tell anything apart (every TTFT alike): the run is "not detected at this power",
    and the timing verdict inconclusive, never clean."""
    run = TimingRun(SHAPES[1].name, False, hit_ttft=[0.015] * 8, miss_ttft=[0.015] * 8)
    run.analyse()
    report = TimingReport(8, 400, 0.01, runs=[run], salted_measured=False)
    report.conclude()
    assert run.detection == NOT_POWERED and not report.powered
    assert report.verdict == "inconclusive" and report.reason.startswith(f"{NOT_POWERED} (n=8, smallest reachable p=1")
    assert NOT_POWERED in report.render()


def test_a_blind_timing_never_says_clean() -> None:
    run = TimingRun(
        SHAPES[1].name, False, hit_ttft=[0.01 * i for i in range(8)], miss_ttft=[0.005 + 0.01 * i for i in range(8)]
    )
    run.analyse()
    report = TimingReport(8, 400, 0.01, runs=[run], salted_measured=False, blind="not measured: no cache hit found")
    report.conclude()
    assert run.detection == "not revealed" and report.verdict == "inconclusive"
    report.blind = ""
    report.conclude()
    assert report.verdict == "clean" and "at this power" in report.reason


# ------------------------------------------------------------------ the victim's own API key
@pytest.mark.parametrize(("tenants", "verdict"), [(True, "clean"), (False, "exposure")])
def test_timing_across_api_keys(standin, tenants, verdict) -> None:
    """--victim-api-key: the victim's requests carry its key, the attacker's the probe's. A cache per key shows
    nothing across them; a cache shared between keys is exposure across tenants."""
    url = standin(tenants=tenants, report_cached="usage", per_char=1.5e-4)
    r = probe(url, api_key="tenant-b", victim_api_key="tenant-a", **TIMING, timing_prefix_chars=200)
    assert r.timing is not None and r.timing.victim == OWN_KEY
    assert r.finding("timing").verdict == verdict, r.timing.render()
    if verdict == "exposure":
        assert "across tenants" in r.finding("timing").reason
    # One key for both: one tenant, and its hits are visible to itself.
    r = probe(url, api_key="tenant-b", **TIMING, timing_prefix_chars=200)
    assert r.timing is not None and r.timing.victim == SAME_KEY and r.finding("timing").verdict == "exposure"


# ------------------------------------------------------------------ the pure pieces of the search
def samples(*pairs: tuple[int, int]) -> list[Sample]:
    return [Sample(n, 4 * n, c) for n, c in pairs]


def test_block_candidates_and_the_length_that_tells_them_apart() -> None:
    # kvlab: a hit at 64 tokens says only "a divisor of 64"; 72 tokens tells 8 and below from 16 and above.
    cands, slack = block_candidates(samples((64, 64)))
    assert cands == [1, 2, 4, 8, 16, 32, 64] and not slack and telling_length(cands, 64) == 72
    assert block_candidates(samples((64, 64), (72, 64)))[0] == [16, 32, 64]
    assert block_candidates(samples((64, 64), (72, 64), (80, 80)))[0] == [16]
    # vLLM CPU: a miss at 127 and a hit at 256 leave 128 and 256; 384 tells them apart.
    cands, _ = block_candidates(samples((127, 0), (256, 256)))
    assert cands == [128, 256] and telling_length(cands, 256) == 384
    assert block_candidates(samples((127, 0), (256, 256), (384, 384)))[0] == [128]
    # One token short of the floor (a tokenizer merge): found with slack, and said so.
    assert block_candidates(samples((130, 128), (256, 128))) == ([128], True)
    assert block_candidates(samples((64, 0)))[0] == []


def test_the_sizes_of_the_prompts() -> None:
    g = Granularity("cached_tokens", context=2048, chars_per_token=4.0, block=128, first_hit=130, tokens_counted=True)
    assert g.prompt_tokens() == 2 * 128 + 32 and g.prompt_chars(400) == math.ceil(288 * 4 * 1.1)
    assert g.prompt_chars(5000) == 5000 and g.prompt_chars(20000) == int((2048 - 32) * 4 * 0.95)  # the context
    small = Granularity("cached_tokens", chars_per_token=1.0, block=16, first_hit=16, tokens_counted=True)
    assert small.prompt_chars(400) == 400  # the floor: kvlab's blocks are filled many times over
    blind = Granularity("cached_tokens", bound=8192, bound_by="probe")
    assert blind.blind.startswith("not measured: no cache hit found for prompts up to 8192 tokens")
    assert blind.prompt_tokens() == granularity_module.CONFIRM_TOKENS


def test_burst_groups_get_a_shared_preamble_only_where_they_share_no_block() -> None:
    """On vLLM's CPU blocks no two prompts of a built-in group share a block (the near-miss pair shares its
    first 5 characters): the bursts could not show a cache that mixes them. Each group then shares a preamble of
    two blocks after the tag. kvlab's 16-token blocks are filled by the tag alone: its groups stay as they were."""
    nonce = new_nonce()
    groups = [[tag(nonce, p) for p in g.prompts] for g in default_passphrases().groups]
    kvlab = Granularity("cached_tokens", chars_per_token=1.0, block=16, first_hit=17, tokens_counted=True)
    assert all(kvlab.preamble(prompts, "seed") == "" for prompts in groups)
    vllm = Granularity("cached_tokens", context=2048, chars_per_token=4.0, block=128, first_hit=128)
    for prompts in groups:
        pad = vllm.preamble(prompts, "seed")
        assert len(pad) >= 2 * 128 * 4 and pad == vllm.preamble(prompts, "seed")  # the same for the whole group
    llama = Granularity("cached_tokens", chars_per_token=1.0, block=1, first_hit=16, tokens_counted=True)
    assert all(llama.preamble(prompts, "seed") == "" for prompts in groups)
    blind = Granularity("cached_tokens", bound=8192, bound_by="probe")
    assert blind.preamble(groups[0], "seed") == ""
