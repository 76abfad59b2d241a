"""Drawing a case: one builder, two sources of choices.

``build_case`` asks a ``Chooser`` for every decision (a bounded integer or a boolean). A trial draws its
case from ``RandomChooser``, seeded by (campaign seed, trial index) and recording each choice; hypothesis
replays that record through ``HypothesisChooser`` and shrinks it (``kvlab.fuzz.shrink``). Because both
run the same builder, a recorded trial is exactly a hypothesis example, and every case the shrinker tries
is one the generator could have drawn.

The workload is made for collisions: prompts come from a tiny alphabet, and most are cut from an earlier
prompt exactly on, one before or one after a block boundary (or are identical to it, or extend it), so
prefix sharing, partial-block copy-on-write and eviction of shared blocks happen in most trials. Half the
requests declare a public prefix (whole blocks, or any length), so blocks shared across salts, and private
blocks that must never be, meet in many trials too; some pools promote what both salts computed; some trials
speculate (prompt-lookup drafts from the tiny alphabet are often rejected, and often match another prompt).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from kvlab.config import ATTENTION_BACKENDS, ConfigError, admission_blocks, blocks_for, check_int
from kvlab.fuzz.case import ALPHABET, PRECISIONS, ROW_INVARIANT, FuzzCase, FuzzConfig, FuzzRequest

T = TypeVar("T")
Choice = int | bool
PATTERNS = 1 << 16  # distinct letter patterns a text may be drawn from


class Chooser(Protocol):
    def integer(self, lo: int, hi: int, weights: Sequence[float] | None = None) -> int:
        """An int in [lo, hi]; ``weights`` (one per value) bias the random draw only, not what shrinks."""
        ...

    def boolean(self, p: float) -> bool:
        """True with probability ``p`` when drawn at random (shrinking prefers False)."""
        ...

    def span(self, build: Callable[[Chooser], T]) -> T:
        """Run ``build`` as one unit, so the shrinker can treat its choices together."""
        ...


class RandomChooser:
    """Seeded draws, each recorded as the choice hypothesis would replay for it."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.choices: list[Choice] = []
        self.span_starts: list[int] = []  # index of each span's first choice (a request's ``keep`` flag)

    def integer(self, lo: int, hi: int, weights: Sequence[float] | None = None) -> int:
        if weights is None:
            v = self.rng.randint(lo, hi)
        else:
            v = lo + self.rng.choices(range(hi - lo + 1), weights=list(weights)[: hi - lo + 1])[0]
        self.choices.append(v)
        return v

    def boolean(self, p: float) -> bool:
        v = self.rng.random() < p
        self.choices.append(v)
        return v

    def span(self, build: Callable[[Chooser], T]) -> T:
        self.span_starts.append(len(self.choices))
        return build(self)


class ReplayChooser:
    """Replays a recorded choice sequence (edited by the shrinker's first pass) through the builder."""

    def __init__(self, choices: Sequence[Choice]) -> None:
        self._choices = list(choices)
        self._pos = 0

    def _next(self) -> Choice:
        self._pos += 1
        return self._choices[self._pos - 1]

    def integer(self, lo: int, hi: int, weights: Sequence[float] | None = None) -> int:
        return int(self._next())

    def boolean(self, p: float) -> bool:
        return bool(self._next())

    def span(self, build: Callable[[Chooser], T]) -> T:
        return build(self)


@dataclass(frozen=True)
class Drawn:
    """A trial's case with the choices that built it."""

    case: FuzzCase
    choices: tuple[Choice, ...]
    keep_at: tuple[int, ...]  # position in ``choices`` of each request slot's ``keep`` flag


