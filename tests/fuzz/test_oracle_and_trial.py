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
