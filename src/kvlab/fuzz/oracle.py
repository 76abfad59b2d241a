"""The dense oracle's greedy continuations, memoised per prompt, and the near-tie rule that judges them (wider over a
cache that rounds K/V, measured on the model: ``Oracle.tie``).

Prompts from a small alphabet repeat within a trial (identical prompts, forks) and across the trials a
worker runs, and the oracle recomputes the whole sequence for every token: computing a continuation once
per prompt and extending it only when a longer one is asked for is most of the fuzzer's speed.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.fuzz.case import ALPHABET
from kvlab.model import dense_generate, dense_logits
from kvlab.model.attention_api import DenseCausalAttention
from kvlab.model.llama import LlamaModel

# Two logits closer than this are a tie that fp32 summation order may break either way: the rule the test
# suite applies to every oracle comparison (tests/oracle_cache.py, check_against_oracle).
TIE_ATOL = 1e-4
# Over a cache that rounds K/V (bf16, fp8) the engine's fp32 K/V differ from the oracle's in their last bits
# (other summation orders: batched, chunked, speculative verification, compiled), and a value that close to a
# rounding boundary is stored as the neighbouring code. How far that moves the logits depends on the model and the
# dtype, so each oracle measures it on its own model: in every layer the K value and the V value nearest a rounding
# boundary are stored as the code across it (``_Flipped``), over CALIBRATION_PROMPTS prompts of the fuzzer's
# alphabet; the tie is TIE_MARGIN times the largest move (docs/fuzzing.md).
TIE_MARGIN = 4
CALIBRATION_PROMPTS = 20
_BITS = {1: torch.uint8, 2: torch.int16}  # a rounding dtype's bit patterns, by its width in bytes


def _flip_nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` with the one value nearest a rounding boundary of ``dtype`` replaced by the code on the boundary's
    other side (the next code in magnitude toward the value; never an inf or NaN code)."""
    flat = x.reshape(-1).float()
    stored = flat.to(dtype)
    width = stored.element_size()
    code = stored.view(_BITS[width]).to(torch.int32)
    sign = 1 << (8 * width - 1)
    away = flat.abs() > stored.float().abs()  # the value lies past its code, away from zero
    magnitude = code & (sign - 1)
    step = torch.where(away | (magnitude == 0), 1, -1)
    other_code = (magnitude + step) | (code & sign)
    other = other_code.to(_BITS[width]).view(dtype).float()
    gap = (other - stored.float()).abs()
    frac = (flat - stored.float()).abs() / gap  # 0: on a code; 0.5: on the boundary
    frac = torch.where(torch.isfinite(other) & (gap > 0) & torch.isfinite(frac), frac, -1.0)
    i = int(torch.argmax(frac))
    out = flat.clone()
    out[i] = other[i]
    return out.to(x.dtype).view(x.shape)


