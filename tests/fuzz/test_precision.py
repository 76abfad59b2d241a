"""The row-invariant precision in the fuzzer (``kvlab.fuzz.case.ROW_INVARIANT``: bf16 weights, int8-w8a8 linears and
head, the compiled kernels): drawn last, every request judged by its own run alone in that precision (``AloneRuns``),
and a judge that fails where rows are computed together or a position's bits depend on the route its query took."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from fuzz_rig import needs_row_invariant_kernels

from kvlab.config import ConfigError, ModeConfig
from kvlab.engine import runner as engine_runner
from kvlab.fuzz import (
    PRECISIONS,
    ROW_INVARIANT,
    AloneRuns,
    CaseMeta,
    FuzzCase,
    FuzzConfig,
    FuzzRequest,
    FuzzSettings,
    TrialRunner,
    draw_case,
    run_campaign,
)
from kvlab.fuzz import generate as gen
from kvlab.fuzz.case import SAMPLING_DEFAULTS
from oracle_cache import mini

CASES = Path(__file__).parent / "cases"


def test_the_precision_is_drawn_last(monkeypatch):
    """Every other draw of a seed is what the builder drew before the precision was drawn, but what the row-invariant
    precision sets (its kernels, which serve NHD only) and draws after it (each request's sampling, only there)."""
    drawn = [draw_case(CaseMeta(), 4, i) for i in range(60)]
    assert {d.case.config.precision for d in drawn} == set(PRECISIONS)
    fast = [d.case for d in drawn if d.case.config.precision == ROW_INVARIANT]
    assert all(c.config.attention_backend == "cpp" and c.config.layout == "NHD" for c in fast)
    assert any(r.sampled for c in fast for r in c.requests) and any(not r.sampled for c in fast for r in c.requests)
    assert not any(r.sampled for d in drawn if d.case.config.precision == "fp32" for r in d.case.requests)
    monkeypatch.setattr(gen, "_precision", lambda c: "fp32")
    for i, d in enumerate(drawn):
        old = draw_case(CaseMeta(), 4, i)
        was = old.case.config
        config = dataclasses.replace(d.case.config, precision="fp32", attention_backend=was.attention_backend)
        greedy = tuple(dataclasses.replace(r, **SAMPLING_DEFAULTS) for r in d.case.requests)
        case = dataclasses.replace(d.case, config=dataclasses.replace(config, layout=was.layout), requests=greedy)
        assert case == old.case and d.choices[: len(old.choices)] == old.choices
        fp32 = d.case.config.precision == "fp32"
        assert len(d.choices) == len(old.choices) + 1 if fp32 else len(d.choices) > len(old.choices) + 1
    forced = [draw_case(CaseMeta(precision=ROW_INVARIANT), 4, i).case.config for i in range(10)]
    assert all(c.precision == ROW_INVARIANT for c in forced)


def test_an_fp32_case_reads_as_before_and_the_precision_round_trips():
    plain = FuzzCase(FuzzConfig(), (FuzzRequest((97, 98)),))
    assert "precision" not in plain.to_dict()["config"]  # an old case's JSON and digest
    assert not set(SAMPLING_DEFAULTS) & set(plain.to_dict()["requests"][0])
    fast = FuzzCase(FuzzConfig(attention_backend="cpp", precision=ROW_INVARIANT), plain.requests)
    assert FuzzCase.from_dict(fast.to_dict()) == fast and fast.digest() != plain.digest()
    drawn = FuzzCase(fast.config, (FuzzRequest((97, 98), temperature=0.8, top_p=0.9, seed=3),))
    assert FuzzCase.from_dict(drawn.to_dict()) == drawn and drawn.digest() != fast.digest()
    with pytest.raises(ConfigError, match="needs precision|need precision"):
        FuzzCase(FuzzConfig(), drawn.requests)  # the dense oracle cannot judge a draw
    with pytest.raises(ConfigError, match="needs a seed"):
        FuzzRequest((97,), temperature=0.8)
    with pytest.raises(ConfigError, match="top_p"):
        FuzzRequest((97,), temperature=0.8, seed=1, top_p=0.0)
    assert fast.config.mode == ModeConfig(quantization="int8-w8a8-head", attention_backend="cpp")
    assert fast.config.model_dtype == torch.bfloat16 and plain.config.model_dtype == torch.float32
    with pytest.raises(ConfigError, match="needs 'cpp'"):
        FuzzConfig(precision=ROW_INVARIANT)  # the reference attention computes a step's rows together
    with pytest.raises(ConfigError, match="precision"):
        FuzzConfig(attention_backend="cpp", precision="bf16")
    with pytest.raises(ConfigError, match="precision"):
        FuzzSettings(precision="int4")


@needs_row_invariant_kernels
def test_a_request_alone_is_what_the_mode_gives_it_alone():
    """The judge's tokens are the engine's own in that mode, one request at a time (the LLM front end's run): greedy,
    and a seeded sampled request's forks (fork i drawn from seed + i)."""
    from kvlab import LLM, SamplingParams

    alone = AloneRuns(mini())
    prompt = (97, 98, 99, 99, 98, 97, 97, 98, 99, 97, 99)
    config = FuzzConfig(block_size=4, attention_backend="cpp", precision=ROW_INVARIANT)
    llm = LLM(alone.loaded, quantization="int8-w8a8-head", attention_backend="cpp", block_size=4)
    greedy = FuzzRequest(prompt, max_tokens=9, n=2)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    want = list(llm.generate([list(prompt)], params, use_tqdm=False)[0].token_ids)
    assert alone.tokens(greedy, 1, config, 9) == want
    assert alone.tokens(greedy, 0, config, 4) == want[:4]  # greedy: a prefix, from the memo
    sampled = FuzzRequest(prompt, max_tokens=9, n=3, temperature=0.8, top_k=5, seed=11)
    params = SamplingParams(n=3, temperature=0.8, top_k=5, seed=11, max_tokens=9, ignore_eos=True)
    forks = sorted(llm.generate([list(prompt)], params, use_tqdm=False)[0].outputs, key=lambda c: c.index)
    assert [alone.tokens(sampled, i, config, 9) for i in range(3)] == [list(c.token_ids) for c in forks]
    assert len({tuple(c.token_ids) for c in forks}) > 1  # the forks drew apart: the index matters


@needs_row_invariant_kernels
def test_row_invariant_trials_pass_through_every_engine_path():
    """A campaign in the precision: every request produces exactly its tokens alone, through prefix hits, copies on
    write, preemption, chunked prefill, speculation, forks, aborts, salts, rounding caches and seeded sampling."""
    runner = TrialRunner(FuzzSettings(precision=ROW_INVARIANT, seed=3), loaded=mini())
    summary = run_campaign(runner.settings, 160, runner=runner)
    assert summary.failures == 0, [str(f) for r in summary.failing for f in r.failures]
    assert summary.coverage[ROW_INVARIANT] == summary.trials == 160
    paths = ("prefix-hit", "copy-on-write", "preemption", "chunked-prefill", "fork", "speculation", "rounding-cache")
    paths += ("sampling",)
    assert all(summary.coverage.get(p, 0) > 0 for p in paths), summary.coverage


@needs_row_invariant_kernels
def test_the_judge_fails_rows_computed_together():
    """Its teeth, on drawn cases: under HND the compiled attention steps aside for the reference one, which attends a
    step's rows together (SDPA over padded contexts), and requests' tokens then differ from their runs alone. Only the
    judge sees it: no read is foreign."""
    runner = TrialRunner(FuzzSettings(), loaded=mini())
    kinds = []
    for i in range(30):
        case = draw_case(CaseMeta(precision=ROW_INVARIANT), 1, i).case
        hnd = dataclasses.replace(case, config=dataclasses.replace(case.config, layout="HND"))
        kinds.append(runner.run_case(hnd).kinds)
    assert any(k == {"batch-variance"} for k in kinds) and all(k <= {"batch-variance"} for k in kinds)


@needs_row_invariant_kernels
def test_the_judge_fails_draws_that_depend_on_the_other_requests(monkeypatch):
    """Its teeth on sampling: seeded requests that draw from one generator shared by the engine (what a request without
    a seed does) instead of their own draw what the others left them, and their tokens differ from their runs alone."""
    from kvlab.engine import request as request_module

    shared = torch.Generator().manual_seed(0)
    monkeypatch.setattr(request_module, "make_generator", lambda seed: None if seed is None else shared)
    runner = TrialRunner(FuzzSettings(), loaded=mini())
    kinds = [runner.run_case(draw_case(CaseMeta(precision=ROW_INVARIANT), 5, i).case).kinds for i in range(20)]
    assert any(k == {"batch-variance"} for k in kinds) and all(k <= {"batch-variance"} for k in kinds)


ROUTING_CASES = (
    "row-invariant-hit-on-a-longer-prompt.json",
    "row-invariant-hit-on-a-shorter-prompt.json",
    "row-invariant-recompute-after-preemption.json",
)


@needs_row_invariant_kernels
def test_the_judge_fails_the_old_routing_on_the_cases_it_found(monkeypatch):
    """Before the fix, a chunk went where its request's whole prompt went fresh (the flash kernel from 8 prompt tokens,
    else the row kernel), outputs recomputed after a preemption included: the cases the fuzzer found then fail again
    under that routing, and pass under today's (tests/fuzz/test_regressions.py)."""
    plain = engine_runner.tiled_queries

    def old_routing(start: int, n: int, prompt_tokens: int, dtype: torch.dtype, flash: bool = False) -> int:
        if not flash:
            return plain(start, n, prompt_tokens, dtype, flash)
        return n if (prompt_tokens if start < prompt_tokens else n) >= 8 else 0

    monkeypatch.setattr(engine_runner, "tiled_queries", old_routing)
    runner = TrialRunner(FuzzSettings(), loaded=mini())  # its own memo: runs alone under the old routing too
    for name in ROUTING_CASES:
        assert runner.run_case(FuzzCase.load(CASES / name)).kinds == {"batch-variance"}, name


def test_a_prompt_over_another_requests_outputs_in_its_domain_is_held_to_its_length_only():
    """The one route by design (docs/serving.md): a prompt that begins with another request's prompt and output may
    find those outputs' K/V, computed as kernel rows, where alone it computes them with the flash kernel. Found on
    SmolLM2, whose outputs over the fuzzer's alphabet are often its letters (seed 16: 4 of 2,000 trials). Such a
    request is not held to its run alone; only within one salt (a request's outputs are never public)."""
    from kvlab.fuzz.trial import over_outputs

    first = FuzzRequest((97, 98, 99, 97, 98), max_tokens=3)
    follow = FuzzRequest((*first.prompt, 7, 9, 97), max_tokens=2)
    config = FuzzConfig(attention_backend="cpp", precision=ROW_INVARIANT)
    case = FuzzCase(config, (first, follow))
    assert over_outputs(case, {"r0": [[7, 9, 5]], "r1": [[1, 2]]}) == {1}
    assert over_outputs(case, {"r0": [[8, 9, 5]], "r1": [[1, 2]]}) == frozenset()  # another token follows the prompt
    apart = FuzzCase(config, (first, dataclasses.replace(follow, salt="tenant-2")))
    assert over_outputs(apart, {"r0": [[7, 9, 5]], "r1": [[1, 2]]}) == frozenset()  # another domain: never found


@needs_row_invariant_kernels
def test_a_trial_with_a_prompt_over_outputs_reports_it_and_judges_the_others(monkeypatch):
    """The exemption covers the prompt over the outputs and nothing else: with the runs alone made wrong, the judge
    fails the request whose outputs were run over, and still not the one over them."""
    runner = TrialRunner(FuzzSettings(), loaded=mini())
    config = FuzzConfig(block_size=2, attention_backend="cpp", precision=ROW_INVARIANT)
    first = FuzzRequest((97, 98, 99, 97, 98), max_tokens=4)
    [outputs] = runner.run_case(FuzzCase(config, (first,))).outputs["r0"]
    follow = FuzzRequest((*first.prompt, *outputs[:3], 97), arrival=8, max_tokens=3)
    case = FuzzCase(config, (first, follow))
    verdict = runner.run_case(case)
    assert verdict.ok and "over-outputs" in verdict.coverage
    plain = AloneRuns.tokens
    monkeypatch.setattr(AloneRuns, "tokens", lambda *a: [t + 1 for t in plain(*a)])
    wrong = runner.run_case(case)
    assert [f.message.split(",")[0] for f in wrong.failures] == ["request r0"]
    assert wrong.kinds == {"batch-variance"}
