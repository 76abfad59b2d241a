"""One request's fault inside a step fails that request alone; the others finish exactly as the oracle says."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab import LLM, Engine, SamplingParams
from kvlab.config import CacheConfig, SchedulerConfig
from kvlab.engine import sampling
from kvlab.engine.runner import PreparedStep
from kvlab.kv import check_invariants
from oracle_cache import check_against_oracle, mini

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(n: int, length: int = 12) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1e-45, top_p=1e-46, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1e-4, top_p=1e-46, max_tokens=8, ignore_eos=True, seed=1),
        SamplingParams(temperature=0.5, top_p=1e-300, top_k=1, max_tokens=8, ignore_eos=True, seed=2),
        SamplingParams(temperature=1e6, max_tokens=8, ignore_eos=True, seed=3),
    ],
    ids=["temp-1e-40", "temp-1e-45-top_p-1e-46", "temp-1e-4-top_p-1e-46", "top_p-1e-300", "temp-1e6"],
)
def test_extreme_sampling_values_are_served(params: SamplingParams) -> None:
    """Regression: these made the sampling probabilities NaN and the sampler raised inside the engine."""
    prompts = _prompts(3)
    outs = LLM(mini()).generate(prompts, [params, GREEDY, GREEDY])
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    if params.temperature < sampling.GREEDY_BELOW or params.top_k == 1 or params.top_p < 1e-200:
        # Nothing but the most likely token survives: the answer is the greedy one.
        assert check_against_oracle("mini", tuple(prompts[0]), 8, tuple(outs[0].token_ids))
    for p, o in zip(prompts[1:], outs[1:], strict=True):
        assert check_against_oracle("mini", tuple(p), 8, tuple(o.token_ids))


def test_nan_and_inf_temperature_are_refused() -> None:
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(sampling.InvalidRequestError, match="temperature"):
            SamplingParams(temperature=bad)


def _engine() -> Engine:
    return Engine(mini(), CacheConfig(block_size=8, num_blocks=64, sanitize=True), SchedulerConfig(max_model_len=64))


def _finish(eng: Engine, ids: list[str]) -> None:
    while eng.has_unfinished_requests():
        eng.step()
        check_invariants(eng.kv)
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert eng.violations == []


def test_non_finite_logits_fail_only_their_request(monkeypatch) -> None:
    eng = _engine()
    prompts = _prompts(4)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    victim = ids[1]
    real = eng.runner.forward

    def poisoned(prep: PreparedStep) -> torch.Tensor:  # NaN on one request's row, from its third token on
        logits = real(prep).clone()  # an inference tensor cannot be edited in place
        for row, req in enumerate(prep.requests):
            if req.request_id == victim and len(req.output_token_ids) >= 2:
                logits[row] = float("nan")
        return logits

    monkeypatch.setattr(eng.runner, "forward", poisoned)
    _finish(eng, ids)
    bad = eng.output(victim)
    assert bad.finish_reason == "error" and "non-finite logits" in (bad.error or "")
    assert len(bad.token_ids) == 2  # what it got before the fault is kept
    assert bad.metrics.is_corrupted  # vLLM V1's flag for NaNs in the logits
    assert eng.stats().num_failed_requests == 1
    for rid, p in zip(ids, prompts, strict=True):
        if rid != victim:
            out = eng.output(rid)
            assert out.error is None and not out.metrics.is_corrupted
            assert check_against_oracle("mini", tuple(p), 8, tuple(out.token_ids))


def test_an_exception_while_sampling_one_request_fails_only_it(monkeypatch) -> None:
    eng = _engine()
    prompts = _prompts(3)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=666, max_tokens=8), GREEDY]
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    real = sampling.sample_row

    def faulty(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        if p.seed == 666:
            raise RuntimeError("injected fault")
        return real(logits, p, gen)

    monkeypatch.setattr(sampling, "sample_row", faulty)
    _finish(eng, ids)
    assert eng.output(ids[1]).finish_reason == "error"
    assert "injected fault" in (eng.output(ids[1]).error or "")
    for i in (0, 2):
        assert check_against_oracle("mini", tuple(prompts[i]), 8, tuple(eng.output(ids[i]).token_ids))


def test_a_failing_forward_pass_fails_its_batch_and_the_engine_goes_on(monkeypatch) -> None:
    eng = _engine()
    first = [eng.add_request(p, GREEDY) for p in _prompts(2)]
    real = eng.runner.forward
    calls = {"n": 0}

    def broken_once(prep: PreparedStep) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected forward failure")
        return real(prep)

    monkeypatch.setattr(eng.runner, "forward", broken_once)
    _finish(eng, first)
    assert all(eng.output(r).finish_reason == "error" for r in first)
    later = _prompts(3, 10)
    ids = [eng.add_request(p, GREEDY) for p in later]
    _finish(eng, ids)
    for rid, p in zip(ids, later, strict=True):
        assert check_against_oracle("mini", tuple(p), 8, tuple(eng.output(rid).token_ids))


def test_rerun_after_a_shorter_prefix_hits_every_full_block() -> None:
    """Regression (lost cache hits): a 33-token prompt re-run after its 20-token prefix ran gets the 32
    tokens of its 4 full blocks of 8, as block granularity does, not 24."""
    prompt = _prompts(1, 33)[0]
    for granularity in ("token", "block"):
        llm = LLM(mini(), block_size=8, prefix_granularity=granularity)
        llm.generate([prompt], GREEDY)
        llm.generate([prompt[:20]], GREEDY)
        again = llm.generate([prompt], GREEDY)[0]
        assert again.num_cached_tokens == 32, granularity
        assert llm.stats().evictions == 0
