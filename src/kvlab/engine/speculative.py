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
    occurrence of the last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that recurs."""
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