@dataclass(frozen=True)
class WorkloadBounds:
    """How big a drawn trial may get. Small by design: a bug that needs a big case is rare, and a small one
    runs in tens of milliseconds, so a campaign tries many more schedules."""

    max_requests: int = 4
    alphabet: tuple[int, ...] = ALPHABET  # "abc" in the byte tokenizer: prefixes collide all the time
    max_prompt: int = 40
    max_output: int = 12
    max_arrival: int = 6
    max_n: int = 3
    max_abort_delay: int = 12
    # Pool tightness in steps: 0 = just what the largest request alone needs (others queue, cached blocks
    # are evicted), max_slack = the other prompts fit too but not their growth (running requests preempt).
    max_slack: int = 4
    # Listed simplest first: shrinking walks towards the front.
    block_sizes: tuple[int, ...] = (4, 2, 8, 16, 1, 3)
    batched_tokens: tuple[int, ...] = (2048, 16, 8, 5, 3)  # small budgets force chunked prefill
    allow_empty: bool = False  # zero-length prompts: only the empty-request strategy accepts them

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_prompt", "max_output", "max_n"):
            check_int("WorkloadBounds", name, getattr(self, name), 1)
        for name in ("max_arrival", "max_abort_delay", "max_slack"):
            check_int("WorkloadBounds", name, getattr(self, name), 0)
        for name in ("alphabet", "block_sizes", "batched_tokens"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise ConfigError(f"WorkloadBounds.{name} must be a non-empty tuple of ints >= 0, got {values!r}")
        if min(self.block_sizes) < 1 or min(self.batched_tokens) < 1:
            raise ConfigError("WorkloadBounds.block_sizes and batched_tokens must be >= 1")


@dataclass(frozen=True)
class CaseMeta:
    """What a case carries besides its draws: the model it runs on and the strategy applied over it."""

    model: str = "mini"
    model_seed: int = 0
    strategy: str | None = None
    bounds: WorkloadBounds = field(default_factory=WorkloadBounds)
    commit_rejected_drafts: bool = False  # unsafe: every case speculates and leaves rejected drafts findable
    kv_cache_dtype: str | None = None  # every case's cache stores K/V so (None: drawn per case)
    precision: str | None = None  # every case computes in it (PRECISIONS; None: drawn per case)


def trial_rng(seed: int, index: int) -> random.Random:
    # A string seed is hashed with SHA-512 by random.Random: the same case in every process and on every
    # machine (PYTHONHASHSEED does not enter), which is what makes serial, pool and Ray runs agree.
    return random.Random(f"kvlab-fuzz/{seed}/{index}")


def draw_case(meta: CaseMeta, seed: int, index: int) -> Drawn:
    chooser = RandomChooser(trial_rng(seed, index))
    case = build_case(chooser, meta)
    # Request spans are the only spans build_case opens, and each opens with its keep flag.
    return Drawn(case, tuple(chooser.choices), tuple(chooser.span_starts))


def build_case(c: Chooser, meta: CaseMeta) -> FuzzCase:
    b = meta.bounds
    # Requests are drawn before the other knobs: the shrinker tries to simplify spans front to back and
    # dropping a request is the reduction that pays most. The block size comes first only because the
    # prompts' cuts depend on it.
    bs = b.block_sizes[c.integer(0, len(b.block_sizes) - 1)]
    # One request alone shares nothing but its forks: most trials get several.
    count = c.integer(1, b.max_requests, weights=[1.0] + [2.0] * (b.max_requests - 1))
    prompts: list[tuple[int, ...]] = []
    drawn = [c.span(lambda ch: _request(ch, b, bs, prompts)) for _ in range(count)]
    layout = ("NHD", "HND")[c.integer(0, 1)]
    granularity = ("token", "block")[c.integer(0, 1)]
    algo = ("sha256", "xxh64")[c.integer(0, 1)]
    budget = b.batched_tokens[c.integer(0, len(b.batched_tokens) - 1)]
    seqs = c.integer(1, b.max_requests, weights=[0.1] + [0.3] * (b.max_requests - 1))  # 1 seat: no concurrency
    slack = c.integer(0, b.max_slack)
    # Drawn last, so that adding it left every earlier draw of a seed as it was.
    backend = ATTENTION_BACKENDS[c.integer(0, len(ATTENTION_BACKENDS) - 1)]
    # Drawn after the backend, for the same reason: one per request slot.
    public = [_public_prefix(c, r, bs) for _, r in drawn]
    # Every slot is drawn even when dropped, so dropping one (the shrinker flips ``keep``) leaves the others'
    # prompts as they were. A case needs one request: with none kept, the first stands in.
    slots = [(keep, replace(r, public_prefix_tokens=p)) for (keep, r), p in zip(drawn, public, strict=True)]
    promote_after = _promotion(c)  # drawn after the public prefixes, for the same reason
    if promote_after is not None:
        # Promotion needs two salts computing one chain: every request gets one, the unsalted taking turns.
        slots = [(keep, r if r.salt else replace(r, salt=f"tenant-{1 + i % 2}")) for i, (keep, r) in enumerate(slots)]
    reqs = [r for keep, r in slots if keep] or [slots[0][1]]
    speculative = _speculation(c, meta.commit_rejected_drafts)  # drawn after those, for the same reason
    # Drawn last, for the same reason, and drawn even where the campaign fixes it: the same choices either way.
    drawn_dtype = _cache_dtype(c)
    kv_cache_dtype = drawn_dtype if meta.kv_cache_dtype is None else meta.kv_cache_dtype
    drawn_precision = _precision(c)  # drawn last, for the same reason
    precision = drawn_precision if meta.precision is None else meta.precision
    if precision == ROW_INVARIANT:
        # The mode's kernels: with them every row is computed on its own. Under HND they step aside for the reference
        # attention, which computes a step's rows together (docs/fuzzing.md, "The row-invariant precision").
        backend, layout = "cpp", "NHD"
        # Drawn last, one per request slot, and only here: only this precision's judge replays a draw.
        slots = [(keep, replace(r, **_sampling(c))) for keep, r in slots]
        reqs = [r for keep, r in slots if keep] or [slots[0][1]]
    cfg = FuzzConfig(
        block_size=bs,
        num_blocks=_pool_size(reqs, bs, slack, b.max_slack),
        max_num_seqs=max(seqs, *(r.n for r in reqs)),  # the engine refuses n > max_num_seqs
        max_num_batched_tokens=budget,
        layout=layout,
        prefix_granularity=granularity,
        hash_algo=algo,
        attention_backend=backend,
        promote_after=promote_after,
        speculative_tokens=speculative,
        commit_rejected_drafts=meta.commit_rejected_drafts,
        kv_cache_dtype=kv_cache_dtype,
        precision=precision,
    )
    return FuzzCase(cfg, tuple(reqs), meta.model, meta.model_seed, meta.strategy)


def _speculation(c: Chooser, always: bool) -> int:
    """Draft tokens per step in some trials (every trial when the unsafe commit of rejected drafts is on)."""
    if always:
        return (2, 4)[c.integer(0, 1)]
    return (0, 2, 4)[c.integer(0, 2, weights=[0.7, 0.15, 0.15])]


def _cache_dtype(c: Chooser) -> str:
    """The pool's storage dtype: the model's in most trials; bf16 or fp8 (both of vLLM's formats) in some, whose
    rounded writes, copies on write and shared blocks the same checks cover."""
    return ("auto", "bfloat16", "fp8", "fp8_e5m2")[c.integer(0, 3, weights=[0.7, 0.1, 0.1, 0.1])]


def _precision(c: Chooser) -> str:
    """fp32 in most trials; the row-invariant mode in some, each request judged by its own run alone in that mode."""
    return PRECISIONS[c.integer(0, len(PRECISIONS) - 1, weights=[0.8, 0.2])]


def _sampling(c: Chooser) -> dict[str, Any]:
    """A request's sampling: greedy in half; else seeded at temperature 0.8, alone or with top-k 5 or top-p 0.9."""
    how = c.integer(0, 3, weights=[0.5, 0.2, 0.15, 0.15])
    if how == 0:
        return {}
    seed = c.integer(0, 1 << 16)
    narrowed: dict[str, Any] = {"top_k": 5} if how == 2 else {"top_p": 0.9} if how == 3 else {}
    return {"temperature": 0.8, "seed": seed, **narrowed}


def _pool_size(reqs: list[FuzzRequest], bs: int, slack: int, max_slack: int) -> int:
    """Enough blocks for the largest request alone, plus ``slack / max_slack`` of the others' prompts.

    Admission reserves a prompt's blocks and decoding takes more, so a pool that fits the prompts but not
    their growth makes running requests preempt each other; with no slack they mostly queue and evict.
    """
    largest = max(reqs, key=lambda r: _blocks_needed(r, bs))
    others = sum(blocks_for(len(r.prompt), bs) * r.n for r in reqs if r is not largest)
    return _blocks_needed(largest, bs) + (round(slack / max_slack * others) if max_slack else 0)


def _blocks_needed(r: FuzzRequest, block_size: int) -> int:
    # The engine's admission bound: a pool of exactly this size admits the request and nothing more.
    return admission_blocks(len(r.prompt) + r.max_tokens, block_size, r.n)


def _promotion(c: Chooser) -> int | None:
    """Popularity promotion (``CacheConfig.promote_after``) in some pools: K = 2, the fuzzer's two salts."""
    return (None, 2)[c.integer(0, 1, weights=[0.7, 0.3])]


def _public_prefix(c: Chooser, r: FuzzRequest, bs: int) -> int:
    """How many of the request's first prompt tokens are public: none; the whole prompt (its full blocks are
    public: those it shares with others are shared across salts); whole blocks of it (a system prompt, cut
    where the prompts' shared prefixes are cut: on block boundaries); or any count, whose partial block at the
    boundary must stay private."""
    how = c.integer(0, 3, weights=[0.4, 0.3, 0.15, 0.15])
    n = len(r.prompt)
    if how == 1:
        return n
    if how == 2 and n >= bs:
        return bs * c.integer(1, n // bs)
    if how == 3 and n:
        return c.integer(1, n)
    return 0


def _falling(n: int, ratio: float) -> list[float]:
    """Weights ``1, ratio, ratio**2, ...``: small values most often, large ones still drawn."""
    return [ratio**i for i in range(n)]


def _request(c: Chooser, b: WorkloadBounds, bs: int, prompts: list[tuple[int, ...]]) -> tuple[bool, FuzzRequest]:
    keep = c.boolean(1.0)  # a random draw keeps every request; the shrinker drops one by flipping this
    prompt = _prompt(c, b, bs, prompts)
    prompts.append(prompt)
    if b.allow_empty and c.boolean(0.3):
        prompt = ()
    arrival = c.integer(0, b.max_arrival, weights=_falling(b.max_arrival + 1, 0.6))
    max_tokens = c.integer(1, b.max_output)
    n = c.integer(1, b.max_n, weights=[0.8] + [0.2 / max(b.max_n - 1, 1)] * (b.max_n - 1))
    abort_at = arrival + c.integer(0, b.max_abort_delay) if c.boolean(0.15) else None
    salt = (None, "tenant-1", "tenant-2")[c.integer(0, 2, weights=[0.7, 0.15, 0.15])]
    return keep, FuzzRequest(prompt, arrival, max_tokens, n, abort_at, salt)


def _prompt(c: Chooser, b: WorkloadBounds, bs: int, earlier: list[tuple[int, ...]]) -> tuple[int, ...]:
    # 0: a fresh prompt; k > 0: derived from the k-th earlier prompt (most trials share prefixes).
    k = c.integer(0, len(earlier), weights=[0.35] + [0.65 / len(earlier)] * len(earlier)) if earlier else 0
    if k == 0:
        return _text(c, b, c.integer(1, b.max_prompt))
    base = earlier[k - 1]
    # identical | cut on a boundary | one before | one after | base + tail | a near miss: two tokens of
    # the base swapped (same tokens per block, other order: what an order-blind hash confuses)
    how = c.integer(0, 5)
    if how == 5:
        i = c.integer(0, len(base) - 1)
        j = min(i - i % bs + c.integer(0, bs - 1), len(base) - 1)  # within i's block
        swapped = list(base)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        base = tuple(swapped)
    boundary = c.integer(0, len(base) // bs) * bs
    cut = {0: len(base), 1: boundary, 2: boundary - 1, 3: boundary + 1}.get(how, len(base))
    cut = max(0, min(cut, len(base), b.max_prompt))
    room = b.max_prompt - cut
    tail = 0 if how == 0 or room == 0 else c.integer(0 if cut else 1, min(room, 2 * bs + 1))
    return base[:cut] + _text(c, b, tail) if cut + tail else _text(c, b, 1)


def _text(c: Chooser, b: WorkloadBounds, n: int) -> tuple[int, ...]:
    """``n`` tokens of the alphabet from one drawn pattern number (0: the first letter repeated).

    One choice per text rather than one per token keeps a trial to a few dozen choices, so hypothesis
    spends its shrinking runs on structure (requests, lengths, knobs) instead of on single letters.
    """
    if n == 0:
        return ()
    pattern = c.integer(0, PATTERNS - 1)
    if pattern == 0:
        return (b.alphabet[0],) * n
    rng = random.Random(pattern)  # prefix-stable: a shorter text is a prefix of a longer one
    return tuple(b.alphabet[rng.randrange(len(b.alphabet))] for _ in range(n))
