"""The memoised oracle and the judge: equal to dense_generate, extended exactly, near-ties tolerated the way
the suite tolerates them; a safe case passes every check and an unsafe one is caught."""

from __future__ import annotations

from kvlab.fuzz import FuzzCase, FuzzConfig, FuzzRequest, Oracle, run_case
from kvlab.model import dense_generate
from oracle_cache import mini

PROMPT = (97, 98, 99, 97, 98, 99, 97)


def test_oracle_is_dense_generate_memoised_and_extended_exactly():
    oracle = Oracle(mini().model)
    short = oracle.tokens(PROMPT, 3)
    assert oracle.computed_tokens == 3
    assert oracle.tokens(PROMPT, 2) == short[:2] and oracle.computed_tokens == 3  # from the memo
    longer = oracle.tokens(PROMPT, 7)
    assert oracle.computed_tokens == 7  # only the 4 missing tokens were computed
    assert longer[:3] == short
    assert longer == dense_generate(mini().model, list(PROMPT), 7)


def test_first_mismatch_tolerates_exact_near_ties_only():
    oracle = Oracle(mini().model)
    ref = oracle.tokens(PROMPT, 5)
    assert oracle.first_mismatch(PROMPT, ref) is None
    assert oracle.first_mismatch(PROMPT, ref[:2]) is None  # an aborted request: a prefix is right
    wrong = next(t for t in range(256) if t != ref[2])
    mm = oracle.first_mismatch(PROMPT, [*ref[:2], wrong, *ref[3:]])
    assert mm is not None and (mm.index, mm.got, mm.expected) == (2, wrong, ref[2]) and mm.gap > 1e-4
    # A token within 1e-4 of the argmax is a tie fp32 summation order may break either way: accepted, and
    # nothing after it is compared (the contexts differ from there on).
    oracle.continuation(PROMPT, 5).ties[2] = frozenset({ref[2], wrong})
    assert oracle.first_mismatch(PROMPT, [*ref[:2], wrong, 0, 0]) is None


def _case(**cfg) -> FuzzCase:
    base = (97, 98, 99, 97, 98, 99, 97, 98)
    return FuzzCase(
        FuzzConfig(**{"block_size": 4, "num_blocks": 14, "max_num_batched_tokens": 5, **cfg}),
        (
            FuzzRequest(base, arrival=0, max_tokens=4, n=2),
            FuzzRequest(base[:4] + (99,), arrival=1, max_tokens=3),  # shares exactly one block
            FuzzRequest(base[:5], arrival=1, max_tokens=3, abort_at=3),  # one past the boundary, aborted
            FuzzRequest(base, arrival=2, max_tokens=2, salt="tenant-1"),  # identical, other tenant
        ),
    )


def test_a_safe_case_passes_every_check(safe_runner):
    for cfg in ({}, {"prefix_granularity": "block", "hash_algo": "xxh64", "layout": "HND"}):
        case = _case(**cfg)
        verdict = run_case(mini(), case, safe_runner.oracle)
        assert verdict.ok, verdict.failures
        outs = verdict.outputs
        assert len(outs["r0"]) == 2 and outs["r0"][0] == outs["r0"][1]  # greedy n=2: both the oracle's
        assert outs["r0"][0][:2] == outs["r3"][0]
        assert len(outs["r2"][0]) < 3  # aborted while decoding


def test_an_unsafe_strategy_is_caught_by_the_sanitizer(safe_runner):
    # B shares A's partial second block and writes its prompt's last token where A writes its first output
    # token: without copy-on-write one of them reads the other's K/V there.
    a = FuzzRequest(PROMPT[:6], max_tokens=3)
    b = FuzzRequest((*PROMPT[:6], 99), arrival=1, max_tokens=3)
    case = FuzzCase(FuzzConfig(block_size=4, num_blocks=12), (a, b), strategy="shared-no-cow")
    verdict = run_case(mini(), case, safe_runner.oracle)
    assert "foreign-read" in verdict.kinds
    assert verdict.root_causes and "written by request" in verdict.root_causes[0]


