"""Running one case on a fresh engine and judging it against the dense oracle.

The engine is driven only through its public API: ``add_request`` at each request's arrival step,
``abort`` at its abort step, ``advance`` once per step, then ``output``. Its KV manager (``Engine.kv``) is
read, never changed: after every step its invariants are checked, and at the end every block must be free
again. At the end, too, every finished sequence must equal the oracle's greedy continuation (an aborted
one: a prefix of it; over a bf16 or fp8 cache, the continuation with K/V rounded as that cache stores them; in the
row-invariant precision, ``ROW_INVARIANT``, exactly what the request produces alone in it: ``AloneRuns``)
and the sanitizer must have seen no foreign read, nor any read of another salt's K/V outside the blocks both
requests declared public (``FuzzRequest.public_prefix_tokens``) or, with ``FuzzConfig.promote_after = K``,
content K salts wrote (the sanitizer counts them itself); ``check_invariants`` checks the same isolation on the
KV manager's own state after every step.
"""

from __future__ import annotations

import copy
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from kvlab.config import CacheConfig, SchedulerConfig, admission_blocks
from kvlab.engine.engine import Engine
from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling import InvalidRequestError
from kvlab.engine.sizing import default_max_model_len, kv_rounding
from kvlab.experiment.strategies import BUILTIN_STRATEGIES
from kvlab.fuzz.case import PRECISION_DTYPES, ROW_INVARIANT, FuzzCase, FuzzConfig, FuzzRequest
from kvlab.fuzz.oracle import Oracle
from kvlab.instrument.sanitizer import Violation
from kvlab.kv import InvariantError, check_invariants
from kvlab.model.loader import LoadedModel

MAX_STEPS = 5000  # far above any drawn case (a few hundred steps at a 3-token budget): beyond it, a livelock
# Steps in a row in which no sequence computed a token, got one or finished although all requests have
# arrived: the engine is stuck (an unsafe strategy can leave the pool unable to admit anyone). Found here
# at once instead of after MAX_STEPS.
MAX_IDLE_STEPS = 50

# Failure kinds, most fundamental first: a case's primary kind is the first one it shows, and shrinking
# keeps a case only while it still shows its original primary kind.
COVERAGE = (
    "prefix-hit",
    "copy-on-write",
    "eviction",
    "preemption",
    "chunked-prefill",
    "fork",
    "abort",
    "salt",
    "public-hit",  # a request with a salt hit a public block (shared across salts)
    "promotion",  # a chain two salts computed was made public (FuzzConfig.promote_after)
    "speculation",  # a draft token was accepted (FuzzConfig.speculative_tokens)
    "rejected-draft",  # a draft token was rejected: its slot written, never the request's
    "rounding-cache",  # the pool stored K/V rounded to bf16 or fp8 (FuzzConfig.kv_cache_dtype)
    ROW_INVARIANT,  # the trial ran in the row-invariant precision (FuzzConfig.precision)
    "sampling",  # a request drew its tokens from its seed (the row-invariant precision only)
    "over-outputs",  # a prompt ran over another request's outputs (over_outputs; that judge then holds its length only)
)

KINDS = (
    "crash",  # the engine raised
    "refused",  # a request within the pool's bounds was refused
    "stuck",  # requests left unfinished: no progress for MAX_IDLE_STEPS, or MAX_STEPS reached
    "invariant",  # check_invariants failed after a step
    "foreign-read",  # the sanitizer saw a request read K/V that is not its own
    "cross-tenant",  # the sanitizer saw a read of another salt's K/V outside the blocks both declared public
    "draft-read",  # a speculative draft token's K/V never verified was read, or offered by the prefix index
    "wrong-token",  # a sequence left the oracle's greedy continuation (not at a near-tie)
    "batch-variance",  # row-invariant precision: a sequence is not what its request gives alone (AloneRuns)
    "error",  # a sequence finished with finish_reason="error"
    "fork",  # an n > 1 request did not return n sequences
    "length",  # a finished sequence is not max_tokens long
    "leak",  # blocks still held after every request finished
)


