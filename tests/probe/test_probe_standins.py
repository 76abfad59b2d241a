"""`kvlab probe` against stand-ins of servers nobody here wrote: each reproduces one behaviour that fooled the
probe before (issue 17), and each verdict is asserted. kvlab's own servers are in tests/server/test_probe.py."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.experiment.passphrases import default_passphrases
from kvlab.probe.client import ProbeClient
from kvlab.probe.material import new_nonce
from kvlab.probe.probe import ProbeReport, run_probe
from kvlab.probe.schema import probe_document
from kvlab.probe.timing import SHAPES, run_timing

# Small runs: the stand-ins answer in milliseconds, and each behaviour shows in a few requests.
FAST: dict[str, Any] = dict(
    concurrency=4, rounds=2, reuse_trials=2, determinism_repeats=1, calibration_prompts=6, timing=False
)
# Timing: 10 pairs per run; a perfect separation has p = 1 / C(20, 10), and a few outliers still pass
# alpha / 6 tests (a loaded machine adds the odd 20 ms to a hit). alpha 1e-3: a run with nothing to find (the
# salted runs) reveals a hit by chance at most that often, so a test asserting that it does not fails that rarely.
TIMING: dict[str, Any] = dict(timing=True, timing_trials=10, timing_prefix_chars=200, alpha=1e-3)
SLOW_MISS = 1.5e-4  # seconds per uncached character: a 200-character miss takes ~30 ms, a hit ~0


def probe(url: str, **kw: Any) -> ProbeReport:
    return run_probe(url, "toy", default_passphrases(), **{**FAST, **kw})


def verdicts(r: ProbeReport) -> dict[str, str]:
    return {f.name: f.verdict for f in r.findings}


def revealed(r: ProbeReport) -> dict[tuple[str, bool], list[str]]:
    assert r.timing is not None
    return {(run.shape, run.salted): run.revealed_by for run in r.timing.runs}


def test_rejects_unknown_fields_carries_on_without_salts(standin) -> None:
    """transformers serve: 422 on cache_salt. The probe must report it and measure everything else."""
    url = standin(reject_unknown=True, per_char=SLOW_MISS)
    r = probe(url, **TIMING, timing_shapes=SHAPES[1:2])
    assert not r.capabilities.salt.accepted and r.capabilities.salt.status == 422
    assert r.salts.handling == "rejected" and f"{url}/v1/completions answered 422" in r.salts.detail
    assert "Unexpected fields" in r.salts.detail
    assert r.capabilities.ids_mode == "text" and r.criterion.unit == "characters"
    v = verdicts(r)
    assert v["contamination"] == "clean" and v["non-prefix reuse"] == "clean" and v["salts"] == "info"
    # The cache is shared and visible without salts; across salts it could not be measured, and says so.
    assert v["timing"] == "exposure" and r.timing is not None and not r.timing.salted_measured
    assert r.side_channels["TTFT across distinct salts"] == "not measurable: the server rejects cache_salt"
    assert r.side_channels["cached_tokens"].startswith("not measurable")
    assert r.verdict == "exposure" and r.exit_code == 3


def test_cache_of_two_token_requests_only_is_found(standin) -> None:
    """transformers' continuous batching never caches a request that ends in prefill: a 1-token victim shows
    nothing, a longer one does, and the report says which shape revealed the cache."""
    url = standin(register_min_tokens=2, per_char=SLOW_MISS)
    r = probe(url, **TIMING, timing_shapes=SHAPES[:2])
    shown, why = revealed(r), r.timing.render() if r.timing else ""
    assert shown[(SHAPES[0].name, False)] == [], why  # the old probe's only shape: blind here
    assert shown[(SHAPES[1].name, False)] == ["TTFT"], why
    assert not shown[(SHAPES[0].name, True)] and not shown[(SHAPES[1].name, True)], why  # salts honoured
    assert r.finding("timing").verdict == "exposure"
    assert SHAPES[1].name in r.finding("timing").reason and f"not revealed by: {SHAPES[0].name}" in (
        r.finding("timing").reason
    )
    # No cached_tokens field: whether salts are honoured is read from TTFT.
    assert r.salts.handling == "honoured" and r.salts.channel == "TTFT"
    assert r.verdict == "exposure" and r.exit_code == 3


def test_ignored_salts_are_a_leak(standin) -> None:
    """llama.cpp accepts cache_salt and ignores it: a hit across distinct salts is a leak, in both channels."""
    url = standin(salts="ignore", report_cached="usage", per_char=SLOW_MISS)
    r = probe(url, **TIMING, timing_shapes=SHAPES[1:2])
    assert r.salts.handling == "ignored" and r.salts.channel == "cached_tokens"
    assert r.salts.other_salt_cached == r.salts.same_salt_cached
    assert set(revealed(r)[(SHAPES[1].name, True)]) == {"TTFT", "cached_tokens"}
    v = verdicts(r)
    assert v["salts"] == "leak" and v["timing"] == "leak" and v["contamination"] == "clean"
    assert r.verdict == "leak" and r.exit_code == 1


def test_non_prefix_chunk_reuse_is_a_leak(standin) -> None:
    """llama.cpp --cache-reuse, one slot: the attacker's answer depends on the victim's secret. The built-in
    passphrase groups (differing only at their ends) never trigger it; the reuse groups do."""
    url = standin(single_slot=True, reuse_chunk=64, native=True, tokenize=True, report_cached="timings")
    r = probe(url)
    assert r.capabilities.ids_mode == "native" and r.capabilities.tokenize == "content"
    assert r.reuse is not None and r.reuse.groups == ["reuse-support", "reuse-translate", "reuse-long"]
    assert r.reuse.diverged == len(r.reuse.trials) == 6 and r.reuse.control_diverged == 0
    assert r.reuse.p_value() == pytest.approx(1 / math.comb(12, 6))  # 6 of 6 against 0 of 6
    assert r.reuse.determinism.alone_deterministic
    v = verdicts(r)
    assert v["non-prefix reuse"] == "leak" and v["contamination"] == "clean"
    evidence = r.reuse.trials[0].evidence[0]
    assert evidence.condition == "after the victim's prompt" and evidence.answer != evidence.reference
    assert evidence.answer_ids is not None and evidence.reference_ids is not None
    assert r.salts.handling == "ignored"  # one slot for everybody, read from llama.cpp's timings.cache_n
    assert r.verdict == "leak" and r.exit_code == 1


def test_chunk_reuse_behind_a_host_prompt_cache_is_caught_by_cached_tokens(standin) -> None:
    """llama.cpp's default host prompt cache restores the attacker's repeated prompt whole from its own earlier
    sends, so the paired answers never see the victim's chunk (they stay equal: that alone was a false clean on
    llama.cpp). The attacker's first-time prompt after the victim finds more cached tokens than after a control
    in every trial: the reuse is caught there."""
    url = standin(single_slot=True, reuse_chunk=64, prompt_cache=True, native=True, tokenize=True,
                  report_cached="timings")  # fmt: skip
    r = probe(url, reuse_trials=3)
    assert r.reuse is not None and len(r.reuse.trials) == 9
    assert r.reuse.diverged == 0  # the answers alone are blind here
    assert r.reuse.cached_excess == 9 and r.reuse.cached_deficit == 0
    assert r.reuse.cached_p_value() == pytest.approx(2**-9)
    finding = r.finding("non-prefix reuse")
    assert finding.verdict == "leak" and "cached-token counts" in finding.reason


def test_without_chunk_reuse_first_time_prompts_find_only_the_prefix(standin) -> None:
    url = standin(single_slot=True, prompt_cache=True, native=True, tokenize=True, report_cached="timings")
    r = probe(url, reuse_trials=3)
    assert r.reuse is not None and r.reuse.cached_excess == 0 and r.reuse.diverged == 0
    assert verdicts(r)["non-prefix reuse"] == "clean"


@pytest.mark.parametrize(("reuse_chunk", "verdict"), [(None, "clean"), (64, "leak")])
def test_answers_that_change_when_cached_are_not_mistaken_for_reuse(standin, reuse_chunk, verdict) -> None:
    """llama.cpp answers a prompt whose prefix it reuses differently from the same prompt computed fresh. The
    reuse test compares the answer after the victim with the answer after the control, both from the same
    cached prefix, so that alone is never a leak; real chunk reuse still is."""
    url = standin(single_slot=True, reuse_chunk=reuse_chunk, cache_noise=True, tokenize=True)
    r = probe(url, reuse_trials=2)
    # The cached prefix alone changes answers (what a comparison with the fresh answer would call a leak).
    assert r.reuse is not None and any(t.fresh_vs_cached == "diverged" for t in r.reuse.trials)
    assert r.reuse.control_diverged == 0
    assert verdicts(r)["non-prefix reuse"] == verdict


def test_fisher_p_value_of_the_reuse_trials() -> None:
    from kvlab.probe.reuse import ReuseResult, ReuseTrial

    def result(victim: int, control: int, n: int = 9) -> ReuseResult:
        return ReuseResult(
            trials=[
                ReuseTrial("g", i, "diverged" if i < control else "same", "diverged" if i < victim else "same")
                for i in range(n)
            ]
        )

    assert result(9, 0).p_value() == pytest.approx(1 / math.comb(18, 9))
    assert result(3, 0).p_value() == pytest.approx(math.comb(9, 3) / math.comb(18, 3))  # 0.10: not enough
    assert result(0, 0).p_value() == 1.0 and result(2, 2).p_value() > 0.5


def test_single_slot_without_chunk_reuse_is_clean(standin) -> None:
    """The same server without --cache-reuse: only the prefix is reused, and no answer changes."""
    url = standin(single_slot=True, tokenize=True)
    r = probe(url, reuse_trials=2)
    assert r.capabilities.ids_mode == "tokenize"
    assert r.reuse is not None and r.reuse.diverged == 0
    assert verdicts(r)["non-prefix reuse"] == "clean" and verdicts(r)["contamination"] == "clean"


def test_nondeterministic_under_batching_is_inconclusive(standin) -> None:
    """Answers change whenever requests overlap, with no foreign text involved: divergence under bursts says
    nothing, so the verdict is inconclusive, with the measured variance, never leak and never clean."""
    url = standin(batch_noise=True, busy=0.03, token_ids=True)
    r = probe(url)
    det = r.determinism
    assert det.alone_differ == 0 and det.burst_differ > 0
    assert r.bursts.diverged > 0 and r.bursts.contaminated == 0
    contamination = r.finding("contamination")
    print(f"\nbatch noise: {r.counts}; {det.variance()}")
    assert contamination.verdict == "inconclusive" and det.variance() in contamination.reason
    assert r.verdict == "inconclusive" and r.exit_code == 0
    assert all(f.verdict != "leak" for f in r.findings)
    # The evidence behind the verdict is in the report: every changed answer with its reference.
    changed = [o for o in r.observations if o.outcome != "same"]
    assert changed and all(o.answer is not None and o.reference is not None for o in changed)
    assert json.loads(json.dumps(probe_document(r).model_dump(mode="json")))["findings"][0]["verdict"] == "inconclusive"


def test_every_run_uses_fresh_material(standin) -> None:
    """The same seed twice: the second run's prompts are new, so its misses are still misses."""
    url = standin(per_char=SLOW_MISS)
    with ProbeClient(url, "toy") as client:
        runs = [
            run_timing(client, nonce=new_nonce(), trials=8, prefix_chars=200, seed=0, salts=False, shapes=SHAPES[1:2])
            for _ in range(2)
        ]
    assert [t.verdict for t in runs] == ["exposure", "exposure"]
    assert runs[1].runs[0].auc == 1.0


def test_cli_exit_codes_json_and_the_url_in_errors(standin) -> None:
    url = standin(salts="ignore", report_cached="usage")
    args = ["probe", "--base-url", url + "/v1", "--rounds", "1", "--concurrency", "2", "--reuse-trials", "1"]
    res = CliRunner().invoke(app, [*args, "--determinism-repeats", "1", "--no-timing", "--json", "-"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)  # the JSON alone: the phases went to stderr
    assert "probe: bursts" in res.stderr
    assert data["target"]["model"] == "toy" and data["verdict"] == "leak" and data["exit_code"] == 1
    assert {f["name"]: f["verdict"] for f in data["findings"]}["salts"] == "leak"
    assert data["evidence"]["criterion"]["statement"].startswith("contaminated = follows")
    assert "side_channels" in data and data["evidence"]["salts"]["handling"] == "ignored"
    # An error names the URL actually requested, path and all.
    bad = CliRunner().invoke(app, ["probe", "--base-url", url + "/nothere", "--model", "toy"])
    assert bad.exit_code == 2 and f"POST {url}/nothere/v1/completions answered 404" in bad.output