def test_a_long_prefill_in_one_token_chunks_is_progress_not_a_stuck_engine(safe_runner):
    # 60 steps of prefill sample nothing (advance() names no group): the fuzzer must not call that stuck.
    case = FuzzCase(FuzzConfig(block_size=4, num_blocks=20, max_num_batched_tokens=1), (FuzzRequest((97,) * 60),))
    verdict = run_case(mini(), case, safe_runner.oracle)
    assert verdict.ok, verdict.failures
    assert verdict.steps == 60  # one prompt token per step; the last one also yields the only output token


# The mini model's fp32 greedy tokens after this prompt leave the fp8-rounded ones at the third token.
FP8_PROMPT = (98, 98, 98, 100, 97, 97, 99, 100)


def test_a_rounding_cache_is_judged_against_the_oracle_that_rounds_alike(safe_runner) -> None:
    """Over an fp8 cache the engine's tokens are the rounding oracle's, not fp32's: judged against the plain
    oracle this case would be a wrong token; judged right it passes on both attention paths, and the plain
    and rounded continuations are memoised apart."""
    import torch

    oracle = safe_runner.oracle
    plain = oracle.tokens(FP8_PROMPT, 6)
    rounded = oracle.tokens(FP8_PROMPT, 6, torch.float8_e4m3fn)
    assert plain[:2] == rounded[:2] and plain[2] != rounded[2]
    assert rounded == dense_generate(mini().model, list(FP8_PROMPT), 6, kv_dtype=torch.float8_e4m3fn)
    for backend in ("reference", "cpp"):
        case = FuzzCase(
            FuzzConfig(num_blocks=12, max_num_seqs=2, kv_cache_dtype="fp8", attention_backend=backend),
            (FuzzRequest(FP8_PROMPT, max_tokens=6, n=2), FuzzRequest(FP8_PROMPT[:5], arrival=1, max_tokens=3)),
        )
        verdict = run_case(mini(), case, oracle)
        assert verdict.ok, verdict.failures
        assert verdict.outputs["r0"] == [rounded, rounded] and "rounding-cache" in verdict.coverage
        assert oracle.first_mismatch(FP8_PROMPT, verdict.outputs["r0"][0]) is not None  # fp32's judge would fail it


def test_a_rounding_caches_tie_is_measured_on_the_model_and_covers_prompts_it_did_not_see() -> None:
    """Over a rounding cache the oracle's tie is what last-bit differences in fp32 K/V move the logits, measured on
    its own model (rounding_tie over its calibration prompts, with a margin): on other prompts the same jitter
    moves them less than the tie, most tokens are still decided by more than the tie (it stays below the median gap
    between the two best logits), and a wrong token past it is caught."""
    import random
    import statistics

    import torch

    from kvlab.fuzz.oracle import TIE_ATOL, TIE_MARGIN, rounding_tie
    from kvlab.model import dense_logits

    model = mini().model
    oracle = Oracle(model)
    rng = random.Random(1)
    unseen = [[rng.choice((97, 98, 99)) for _ in range(rng.randint(4, 40))] for _ in range(40)]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        tie = oracle.tie(dtype)
        best_two = [torch.topk(dense_logits(model, p, last_only=True, kv_dtype=dtype)[-1], 2).values for p in unseen]
        assert TIE_ATOL < tie < statistics.median(float(a - b) for a, b in best_two), dtype
        assert rounding_tie(model, dtype, unseen) / TIE_MARGIN < tie, dtype
    assert oracle.tie(None) == TIE_ATOL
    ref = oracle.tokens(FP8_PROMPT, 4, torch.float8_e4m3fn)
    wrong = next(t for t in range(256) if t not in oracle.continuation(FP8_PROMPT, 4, torch.float8_e4m3fn).ties[1])
    mm = oracle.first_mismatch(FP8_PROMPT, [ref[0], wrong], torch.float8_e4m3fn)
    assert mm is not None and mm.index == 1 and mm.gap > mm.atol == oracle.tie(torch.float8_e4m3fn)
