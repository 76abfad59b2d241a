"""The dense oracle's greedy continuations, memoised per prompt, and the near-tie rule that judges them.

Prompts from a small alphabet repeat within a trial (identical prompts, forks) and across the trials a
worker runs, and the oracle recomputes the whole sequence for every token: computing a continuation once
per prompt and extending it only when a longer one is asked for is most of the fuzzer's speed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.model import dense_generate, dense_logits
from kvlab.model.llama import LlamaModel

# Two logits closer than this are a tie that fp32 summation order may break either way: the rule the test
# suite applies to every oracle comparison (tests/oracle_cache.py, check_against_oracle).
TIE_ATOL = 1e-4


@dataclass
class _Continuation:
    tokens: list[int]
    ties: list[frozenset[int]]  # per step: every token whose logit is within TIE_ATOL of the argmax's


@dataclass(frozen=True)
class Mismatch:
    """Where a sequence first leaves the oracle's continuation for a token that is not a near-tie."""

    index: int
    got: int
    expected: int
    gap: float  # how much better the oracle's logit was


class Oracle:
    """``dense_generate`` of one model, memoised per prompt (least recently used dropped past ``capacity``)."""

    def __init__(self, model: LlamaModel, capacity: int = 20_000) -> None:
        self.model = model
        self.capacity = capacity
        self._memo: OrderedDict[tuple[int, ...], _Continuation] = OrderedDict()
        self.computed_tokens = 0  # oracle tokens actually computed (the rest came from the memo)

    def continuation(self, prompt: Sequence[int], length: int) -> _Continuation:
        key = tuple(prompt)
        cont = self._memo.get(key)
        if cont is None:
            cont = self._memo[key] = _Continuation([], [])
            if len(self._memo) > self.capacity:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        if len(cont.tokens) < length:
            self._extend(key, cont, length - len(cont.tokens))
        return cont

    def _extend(self, prompt: tuple[int, ...], cont: _Continuation, more: int) -> None:
        # The greedy continuation of prompt + its first k tokens is the rest of it, so extending is exact.
        out = dense_generate(self.model, [*prompt, *cont.tokens], more, return_logits=True)
        assert isinstance(out, tuple)
        tokens, logits = out
        for tok, row in zip(tokens, logits, strict=True):
            near = torch.nonzero(row >= row[tok] - TIE_ATOL).flatten().tolist()
            cont.tokens.append(tok)
            cont.ties.append(frozenset(near))
        self.computed_tokens += more

    def tokens(self, prompt: Sequence[int], length: int) -> list[int]:
        return self.continuation(prompt, length).tokens[:length]

    def first_mismatch(self, prompt: Sequence[int], got: Sequence[int]) -> Mismatch | None:
        """None when ``got`` is a prefix of the oracle's continuation, or leaves it only at an exact near-tie
        (after which nothing more can be compared: the contexts differ)."""
        if not got:
            return None
        cont = self.continuation(prompt, len(got))
        for j, (a, b) in enumerate(zip(got, cont.tokens, strict=False)):
            if a == b:
                continue
            if a in cont.ties[j]:
                return None
            gap = self._gap(prompt, cont, j, a)
            return Mismatch(j, a, b, gap)
        return None

    def _gap(self, prompt: Sequence[int], cont: _Continuation, j: int, got: int) -> float:
        row = dense_logits(self.model, [*prompt, *cont.tokens[:j]], last_only=True)[-1]
        if not 0 <= got < row.numel():
            return float("inf")
        return float(row[cont.tokens[j]] - row[got])
