"""Sharing across tenants, measured (``kvlab bench tenants``): the same multi-tenant workload under five policies.

The workload: ``tenants`` tenants, each sending ``requests_per_tenant`` requests that arrive over time (Poisson
gaps, in engine steps, seeded). Every request is a system prompt, then the tenant's own long document (the same
in all its requests: a tenant-specific prefix), then a question of its own. The system prompts are few and
every tenant uses them: ``declared`` of them are the operator's public prefixes (``kvlab serve
--public-prefix-file``); ``undeclared`` more are just as popular but nobody declared them (what promotion finds).

The policies, each a fresh engine on the same arrivals:

* ``off``: no prefix cache;
* ``per-tenant``: every request salted with its tenant (``kvlab serve``'s default): nothing crosses tenants;
* ``public-prefixes``: per-tenant, and the declared system prompts' full blocks public;
* ``public+promotion``: that, and ``promote_after = K``: a chain K tenants computed becomes public too;
* ``global``: no salt: everything is shared with everyone (the upper bound of reuse, and of leaks).

Per policy: prompt tokens found in the cache (of which in public blocks), tokens computed, TTFT p50 / p99 in
seconds and in engine steps (from arrival to the first token), output throughput, the peak of blocks held by
running requests and the blocks left caching a prefix at the end, promotions. Each policy's greedy tokens are
compared with ``off``'s, request by request: sharing must not change a single token. *Recovery* is how much of
global's benefit over per-tenant a policy keeps: ``(x - per_tenant) / (global - per_tenant)`` for hit tokens,
and the same on the TTFT reduction.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kvlab.bench.names import TENANT_POLICIES as POLICIES
from kvlab.bench.studies.stepmeter import paused_gc, warm_up
from kvlab.bench.table import Column, ResultTable, result_table, right_columns
from kvlab.config import CacheConfig, ConfigError, SchedulerConfig, blocks_for, check_int
from kvlab.engine.engine import Engine
from kvlab.engine.sampling import SamplingParams
from kvlab.model.loader import LoadedModel

MAX_STEPS = 1_000_000
FIRST_TOKEN = 2  # token ids drawn from FIRST_TOKEN.. the vocabulary's end: no special ids of the byte tokenizer


@dataclass(frozen=True)
class TenantWorkload:
    tenants: int = 16
    requests_per_tenant: int = 6
    declared: int = 2  # system prompts the operator declared public
    undeclared: int = 1  # as popular, not declared
    system_tokens: tuple[int, int] = (200, 2000)  # cut to what the model holds (see sized())
    document_tokens: tuple[int, int] = (64, 128)
    question_tokens: tuple[int, int] = (8, 32)
    max_tokens: int = 16
    rate: float = 0.5  # requests arriving per engine step, on average
    promote_after: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name, lo in (("tenants", 2), ("requests_per_tenant", 1), ("declared", 0), ("undeclared", 0)):
            check_int("TenantWorkload", name, getattr(self, name), lo)
        check_int("TenantWorkload", "max_tokens", self.max_tokens, 1)
        check_int("TenantWorkload", "promote_after", self.promote_after, 2)
        if self.declared + self.undeclared < 1:
            raise ConfigError("TenantWorkload needs at least one system prompt (declared + undeclared >= 1)")
        for name in ("system_tokens", "document_tokens", "question_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"TenantWorkload.{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if not self.rate > 0:
            raise ConfigError(f"TenantWorkload.rate must be > 0 requests per step, got {self.rate}")

    def longest(self) -> int:
        """The most tokens one request holds: its prompt at the longest, and its output."""
        return self.system_tokens[1] + self.document_tokens[1] + self.question_tokens[1] + self.max_tokens

    def sized(self, max_model_len: int) -> TenantWorkload:
        """The workload with its system prompts cut so that the longest request fits ``max_model_len``."""
        room = max_model_len - self.document_tokens[1] - self.question_tokens[1] - self.max_tokens
        if room < 1:
            raise ConfigError(f"a document, a question and the output alone exceed max_model_len={max_model_len}")
        lo, hi = self.system_tokens
        hi = min(hi, room)
        return self if hi == self.system_tokens[1] else replace(self, system_tokens=(min(lo, hi), hi))


@dataclass(frozen=True)
class TenantRequest:
    request_id: str
    tenant: str
    arrival_step: int
    prompt: tuple[int, ...]
    system: int  # which system prompt
    public_tokens: int  # the declared public prefix it starts with (0: its system prompt is undeclared)


def tenant_requests(w: TenantWorkload, vocab_size: int) -> list[TenantRequest]:
    """The workload's requests in arrival order (seeded: the same list for every policy)."""
    rng = random.Random(w.seed)

    def text(bounds: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(rng.randint(*bounds)))

    systems = [text(w.system_tokens) for _ in range(w.declared + w.undeclared)]
    documents = {f"t{i}": text(w.document_tokens) for i in range(w.tenants)}
    drafts = []
    for tenant, document in documents.items():
        for _ in range(w.requests_per_tenant):
            k = rng.randrange(len(systems))
            drafts.append((tenant, k, systems[k] + document + text(w.question_tokens)))
    rng.shuffle(drafts)
    out, clock = [], 0.0
    for i, (tenant, k, prompt) in enumerate(drafts):
        clock += rng.expovariate(w.rate)
        public = len(systems[k]) if k < w.declared else 0
        out.append(TenantRequest(f"q{i}", tenant, int(clock), prompt, k, public))
    return out


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    public_hit_tokens: int
    computed_tokens: int  # prompt tokens computed (not found in the cache)
    output_tokens: int
    seconds: float
    steps: int
    ttft_p50: float
    ttft_p99: float
    ttft_steps_p50: float
    ttft_steps_p99: float
    peak_blocks_in_use: int
    cached_blocks_at_end: int
    promotions: int
    preemptions: int
    evictions: int
    violations: int | None  # the KV sanitizer's (None: it was off)
    differing_outputs: int | None = None  # requests whose tokens differ from "off"'s (None: off itself)
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["outputs"]
        return d | {"output_tokens_per_second": self.output_tokens_per_second}