@dataclass(frozen=True)
class Failure:
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True)
class Verdict:
    failures: tuple[Failure, ...]
    steps: int
    root_causes: tuple[str, ...]  # the sanitizer's first foreign read of each reader
    # Request id -> the token ids of each of its sequences (for a replay to show; not part of equality).
    outputs: dict[str, list[list[int]]] = field(default_factory=dict, compare=False)
    # Which engine paths the trial went through (COVERAGE): a campaign reports how often each was exercised.
    coverage: frozenset[str] = frozenset()

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(f.kind for f in self.failures)

    @property
    def primary(self) -> str | None:
        return min((f.kind for f in self.failures), key=KINDS.index, default=None)

    def first(self, kind: str) -> Failure | None:
        return next((f for f in self.failures if f.kind == kind), None)


def build_engine(loaded: LoadedModel, case: FuzzCase) -> Engine:
    """The case's engine over ``loaded``, which must be in the case's precision (``FuzzConfig.model_dtype``)."""
    cache_kw, sched_kw = case.config.cache_kwargs(), case.config.scheduler_kwargs()
    # The longest sequence both model and pool hold: the default every front end uses.
    sched_kw["max_model_len"] = default_max_model_len(loaded, CacheConfig(**cache_kw))
    if case.strategy is None:
        cache, sched = CacheConfig(**cache_kw), SchedulerConfig(**sched_kw)
    else:
        cache, sched = BUILTIN_STRATEGIES[case.strategy].configs(cache_kw, sched_kw)
    return Engine(loaded, cache, sched, mode=case.config.mode)


