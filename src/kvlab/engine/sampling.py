"""Sampling parameters (vLLM's names and semantics) and the sampler.

Per row, in vLLM's order: allowed token ids (every other id masked), bad words (the last token of a banned
sequence masked where the output ends in the rest of it), logit bias, min_tokens (stop ids masked),
repetition / frequency / presence penalties, temperature, min_p, top_k, top_p, then a draw. Greedy
(temperature 0, or below ``GREEDY_BELOW``) is an argmax of the processed logits, and a batch of plain greedy
rows is one argmax. Stochastic requests draw from their own ``torch.Generator`` when they carry a seed, so a
seeded request gives the same tokens whatever else shares its batch.

Log-probabilities are those of the *processed* distribution: after bias and penalties, and after the
temperature when sampling (vLLM's ``logprobs_mode="processed_logprobs"``); before min_p/top-k/top-p.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.model.fused import TopK
from kvlab.model.llama import LlamaModel
from kvlab.model.reference import dense_logits
from kvlab.tokenizer import Tokenizer

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5
# Up to this temperature, dividing fp32 logits by it in float64 keeps their order and their ties exactly (no
# overflow, no underflow to a tie): top_k's candidates can then be found on the raw logits, batched.
SHORTLIST_MAX_TEMPERATURE = 1e6
# The largest top_k found batched: the batch's topk takes the largest k among its rows, so one request asking for
# thousands would slow every row of its step (k = 49,151 over 64 x 49k logits: ~110 ms, k = 65: ~2 ms); larger
# top_k rows take the row-by-row path, at their own cost.
SHORTLIST_MAX_K = 64
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; raised before it touches any shared state."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)  # strings; matched across token boundaries
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    logprobs: int | None = None  # top-k log-probabilities per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None  # only these may be generated (None: any)
    bad_words: Sequence[str] = ()  # words never generated; the engine tokenises them (bad_words_token_ids)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # their token sequences, as the engine sets them
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (None: the whole prompt)
    skip_special_tokens: bool = True  # the output text leaves special tokens out
    spaces_between_special_tokens: bool = True  # vLLM's; only slow tokenizers use it: no effect here
    detokenize: bool = True  # False: no output text (""), which stop strings need
    # kvlab-specific: keep the logits each token was sampled from (for the experiment's tolerance check).
    return_logits: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}")

        def in_range(v: Any, lo: float, hi: float) -> bool:
            return _is_number(v) and lo <= v <= hi

        def optional_count(v: Any, hi: int) -> bool:
            return v is None or (_is_int(v) and 0 <= v <= hi)

        checks: list[tuple[str, bool, str]] = [
            ("n", _is_int(self.n) and self.n >= 1, "an int >= 1"),
            ("temperature", in_range(self.temperature, 0, math.inf), "a finite number >= 0 (0 = greedy)"),
            ("top_p", in_range(self.top_p, 0, 1) and self.top_p > 0, "in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= -1, "an int >= -1 (0 or -1 = off)"),
            ("min_p", in_range(self.min_p, 0, 1), "in [0, 1]"),
            ("presence_penalty", in_range(self.presence_penalty, -2, 2), "in [-2, 2]"),
            ("frequency_penalty", in_range(self.frequency_penalty, -2, 2), "in [-2, 2]"),
            ("repetition_penalty", in_range(self.repetition_penalty, 1e-9, math.inf), "> 0"),
            ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             "None or an int >= 1"),
            ("min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0, "an int >= 0"),
            ("seed", self.seed is None or _is_int(self.seed), "an int or None"),
            ("logprobs", optional_count(self.logprobs, MAX_LOGPROBS), f"None or an int in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", optional_count(self.prompt_logprobs, MAX_LOGPROBS),
             f"None or an int in [0, {MAX_LOGPROBS}]"),
        ]  # fmt: skip
        for name, ok, rule in checks:
            if not ok:
                raise bad(name, rule)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens={self.max_tokens}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "a non-empty string or a list of them")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids)
            if not allowed or not all(_is_int(t) and t >= 0 for t in allowed):
                raise bad("allowed_token_ids", "None or a non-empty list of token ids")
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        if not all(isinstance(w, str) and w for w in words):
            raise bad("bad_words", "a list of non-empty strings")
        object.__setattr__(self, "bad_words", words)
        sequences = tuple(tuple(int(t) for t in seq) for seq in self.bad_words_token_ids)
        if not all(seq and all(t >= 0 for t in seq) for seq in sequences):
            raise bad("bad_words_token_ids", "token sequences of one or more ids")
        object.__setattr__(self, "bad_words_token_ids", sequences)
        if self.truncate_prompt_tokens is not None and not (
            _is_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens >= 1
        ):
            raise bad("truncate_prompt_tokens", "None or an int >= 1")
        for flag in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "True or False")
        if not self.detokenize and self.stop:
            raise bad("detokenize", "True when stop strings are given (they are matched in the text)")
        if self.logit_bias is not None:
            if not all(_is_int(k) and _is_number(v) for k, v in self.logit_bias.items()):
                raise bad("logit_bias", "a mapping of token id -> finite number")
            # OpenAI's range: -100 bans a token, 100 all but forces it.
            clipped = {k: max(-100.0, min(100.0, float(v))) for k, v in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", clipped)

    @property
    def greedy(self) -> bool:
        # vLLM's rule: a temperature this small is argmax in all but name, and dividing by it overflows.
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def token_ids_used(self) -> set[int]:
        """Every token id the request names (checked against the vocabulary before it is queued)."""
        words = {t for seq in self.bad_words_token_ids for t in seq}
        return set(self.stop_token_ids) | set(self.logit_bias or ()) | set(self.allowed_token_ids or ()) | words


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences as vLLM makes them: the word alone and after a space (a word mid-text is
    usually one token with its space), without special tokens, each sequence once. Tokenising is the caller's
    work, off the engine thread where there is one (the server's engine loop does it with the prompt)."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def make_generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


class SamplingError(RuntimeError):
    """One request's row could not be sampled (non-finite logits); fails that request only."""