def policy_configs(
    policy: str, w: TenantWorkload, num_blocks: int, block_size: int, sanitize: bool = False
) -> CacheConfig:
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    return CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        share_prefix=policy != "off",
        promote_after=w.promote_after if policy == "public+promotion" else None,
        sanitize=sanitize,
    )


def run_policy(
    loaded: LoadedModel,
    w: TenantWorkload,
    requests: Sequence[TenantRequest],
    policy: str,
    cache: CacheConfig,
    sched: SchedulerConfig,
) -> PolicyRun:
    """One fresh engine serving ``requests`` as they arrive, under ``policy``."""
    eng = Engine(loaded, cache, sched)
    params = SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True)
    salted = policy not in ("off", "global")
    declares = policy in ("public-prefixes", "public+promotion")
    arrived: dict[str, int] = {}
    first_step: dict[str, int] = {}
    before_first: set[str] = set()
    pending = list(requests)
    step = peak = 0
    with paused_gc():
        t0 = time.perf_counter()
        while pending or eng.has_unfinished_requests():
            while pending and pending[0].arrival_step <= step:
                r = pending.pop(0)
                eng.add_request(
                    list(r.prompt),
                    params,
                    r.request_id,
                    cache_salt=r.tenant if salted else None,
                    tenant=r.tenant,
                    public_prefix_tokens=r.public_tokens if declares else 0,
                )
                arrived[r.request_id] = step
                before_first.add(r.request_id)
            if eng.has_unfinished_requests():
                eng.advance()
                for rid in [rid for rid in before_first if eng.sequences(rid)[0].metrics.first_token_time]:
                    first_step[rid] = step
                    before_first.discard(rid)
                peak = max(peak, eng.kv.num_blocks - eng.kv.num_free_blocks())
            step += 1
            if step > MAX_STEPS:
                raise RuntimeError(f"{policy}: no end after {MAX_STEPS} steps")
        seconds = time.perf_counter() - t0
    outs = {r.request_id: eng.output(r.request_id) for r in requests}
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs.values() if o.metrics.first_token_time]
    ttft_steps = [first_step[rid] - arrived[rid] for rid in outs]
    s, kv = eng.stats(), eng.kv.stats
    prompt_tokens = sum(len(r.prompt) for r in requests)
    hits = sum(o.num_cached_tokens for o in outs.values())
    return PolicyRun(
        policy=policy,
        requests=len(requests),
        prompt_tokens=prompt_tokens,
        hit_tokens=hits,
        public_hit_tokens=s.prefix_cache_hits_public if salted else hits,
        computed_tokens=prompt_tokens - hits,
        output_tokens=sum(len(o.token_ids) for o in outs.values()),
        seconds=seconds,
        steps=step,
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p99=float(np.percentile(ttft, 99)),
        ttft_steps_p50=float(np.percentile(ttft_steps, 50)),
        ttft_steps_p99=float(np.percentile(ttft_steps, 99)),
        peak_blocks_in_use=peak,
        cached_blocks_at_end=eng.kv.num_evictable_blocks(),
        promotions=kv.promotions,
        preemptions=s.num_preemptions,
        evictions=kv.evictions,
        violations=len(eng.violations) if cache.sanitize else None,
        outputs={rid: tuple(o.token_ids) for rid, o in outs.items()},
    )