def in_dtype(loaded: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    """``loaded`` with its weights in ``dtype`` (a copy; ``loaded`` itself where they already are)."""
    if loaded.model.dtype == dtype:
        return loaded
    return replace(loaded, model=copy.deepcopy(loaded.model).to(dtype))


class AloneRunError(RuntimeError):
    """A request run alone, for ``AloneRuns``, did not finish: the trial cannot be judged by it."""


class AloneRuns:
    """The oracle of the row-invariant precision: each request's greedy tokens when it runs alone, in a fresh engine
    of its case's precision, block size, layout and cache dtype (what a row's bits depend on by design: the kernels'
    walk over blocks, their layout, the cache's rounding), memoised (least recently used dropped past ``capacity``).
    In that precision every row is computed on its own, so a request of any trial must produce exactly these tokens,
    whatever ran beside it, hit its prefix, preempted it or chunked its prompt; any other token is another request's
    traffic showing in its answer."""

    def __init__(self, loaded: LoadedModel, capacity: int = 20_000) -> None:
        self.loaded = in_dtype(loaded, PRECISION_DTYPES[ROW_INVARIANT])
        self.capacity = capacity
        self._memo: OrderedDict[tuple[object, ...], list[list[int]]] = OrderedDict()  # key -> each fork's tokens

    def tokens(self, r: FuzzRequest, index: int, config: FuzzConfig, length: int) -> list[int]:
        """The first ``length`` tokens of sequence ``index`` of ``r`` run alone (greedy: every sequence's; sampled: that
        fork's, whose generator is seeded ``seed + index``, in a run of all ``r.n`` forks)."""
        n = r.n if r.sampled else 1
        key: tuple[object, ...] = (r.prompt, r.temperature, r.top_k, r.top_p, r.seed, n)
        key += (config.precision, config.block_size, config.layout, config.kv_cache_dtype)
        have = self._memo.get(key)
        if have is None or len(have[0]) < length:
            have = self._run(replace(r, n=n), config, length)
            self._memo[key] = have
            if len(self._memo) > self.capacity:
                self._memo.popitem(last=False)
        self._memo.move_to_end(key)
        return have[index if r.sampled else 0][:length]

    def _run(self, r: FuzzRequest, config: FuzzConfig, length: int) -> list[list[int]]:
        alone = FuzzConfig(
            block_size=config.block_size,
            num_blocks=admission_blocks(len(r.prompt) + length, config.block_size, r.n),
            max_num_seqs=r.n,
            layout=config.layout,
            attention_backend=config.attention_backend,
            kv_cache_dtype=config.kv_cache_dtype,
            precision=config.precision,
        )
        request = replace(r, arrival=0, max_tokens=length, abort_at=None, salt=None, public_prefix_tokens=0)
        case = FuzzCase(alone, (request,))
        engine = build_engine(self.loaded, case)
        _, failure = _drive(engine, case)
        if failure is not None:
            raise AloneRunError(f"request alone ({len(r.prompt)} prompt tokens): {failure}")
        out = engine.output(case.request_id(0)).outputs
        return [list(c.token_ids) for c in sorted(out, key=lambda c: c.index)]


def run_case(loaded: LoadedModel, case: FuzzCase, oracle: Oracle, alone: AloneRuns | None = None) -> Verdict:
    """Runs ``case`` and judges it: in fp32 on ``loaded`` by ``oracle``; in the row-invariant precision on ``alone``'s
    model by ``alone`` (one is made of ``loaded`` when not given)."""
    if case.config.precision == ROW_INVARIANT:
        alone = alone or AloneRuns(loaded)
        loaded = alone.loaded
    else:
        alone = None
    engine = build_engine(loaded, case)
    # The oracle rounds K/V as the case's pool stores them.
    kv_dtype = kv_rounding(engine.storage.dtype, loaded.model.dtype)
    steps, failure = _drive(engine, case)
    failures = [failure] if failure is not None else []
    roots = root_causes(engine.violations)
    foreign = [v for v in engine.violations if v.kind == "foreign"]
    if foreign:
        failures.append(Failure("foreign-read", f"{len(foreign)} foreign reads; first: {foreign[0].explain()}"))
    crossed = [v for v in engine.violations if v.kind == "cross-tenant"]
    if crossed:
        what = f"{len(crossed)} reads of another salt's K/V outside public blocks; first: {crossed[0].explain()}"
        failures.append(Failure("cross-tenant", what))
    drafts = [v for v in engine.violations if v.kind == "draft"]
    if drafts:
        what = f"{len(drafts)} slots of unverified drafts read or offered by the prefix index; first: "
        failures.append(Failure("draft-read", what + drafts[0].explain()))
    outputs: dict[str, list[list[int]]] = {}
    outs: dict[str, RequestOutput] = {}
    unjudged: frozenset[int] = frozenset()
    if failure is None:
        outs = {case.request_id(i): engine.output(case.request_id(i)) for i in range(len(case.requests))}
        outputs = {rid: [list(c.token_ids) for c in out.outputs] for rid, out in outs.items()}
        unjudged = over_outputs(case, outputs) if alone is not None else frozenset()
        judge = _Judge(oracle, kv_dtype, alone, case.config, unjudged)
        try:
            failures += _judge_outputs(outs, case, judge)
        except AloneRunError as exc:
            failures.append(Failure("crash", str(exc)))
        held = engine.kv.num_blocks - engine.kv.num_free_blocks()
        if held:
            failures.append(Failure("leak", f"{held} of {engine.kv.num_blocks} blocks still held at the end"))
    failures.sort(key=lambda f: KINDS.index(f.kind))
    return Verdict(tuple(failures), steps, roots, outputs, _coverage(engine, case, outs, kv_dtype, unjudged))


def _coverage(
    engine: Engine,
    case: FuzzCase,
    outs: dict[str, RequestOutput],
    kv_dtype: torch.dtype | None,
    unjudged: frozenset[int],
) -> frozenset[str]:
    st = engine.stats()
    budget, bs = case.config.max_num_batched_tokens, case.config.block_size
    hit = {
        "prefix-hit": st.prefix_cache_hits > 0,
        "copy-on-write": st.cow_copies > 0,
        "eviction": st.evictions > 0,
        "preemption": st.num_preemptions > 0,
        "chunked-prefill": any(len(r.prompt) > budget for r in case.requests),
        "fork": any(r.n > 1 for r in case.requests),
        "abort": any(c.finish_reason == "abort" for out in outs.values() for c in out.outputs),
        "salt": any(r.salt for r in case.requests),
        # A request with a salt whose cache hit covers a whole block of its public prefix: a public block.
        "public-hit": any(
            r.salt is not None and min(outs[rid].num_cached_tokens, r.public_prefix_tokens) >= bs
            for i, r in enumerate(case.requests)
            if (rid := case.request_id(i)) in outs
        ),
        "promotion": engine.kv.stats.promotions > 0,
        "speculation": st.spec_decode_num_accepted_tokens > 0,
        "rejected-draft": st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens,
        "rounding-cache": kv_dtype is not None,
        ROW_INVARIANT: case.config.precision == ROW_INVARIANT,
        "sampling": any(r.sampled for r in case.requests),
        "over-outputs": bool(unjudged),
    }
    return frozenset(k for k, v in hit.items() if v)


def _drive(engine: Engine, case: FuzzCase) -> tuple[int, Failure | None]:
    order = sorted(range(len(case.requests)), key=lambda i: (case.requests[i].arrival, i))
    added: set[int] = set()
    step = idle = 0
    last: tuple[tuple[int, int, bool], ...] = ()
    try:
        while len(added) < len(order) or engine.has_unfinished_requests():
            for i in order:
                r = case.requests[i]
                if i not in added and r.arrival <= step:
                    # The salt names the tenant too, as in the server: requests of two salts compete for seats and
                    # blocks under the scheduler's fair share (its preemptions are checked like any other).
                    engine.add_request(
                        list(r.prompt),
                        r.params(),
                        request_id=case.request_id(i),
                        cache_salt=r.salt,
                        tenant=r.salt,
                        public_prefix_tokens=r.public_prefix_tokens,
                    )
                    added.add(i)
            for i in sorted(added):
                if case.requests[i].abort_at == step:
                    engine.abort(case.request_id(i))
            engine.advance()
            check_invariants(engine.kv)
            step += 1
            # advance() names only the groups that sampled a token: a prompt prefilled in chunks moves too.
            now = _progress(engine, case, added)
            idle = 0 if now != last or len(added) < len(order) else idle + 1
            last = now
            if idle >= MAX_IDLE_STEPS or step >= MAX_STEPS:
                return step, Failure("stuck", f"requests still unfinished after {step} steps ({idle} without progress)")
    except InvalidRequestError as exc:
        return step, Failure("refused", f"step {step}: {exc}")
    except InvariantError as exc:
        return step, Failure("invariant", f"after step {step}: {exc}")
    except Exception as exc:  # whatever the engine raises is a finding, with where it came from
        return step, Failure("crash", f"step {step}: {type(exc).__name__}: {exc} (at {_where(exc)})")
    return step, None


def _where(exc: BaseException, frames: int = 3) -> str:
    """The innermost kvlab frames of a traceback, outermost first: enough to find the bug from a case file."""
    tb = [f for f in traceback.extract_tb(exc.__traceback__) if "/kvlab/" in f.filename] or traceback.extract_tb(
        exc.__traceback__
    )
    return " > ".join(f"{f.filename.rsplit('/kvlab/', 1)[-1]}:{f.lineno} {f.name}" for f in tb[-frames:])


def _progress(engine: Engine, case: FuzzCase, added: set[int]) -> tuple[tuple[int, int, bool], ...]:
    """Where every sequence stands: tokens computed, tokens generated, finished (read-only views)."""
    return tuple(
        (seq.num_computed_tokens, len(seq.output_token_ids), seq.is_finished)
        for i in sorted(added)
        for seq in engine.sequences(case.request_id(i))
    )


def over_outputs(case: FuzzCase, outputs: dict[str, list[list[int]]]) -> frozenset[int]:
    """The requests (by index) whose prompt runs over another's outputs in their sharing domain (the same salt):
    another's prompt and at least its first output token begin this prompt. Such a prompt may find those tokens' K/V
    in the cache, computed there as outputs (kernel rows), where alone it computes them as prompt (the flash kernel):
    the one route by which a position's bits differ by design (docs/serving.md, "What changes an answer"), so the
    row-invariant judge does not hold these requests to their runs alone. A request's outputs are never public."""
    found = set()
    for i, r in enumerate(case.requests):
        for j, other in enumerate(case.requests):
            if j == i or other.salt != r.salt or len(other.prompt) >= len(r.prompt):
                continue
            if r.prompt[: len(other.prompt)] != other.prompt:
                continue
            after = r.prompt[len(other.prompt)]
            if any(seq and seq[0] == after for seq in outputs.get(case.request_id(j), [])):
                found.add(i)
    return frozenset(found)


@dataclass(frozen=True)
class _Judge:
    """What a trial's sequences are held to: ``alone``'s tokens where set (the row-invariant precision), else
    ``oracle``'s greedy continuation with K/V rounded to ``kv_dtype`` (up to its near-ties). In the row-invariant
    precision the requests in ``unjudged`` (``over_outputs``) are held to their lengths only."""

    oracle: Oracle
    kv_dtype: torch.dtype | None
    alone: AloneRuns | None
    config: FuzzConfig
    unjudged: frozenset[int] = frozenset()

    def mismatch(self, name: str, request: int, r: FuzzRequest, index: int, got: list[int]) -> Failure | None:
        if self.alone is None:
            mm = self.oracle.first_mismatch(r.prompt, got, self.kv_dtype)
            if mm is None:
                return None
            return Failure(
                "wrong-token",
                f"request {name}, output token {mm.index}: got {mm.got}, the oracle's greedy token is "
                f"{mm.expected} (its logit {mm.gap:.3g} higher; a near-tie would be < {mm.atol:g})",
            )
        if request in self.unjudged:
            return None
        want = self.alone.tokens(r, index, self.config, r.max_tokens)[: len(got)]
        i = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if i is None:
            return None
        return Failure(
            "batch-variance",
            f"request {name}, output token {i}: got {got[i]}, the request alone in {self.config.precision} gives "
            f"{want[i]} (that mode computes every row on its own: the other requests changed this one)",
        )


def _judge_outputs(outs: dict[str, RequestOutput], case: FuzzCase, judge: _Judge) -> list[Failure]:
    failures: list[Failure] = []
    for i, r in enumerate(case.requests):
        if r.prompt:  # an empty prompt (unsafe strategy only) has no continuation: the sanitizer judges it
            failures += _judge_request(i, case.request_id(i), r, outs[case.request_id(i)], judge)
    return failures


def _judge_request(i: int, rid: str, r: FuzzRequest, out: RequestOutput, judge: _Judge) -> list[Failure]:
    failures: list[Failure] = []
    aborted = any(c.finish_reason == "abort" for c in out.outputs)
    if not aborted and len(out.outputs) != r.n:
        failures.append(Failure("fork", f"request {rid}: n={r.n} but {len(out.outputs)} sequences"))
    for c in out.outputs:
        name = rid if r.n == 1 else f"{rid}#{c.index}"
        if c.finish_reason == "error":
            failures.append(Failure("error", f"request {name} failed: {out.error}"))
        elif c.finish_reason != "abort" and len(c.token_ids) != r.max_tokens:
            failures.append(Failure("length", f"request {name}: {len(c.token_ids)} tokens, max_tokens={r.max_tokens}"))
        wrong = judge.mismatch(name, i, r, c.index, list(c.token_ids))
        if wrong is not None:
            failures.append(wrong)
    return failures


def root_causes(violations: list[Violation], limit: int = 5) -> tuple[str, ...]:
    """The first foreign read of each reader: where the contamination entered (as the experiment reports)."""
    seen: set[str] = set()
    out = []
    for v in violations:
        if v.reader not in seen:
            seen.add(v.reader)
            out.append(v.explain())
        if len(out) == limit:
            break
    return tuple(out)