@dataclass(frozen=True)
class Logprob:
    """vLLM's shape: the log-probability of a token, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(frozen=True)
class RowContext:
    """What a row's processing needs to know about its request."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    stop_ids: frozenset[int]  # masked while fewer than min_tokens tokens are out (EOS and stop_token_ids)


@dataclass
class SampledBatch:
    tokens: list[int | None]  # None where the row failed
    errors: dict[int, str]  # row -> why it failed
    logprobs: list[dict[int, Logprob] | None]  # per row, when the request asked for them
    corrupted: set[int] = field(default_factory=set)  # rows that failed on non-finite logits

    def part(self, start: int, stop: int) -> SampledBatch:
        """Rows ``start .. stop - 1`` as a batch of their own (row ``start`` is row 0 there)."""
        return SampledBatch(
            self.tokens[start:stop],
            {i - start: e for i, e in self.errors.items() if start <= i < stop},
            self.logprobs[start:stop],
            {i - start for i in self.corrupted if start <= i < stop},
        )


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    contexts: Sequence[RowContext] | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    topk: TopK | None = None,
) -> SampledBatch:
    """One token per row of ``logits`` [B, vocab]. A row that cannot be sampled fails alone: its error is
    reported and every other row is sampled as if it were not there. ``argmax``: what finds every row's largest
    logit at once, ``torch.argmax(logits, dim=-1)``'s indices; ``topk``: the top_k rows' largest logits,
    ``torch.topk``'s values (the engine's compiled ones in the ``cpp`` mode, torch's by default)."""
    # A row is finite iff its largest and smallest entries are (amax/amin propagate NaN): two reductions
    # instead of isfinite's elementwise pass and all(), ~5 ms of a 64-row step with SmolLM2's 49k vocabulary.
    finite = (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))).tolist()
    out = SampledBatch([None] * len(params), {}, [None] * len(params))
    ctxs: Sequence[RowContext | None] = contexts if contexts is not None else [None] * len(params)
    plain = [_plain(p, ctx) for p, ctx in zip(params, ctxs, strict=True)]
    # One argmax for the batch's plain greedy rows, none where there are none (a pass over every row's vocabulary).
    greedy: list[int] = []
    if any(p.greedy and ok for p, ok in zip(params, plain, strict=True)):
        greedy = (argmax(logits) if argmax is not None else torch.argmax(logits, dim=-1)).tolist()
    shortlists = top_k_shortlists(logits, params, [i for i in range(len(params)) if finite[i] and plain[i]], topk)
    for i, p in enumerate(params):
        try:
            if not finite[i]:
                out.corrupted.add(i)
                raise SamplingError("the model produced non-finite logits for this request")
            ctx = ctxs[i]
            if plain[i]:
                if p.greedy:
                    out.tokens[i] = greedy[i]
                elif i in shortlists:
                    cand = shortlists[i]
                    if cand.numel() == 1:  # its one weight is exactly 1: the draw only advances the generator
                        out.tokens[i] = _draw_only(int(cand), generators[i])
                    else:
                        out.tokens[i] = sample_shortlist(logits[i], cand, p, generators[i])
                else:  # float64: logits / temperature stays finite for every temperature the params accept.
                    out.tokens[i] = sample_row(logits[i].double() / p.temperature, p, generators[i])
                continue
            assert ctx is not None
            x = processed_logits(logits[i], p, ctx)
            tok = int(torch.argmax(x)) if p.greedy else sample_row(x, p, generators[i])
            out.tokens[i] = tok
            if p.logprobs is not None:
                out.logprobs[i] = top_logprobs(x, p.logprobs, tok)
        except Exception as exc:  # one row's failure must not take the batch down
            out.errors[i] = f"{type(exc).__name__}: {exc}"
    return out