@dataclass(frozen=True)
class TenantBench:
    workload: TenantWorkload
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    runs: tuple[PolicyRun, ...]

    def run(self, policy: str) -> PolicyRun | None:
        return next((r for r in self.runs if r.policy == policy), None)

    def recovery(self, policy: str) -> dict[str, float | None]:
        """The share of global's benefit over per-tenant that ``policy`` keeps (None: not measured, or global
        gains nothing)."""
        base, top, mine = self.run("per-tenant"), self.run("global"), self.run(policy)
        if base is None or top is None or mine is None:
            return {"hit_tokens": None, "ttft_p50": None, "ttft_p99": None, "ttft_steps_p50": None}

        def share(x: float, lo: float, hi: float) -> float | None:
            return None if hi == lo else (x - lo) / (hi - lo)

        return {
            "hit_tokens": share(mine.hit_tokens, base.hit_tokens, top.hit_tokens),
            # TTFT: lower is better; the reduction kept
            "ttft_p50": share(-mine.ttft_p50, -base.ttft_p50, -top.ttft_p50),
            "ttft_p99": share(-mine.ttft_p99, -base.ttft_p99, -top.ttft_p99),
            "ttft_steps_p50": share(-mine.ttft_steps_p50, -base.ttft_steps_p50, -top.ttft_steps_p50),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": asdict(self.workload),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "runs": [r.as_dict() for r in self.runs],
            "recovery": {r.policy: self.recovery(r.policy) for r in self.runs},
        }


