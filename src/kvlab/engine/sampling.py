"""Sampling parameters and the sampler.

Greedy (temperature 0) is an argmax over the whole batch at once; stochastic requests draw from
their own ``torch.Generator`` when they carry a seed, so a seeded request gives the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; raised before it touches any shared state."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    # kvlab-specific: keep the logits each token was sampled from (for the experiment's tolerance check).
    return_logits: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", ">= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", ">= 0 (0 = off)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an int >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an int or None")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` [B, vocab]."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_one(logits[i], p, generators[i])
    return tokens


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    scaled = logits.float() / p.temperature
    if p.top_k:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))