def top_k_shortlists(
    logits: torch.Tensor, params: Sequence[SamplingParams], plain: Sequence[int], topk: TopK | None = None
) -> dict[int, torch.Tensor]:
    """Row -> its top_k candidates (the ids of its k largest logits and of any tied with the k-th, ascending), for
    the rows of ``plain`` (finite, no per-row processing) that sample under a top_k of at most
    ``SHORTLIST_MAX_K``: one ``topk`` for them all, where ``sample_row`` makes a dozen passes over the vocabulary
    per row (~18 ms a 64-row step at top_k 1, docs/performance.md, "Sampling with top_k"). The same candidates as
    ``sampling_distribution`` finds on the scaled float64 row: the division keeps order and ties up to
    ``SHORTLIST_MAX_TEMPERATURE``. Empty if anything fails: the rows then take ``sample_row`` one by one, which
    fails a bad row alone."""
    vocab = logits.shape[-1]
    rows = [
        i
        for i in plain
        if not params[i].greedy
        and 0 < params[i].top_k < vocab
        and params[i].top_k <= SHORTLIST_MAX_K
        and params[i].temperature <= SHORTLIST_MAX_TEMPERATURE
    ]
    if not rows:
        return {}
    try:
        sub = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows)]
        ks = [params[i].top_k for i in rows]
        # k + 1 largest: where the (k+1)-th is below the k-th, the k largest are the candidates; where it ties,
        # that row compares its whole vocabulary with the k-th (rare: two equal logits at the cut).
        values, ids = topk(sub, max(ks) + 1) if topk is not None else torch.topk(sub, max(ks) + 1, dim=-1)
        at = torch.tensor(ks)[:, None]
        kth, after = values.gather(1, at - 1).squeeze(1), values.gather(1, at).squeeze(1)
        out: dict[int, torch.Tensor] = {}
        clean_by_k: dict[int, list[int]] = {}
        for j, (i, k, clean) in enumerate(zip(rows, ks, (after < kth).tolist(), strict=True)):
            if clean:
                clean_by_k.setdefault(k, []).append(j)
            else:
                out[i] = (sub[j] >= kth[j]).nonzero().squeeze(1)
        # One sort per top_k among the clean rows, not one per row (a row-by-row sort of 64 rows cost ~4 ms of a
        # step); a single candidate is its own sorted list.
        for k, js in clean_by_k.items():
            cand = ids[js, :k]
            for j, row in zip(js, (cand.sort(dim=1).values if k > 1 else cand).unbind(0), strict=True):
                out[rows[j]] = row
    except Exception:  # the row-by-row path serves, and reports a failing row alone
        return {}
    return out


def _plain(p: SamplingParams, ctx: RowContext | None) -> bool:
    if ctx is None:
        return True
    return not (
        p.penalised
        or p.logit_bias
        or p.logprobs is not None
        or (p.min_tokens and len(ctx.output_ids) < p.min_tokens)
        or p.allowed_token_ids is not None
        or p.bad_words_token_ids
    )


def processed_logits(row: torch.Tensor, p: SamplingParams, ctx: RowContext) -> torch.Tensor:
    """Allowed ids, bad words, bias, min_tokens, penalties and (when sampling) temperature, in float64."""
    x = row.double().clone()
    if p.allowed_token_ids is not None:
        keep = torch.full_like(x, float("-inf"))
        ids = torch.tensor(p.allowed_token_ids, dtype=torch.long)
        keep[ids] = x[ids]
        x = keep
    for seq in p.bad_words_token_ids:
        head = list(seq[:-1])
        if not head or list(ctx.output_ids[-len(head) :]) == head:
            x[seq[-1]] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype)
    if len(ctx.output_ids) < p.min_tokens and ctx.stop_ids:
        x[torch.tensor(sorted(ctx.stop_ids), dtype=torch.long)] = float("-inf")
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(ctx.prompt_ids) | set(ctx.output_ids)), dtype=torch.long)
        if seen.numel():
            s = x[seen]
            x[seen] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and ctx.output_ids:
        counts = torch.bincount(torch.tensor(list(ctx.output_ids), dtype=torch.long), minlength=x.numel())
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return x if p.greedy else x / p.temperature