class _Flipped(DenseCausalAttention):
    """The oracle's attention with, in every layer, the K and the V value nearest a rounding boundary stored as the
    code across it: what a last-bit difference between the engine's fp32 K/V and the oracle's can do."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.kv_dtype is not None
        return super().__call__(layer, q, _flip_nearest(k, self.kv_dtype), _flip_nearest(v, self.kv_dtype))


@torch.inference_mode()
def rounding_tie(model: LlamaModel, kv_dtype: torch.dtype, prompts: Sequence[Sequence[int]]) -> float:
    """TIE_MARGIN x the largest move of a last-position logit over ``prompts`` when, in every layer, the K and the V
    value of a ``kv_dtype`` cache nearest a rounding boundary round the other way (never below fp32's TIE_ATOL)."""
    worst = 0.0
    for p in prompts:
        exact = dense_logits(model, p, last_only=True, kv_dtype=kv_dtype)[-1]
        hidden = model(
            torch.tensor(list(p), dtype=torch.long),
            torch.arange(len(p)),
            _Flipped([0, len(p)], model.config.num_heads, kv_dtype),
        )
        moved = model.compute_logits(hidden[-1:])[-1]
        worst = max(worst, float((exact - moved).abs().max()))
    return max(TIE_MARGIN * worst, TIE_ATOL)


@dataclass
class _Continuation:
    tokens: list[int]
    ties: list[frozenset[int]]  # per step: every token whose logit is within the tie of the argmax's


@dataclass(frozen=True)
class Mismatch:
    """Where a sequence first leaves the oracle's continuation for a token that is not a near-tie."""

    index: int
    got: int
    expected: int
    gap: float  # how much better the oracle's logit was
    atol: float  # the near-tie it is not (Oracle.tie of the cache's dtype)


class Oracle:
    """``dense_generate`` of one model, memoised per prompt (least recently used dropped past ``capacity``), and
    the near-tie of each cache dtype (``tie``), measured on prompts of ``alphabet`` (the fuzzer's)."""

    def __init__(self, model: LlamaModel, capacity: int = 20_000, alphabet: Sequence[int] = ALPHABET) -> None:
        self.model = model
        self.capacity = capacity
        rng = random.Random(0)
        self.calibration = [
            [rng.choice(list(alphabet)) for _ in range(rng.randint(4, 40))] for _ in range(CALIBRATION_PROMPTS)
        ]
        self._ties: dict[torch.dtype, float] = {}
        # (the cache's storage dtype, when it rounds K/V; the prompt) -> its continuation
        self._memo: OrderedDict[tuple[torch.dtype | None, tuple[int, ...]], _Continuation] = OrderedDict()
        self.computed_tokens = 0  # oracle tokens actually computed (the rest came from the memo)

    def tie(self, kv_dtype: torch.dtype | None) -> float:
        """How close two logits are to be a tie over a cache storing K/V in ``kv_dtype`` (None: the model's own
        dtype, fp32's TIE_ATOL); a rounding cache's is measured once (``rounding_tie``)."""
        if kv_dtype is None:
            return TIE_ATOL
        if kv_dtype not in self._ties:
            self._ties[kv_dtype] = rounding_tie(self.model, kv_dtype, self.calibration)
        return self._ties[kv_dtype]

    def continuation(self, prompt: Sequence[int], length: int, kv_dtype: torch.dtype | None = None) -> _Continuation:
        key = (kv_dtype, tuple(prompt))
        cont = self._memo.get(key)
        if cont is None:
            cont = self._memo[key] = _Continuation([], [])
            if len(self._memo) > self.capacity:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        if len(cont.tokens) < length:
            self._extend(key[1], cont, length - len(cont.tokens), kv_dtype)
        return cont

    def _extend(self, prompt: tuple[int, ...], cont: _Continuation, more: int, kv_dtype: torch.dtype | None) -> None:
        # The greedy continuation of prompt + its first k tokens is the rest of it, so extending is exact.
        out = dense_generate(self.model, [*prompt, *cont.tokens], more, return_logits=True, kv_dtype=kv_dtype)
        assert isinstance(out, tuple)
        tokens, logits = out
        tie = self.tie(kv_dtype)
        for tok, row in zip(tokens, logits, strict=True):
            near = torch.nonzero(row >= row[tok] - tie).flatten().tolist()
            cont.tokens.append(tok)
            cont.ties.append(frozenset(near))
        self.computed_tokens += more

    def tokens(self, prompt: Sequence[int], length: int, kv_dtype: torch.dtype | None = None) -> list[int]:
        return self.continuation(prompt, length, kv_dtype).tokens[:length]

    def first_mismatch(
        self, prompt: Sequence[int], got: Sequence[int], kv_dtype: torch.dtype | None = None
    ) -> Mismatch | None:
        """None when ``got`` is a prefix of the oracle's continuation, or leaves it only at an exact near-tie
        (after which nothing more can be compared: the contexts differ)."""
        if not got:
            return None
        cont = self.continuation(prompt, len(got), kv_dtype)
        for j, (a, b) in enumerate(zip(got, cont.tokens, strict=False)):
            if a == b:
                continue
            if a in cont.ties[j]:
                return None
            gap = self._gap(prompt, cont, j, a, kv_dtype)
            return Mismatch(j, a, b, gap, self.tie(kv_dtype))
        return None

    def _gap(self, prompt: Sequence[int], cont: _Continuation, j: int, got: int, kv_dtype: torch.dtype | None) -> float:
        row = dense_logits(self.model, [*prompt, *cont.tokens[:j]], last_only=True, kv_dtype=kv_dtype)[-1]
        if not 0 <= got < row.numel():
            return float("inf")
        return float(row[cont.tokens[j]] - row[got])
