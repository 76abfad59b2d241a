from __future__ import annotations

import functools

from kvlab.model import dense_generate, load_model
from kvlab.model.loader import LoadedModel


@functools.cache
def mini(name: str = "mini") -> LoadedModel:
    return load_model(name)


@functools.cache
def oracle(name: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """Greedy tokens of the dense no-cache reference for one request run alone (memoised across tests)."""
    return tuple(dense_generate(mini(name).model, list(prompt), max_tokens))


TIE_ATOL = 1e-4  # two logits closer than this are a tie that fp32 summation order may break either way


def check_against_oracle(name: str, prompt: tuple[int, ...], max_tokens: int, got: tuple[int, ...]) -> bool:
    """True if ``got`` equals the oracle's greedy tokens; False if they part at an exact near-tie (the dense
    top-2 logits within TIE_ATOL and ``got`` picked one of them), after which nothing more can be compared.
    Any other difference fails the test."""
    from kvlab.model import dense_logits

    ref = oracle(name, prompt, max_tokens)
    if got == ref:
        return True
    assert len(got) == len(ref), f"length {len(got)} != oracle's {len(ref)}"
    j = next(i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
    logits = dense_logits(mini(name).model, list(prompt) + list(ref[:j]), last_only=True)[-1]
    gap = float(logits[ref[j]] - logits[got[j]])
    assert gap < TIE_ATOL, f"diverged from the oracle at token {j}: picked {got[j]}, oracle {ref[j]} ({gap:.2e} better)"
    return False


def assert_bf16_paths_agree(outs: list, refs: list, logprob_tolerance: float = 0.05) -> None:
    """The rule for two bf16 paths that round in different places (so may part at a near-tie later on): the first
    two tokens are the same for every prompt, and every token both chose has a log-probability within
    ``logprob_tolerance``. ``outs``/``refs``: one CompletionOutput each, generated with ``logprobs=1``."""
    for o, r in zip(outs, refs, strict=True):
        assert o.token_ids[:2] == r.token_ids[:2]
        assert o.logprobs is not None and r.logprobs is not None
        for tok_o, tok_r, lo, lr in zip(o.token_ids, r.token_ids, o.logprobs, r.logprobs, strict=True):
            if tok_o != tok_r:
                break
            assert abs(lo[tok_o].logprob - lr[tok_r].logprob) < logprob_tolerance