def top_logprobs(x: torch.Tensor, k: int, sampled: int, log_probs: bool = False) -> dict[int, Logprob]:
    """The ``k`` most likely tokens of the distribution of logits ``x`` (already log-probabilities with
    ``log_probs``) and the sampled one."""
    lp = x if log_probs else torch.log_softmax(x, dim=-1)
    out: dict[int, Logprob] = {}
    if k:
        values, ids = torch.topk(lp, k)
        for rank, (tok, v) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), 1):
            out[tok] = Logprob(v, rank)
    if sampled not in out:
        out[sampled] = Logprob(float(lp[sampled]), int((lp > lp[sampled]).sum()) + 1)
    return out


def sample_row(scaled: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Draw one token from finite float64 logits [vocab] already divided by the temperature, under ``p``'s
    min_p, top_k and top_p."""
    candidates, probs = sampling_distribution(scaled, p)
    return _draw(candidates, probs, gen)


def sample_shortlist(
    row: torch.Tensor, candidates: torch.Tensor, p: SamplingParams, gen: torch.Generator | None
) -> int:
    """``sample_row`` of ``row`` (raw logits [vocab]) given its top_k ``candidates`` (``top_k_shortlists``): the same
    float64 values, weights and draw, computed on the candidates alone."""
    return _draw(candidates, _weights(row[candidates].double() / p.temperature, p), gen)


def _draw_only(candidate: int, gen: torch.Generator | None) -> int:
    """``_draw`` of a single candidate, whose one weight is exactly 1: the generator advances as ``multinomial``
    would have advanced it (a seeded request's later draws stay the same), without the call. For one sample
    ``multinomial`` draws one Exp(1) variate per weight (``exponential_`` on a tensor of the weights' shape and
    dtype, then an argmax), after checks of the weights that cost ten times the draw (docs/performance.md, "Sampling
    with top_k"); the same ``exponential_`` on one float64 advances the generator alike (the generator states are
    compared in tests/engine/test_sampling_params.py)."""
    torch.empty(1, dtype=torch.float64).exponential_(1, generator=gen)
    return candidate


def _draw(candidates: torch.Tensor | None, probs: torch.Tensor, gen: torch.Generator | None) -> int:
    total = float(probs.sum())
    if not total > 0 or not torch.isfinite(probs).all():
        raise SamplingError(f"the sampling distribution is empty or not finite (mass {total})")
    drawn = int(torch.multinomial(probs / total, 1, generator=gen))
    return drawn if candidates is None else int(candidates[drawn])


def sampling_distribution(scaled: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(candidates, weights): the token ids that may be drawn (None: the whole vocabulary) and their unnormalised
    probabilities under ``p``'s min_p, top_k and top_p, from float64 logits already divided by the temperature."""
    candidates: torch.Tensor | None = None
    if p.top_k and p.top_k < scaled.numel():
        # Only the top_k tokens (and any tied with the k-th) can be drawn: the rest of the work runs on those
        # few, not the whole vocabulary (docs/performance.md, "Sampling with top_k").
        kth = torch.topk(scaled, p.top_k).values[-1]
        candidates = (scaled >= kth).nonzero().squeeze(1)
        scaled = scaled[candidates]
    return candidates, _weights(scaled, p)


def _weights(scaled: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Unnormalised probabilities of the logits ``scaled`` (already cut to top_k's candidates) under min_p and top_p."""
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p. The most likely token always survives, by
        # index rather than by comparison: a top_p below the dtype's smallest number would drop it too.
        # A stable sort: of tied tokens at the cut, the lower ids are kept, with or without top_k's candidates.
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p * sorted_probs.sum()
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def prompt_logprobs(model: LlamaModel, ids: Sequence[int], k: int) -> list[dict[int, Logprob] | None]:
    """vLLM's ``prompt_logprobs``: each prompt token's log-probability given the ones before it, with the ``k`` most
    likely (the first token has none), from a dense pass over the prompt: the cache holds K/V, not logits, and a
    cached prefix was never computed for this request."""
    with torch.inference_mode():
        lp = torch.log_softmax(dense_logits(model, ids).double(), dim=-1)
    return [None, *(top_logprobs(lp[pos - 1], k, ids[pos], log_probs=True) for pos in range(1, len(ids)))]