def bench_tenants(
    loaded: LoadedModel,
    w: TenantWorkload,
    policies: Sequence[str] = POLICIES,
    num_blocks: int | None = None,
    block_size: int = 16,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 256,
    repeats: int = 1,
    sanitize: bool = False,
) -> TenantBench:
    """Every policy on the same arrivals (the fastest of ``repeats`` runs counts; counts and tokens must not
    change between runs). ``num_blocks`` defaults to a pool that holds every request's prompt once over, so that
    eviction does not blur the comparison (the policies differ in what they keep, not in what they lose)."""
    w = w.sized(loaded.config.max_position_embeddings)
    requests = tenant_requests(w, loaded.config.vocab_size)
    if num_blocks is None:
        num_blocks = sum(blocks_for(len(r.prompt) + w.max_tokens, block_size) for r in requests) + max_num_seqs
    caches = {p: policy_configs(p, w, num_blocks, block_size, sanitize) for p in policies}  # bad names fail first
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=min(w.longest(), loaded.config.max_position_embeddings),
    )
    warm_up(loaded)
    runs: list[PolicyRun] = []
    for policy in policies:
        best: PolicyRun | None = None
        for _ in range(repeats):
            run = run_policy(loaded, w, requests, policy, caches[policy], sched)
            if best is not None and (best.outputs, best.hit_tokens) != (run.outputs, run.hit_tokens):
                raise RuntimeError(f"{policy}: tokens or hits changed between repeats")
            if best is None or run.seconds < best.seconds:
                best = run
        assert best is not None
        runs.append(best)
    ref = next((r for r in runs if r.policy == "off"), None)
    if ref is not None:
        runs = [
            r if r is ref else replace(r, differing_outputs=sum(r.outputs[k] != v for k, v in ref.outputs.items()))
            for r in runs
        ]
    return TenantBench(w, num_blocks, block_size, max_num_batched_tokens, tuple(runs))


KEEPERS = ("public-prefixes", "public+promotion")  # the policies whose share of global's gain is shown


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def tenants_table(b: TenantBench, model: str, threads: int) -> ResultTable:
    w = b.workload
    cols = [Column("policy", no_wrap=True)] + right_columns(
        "hits",
        "public",
        "computed",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TTFT steps p50 / p99",
        "out tok/s",
        "peak blocks",
        "cached blocks",
        "promoted",
        "hits kept",
        "TTFT kept",
        "= off",
    )
    rows = []
    for r in b.runs:
        rec = b.recovery(r.policy)
        rows.append(
            (
                r.policy,
                f"{r.hit_tokens:,}",
                f"{r.public_hit_tokens:,}",
                f"{r.computed_tokens:,}",
                f"{1e3 * r.ttft_p50:.1f}",
                f"{1e3 * r.ttft_p99:.1f}",
                f"{r.ttft_steps_p50:.0f} / {r.ttft_steps_p99:.0f}",
                f"{r.output_tokens_per_second:.0f}",
                str(r.peak_blocks_in_use),
                str(r.cached_blocks_at_end),
                str(r.promotions),
                _pct(rec["hit_tokens"]) if r.policy in KEEPERS else "",
                _pct(rec["ttft_p50"]) if r.policy in KEEPERS else "",
                "-" if r.differing_outputs is None else ("yes" if r.differing_outputs == 0 else
                                                         f"[red]{r.differing_outputs} differ[/red]"),
            )
        )  # fmt: skip
    heading = (
        f"[bold]tenants[/bold]: {model}, {w.tenants} tenants x {w.requests_per_tenant} requests "
        f"({w.tenants * w.requests_per_tenant}), arriving {w.rate:g}/step (Poisson, seed {w.seed}); system prompts "
        f"{w.system_tokens[0]}-{w.system_tokens[1]} tokens ({w.declared} declared public, {w.undeclared} not), "
        f"a {w.document_tokens[0]}-{w.document_tokens[1]}-token document per tenant, questions "
        f"{w.question_tokens[0]}-{w.question_tokens[1]}, {w.max_tokens} greedy tokens; {b.num_blocks} blocks of "
        f"{b.block_size}, {b.max_num_batched_tokens} tokens per step; promote_after={w.promote_after}; "
        f"{threads} threads"
    )
    notes = (
        "hits: prompt tokens found in the prefix cache; public: of which in blocks keyed without salt (shared "
        "across tenants); computed: the rest; TTFT from arrival to the first token (steps: engine steps, which the "
        "machine's speed does not touch); peak blocks: held by running requests; cached blocks: still holding a "
        "findable prefix at the end; promoted: chains made public by promote_after; hits / TTFT kept: the share "
        "of global's gain over per-tenant the policy keeps, (policy - per-tenant) / (global - per-tenant), TTFT "
        "at p50; = off: the same greedy tokens as without a cache, request by request",
    )
    return result_table("tenants: sharing policies on one workload", cols, rows, notes, heading)
