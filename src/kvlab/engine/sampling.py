"""Sampling parameters and the sampler.

Greedy (temperature 0, or below ``GREEDY_BELOW``) is one argmax over the whole batch; stochastic requests draw from
their own ``torch.Generator`` when they carry a seed, so a seeded request gives the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5


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

        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
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
        # vLLM's rule: a temperature this small is argmax in all but name, and dividing by it overflows.
        return self.temperature < GREEDY_BELOW


def make_generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


class SamplingError(RuntimeError):
    """One request's row could not be sampled (non-finite logits); fails that request only."""


@dataclass
class SampledBatch:
    tokens: list[int | None]  # None where the row failed
    errors: dict[int, str]  # row -> why it failed


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> SampledBatch:
    """One token per row of ``logits`` [B, vocab]. A row that cannot be sampled fails alone: its error is
    reported and every other row is sampled as if it were not there."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    greedy = torch.argmax(logits, dim=-1).tolist()
    out = SampledBatch([None] * len(params), {})
    for i, p in enumerate(params):
        try:
            if not finite[i]:
                raise SamplingError("the model produced non-finite logits for this request")
            out.tokens[i] = greedy[i] if p.greedy else sample_row(logits[i], p, generators[i])
        except Exception as exc:  # one row's failure must not take the batch down
            out.errors[i] = f"{type(exc).__name__}: {exc}"
    return out


def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Draw one token from finite ``logits`` [vocab] under ``p`` (not greedy)."""
    # float64: logits / temperature stays finite for every temperature the params accept (>= GREEDY_BELOW),
    # where float32 overflows to inf and softmax turns the row into NaN.
    scaled = logits.double() / p.temperature
    if p.top_k:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p. The most likely token always survives, by
        # index rather than by comparison: a top_p below the dtype's smallest number would drop it too.
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    total = float(probs.sum())
    if not total > 0 or not torch.isfinite(probs).all():
        raise SamplingError(f"the sampling distribution is empty or not finite (mass {total})")
    return int(torch.multinomial(probs / total, 1, generator=gen))
