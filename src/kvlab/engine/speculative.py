"""Prompt-lookup drafting (vLLM's ``ngram`` speculative method) and the greedy check of a draft.

The drafter looks in a request's own tokens only (its prompt and what it generated): a draft can never carry
another request's tokens. Verification is exact for greedy requests: a draft token is kept while it equals the
token the model picks at its position, so the output is the plain run's, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlab.config import SpeculativeConfig


def propose(tokens: Sequence[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to ``min(limit, num_speculative_tokens)`` draft tokens: those that followed the most recent earlier
    occurrence of the last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that recurs. The
    reference the engine's ``NgramIndex`` is held to."""
    k = min(limit, config.num_speculative_tokens)
    total = len(tokens)
    if k <= 0 or total < config.prompt_lookup_min + 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    # Where an earlier occurrence can end: at the last token's value, with at least one token after it.
    ends = np.flatnonzero(seq[:-1] == seq[-1])[::-1]
    for n in range(min(config.prompt_lookup_max, total - 1), config.prompt_lookup_min - 1, -1):
        suffix = seq[total - n :]
        for end in ends[ends >= n - 1]:
            if np.array_equal(seq[end - n + 1 : end + 1], suffix):
                return seq[end + 1 : end + 1 + k].tolist()
    return []


class NgramIndex:
    """``propose`` for one request, kept as its tokens grow: each token value's positions (those with a token after
    them), appended as the request's tokens are. A lookup walks the positions of the last token's value from the
    most recent back, measuring how many tokens before each agree with the context's end; the first that agrees on
    ``prompt_lookup_max`` wins, else the most recent of the longest. The same draft as ``propose`` (a property test
    holds them equal), in time that grows with the last token's occurrences, not with the context: ``propose``
    converts and scans the whole context at every step (docs/speculative.md)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # the request's tokens so far, prompt then output
        self._positions: dict[int, list[int]] = {}  # token -> where it occurs, ascending, the last token excluded

    def propose(self, prompt: Sequence[int], output: Sequence[int], config: SpeculativeConfig, limit: int) -> list[int]:
        """``propose(prompt + output, config, limit)``; ``prompt + output`` must extend the tokens of the last
        call (a request's tokens only ever grow)."""
        self._extend(prompt, output)
        tokens, total = self.tokens, len(self.tokens)
        k = min(limit, config.num_speculative_tokens)
        if k <= 0 or total < config.prompt_lookup_min + 1:
            return []
        longest = min(config.prompt_lookup_max, total - 1)
        best, best_len = -1, 0
        for end in reversed(self._positions.get(tokens[-1], ())):
            n = 1  # tokens[end] == tokens[-1]
            while n < longest and n <= end and tokens[end - n] == tokens[total - 1 - n]:
                n += 1
            if n > best_len:
                best, best_len = end, n
                if n == longest:
                    break
        if best_len < config.prompt_lookup_min:
            return []
        return tokens[best + 1 : best + 1 + k]

    def _extend(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        had = len(self.tokens)
        if had > len(prompt) + len(output):
            raise ValueError(f"NgramIndex: the request's tokens shrank from {had} to {len(prompt) + len(output)}")
        if had < len(prompt):
            self.tokens += prompt[had:]
        self.tokens += output[max(0, had - len(prompt)) :]
        # Every token but the (new) last one can now be the end of an earlier occurrence.
        for pos in range(max(0, had - 1), len(self.tokens) - 1):
            self._positions.setdefault(self.tokens[pos], []).append(pos)


@dataclass
class SpecDecodeStats:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_*``): drafts proposed and scored, draft tokens
    in them, those accepted, and the accepted count at each draft position (as many as a draft may hold; none
    without speculation)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def positions(cls, num_speculative_tokens: int) -> SpecDecodeStats:
        return cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
