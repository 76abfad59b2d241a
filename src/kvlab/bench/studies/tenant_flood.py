"""The shared pool between tenants (``kvlab bench tenants --flood``): what one tenant's traffic does to another's
cache, under LRU and fair eviction (``CacheConfig.eviction``, :mod:`kvlab.kv.blocks`).

Two measurements on one small pool, each under every eviction policy:

* **The flood** (the cost side). A victim sends its document (the same in every request) and a fresh question
  every ``victim_every`` steps; a flooder keeps ``flood_in_flight`` requests of fresh, never repeated prompts in
  flight. Per policy: the victim's prompt tokens found in the cache (of those it could find: its document after
  the first request), its TTFT p50 / p99 in engine steps and ms, the evictions; and the same victim alone, for
  what the flood costs. Greedy tokens must be the same under every policy and alone: eviction changes what is
  recomputed, never an output.
* **The watcher** (the activity channel). Each round an attacker fills a share of the pool with fresh prompts of
  its own, the victim either sends ``victim_burst`` fresh prompts or stays idle (a seeded coin), and the attacker
  re-sends the oldest of its round's prompts and reads the cached tokens. The AUC of "the victim was active"
  from that count (1.0: the attacker tells every time; 0.5: it cannot tell) says how much the victim's
  activity shows through the attacker's own hits.

Counts are deterministic (engine steps); milliseconds depend on the machine.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvlab.bench.studies.stepmeter import paused_gc, warm_up
from kvlab.bench.table import Column, ResultTable, result_table, right_columns
from kvlab.config import EVICTIONS, CacheConfig, ConfigError, SchedulerConfig, check_int
from kvlab.engine.engine import Engine
from kvlab.engine.sampling import SamplingParams
from kvlab.model.loader import LoadedModel

FIRST_TOKEN = 2  # token ids drawn from here to the vocabulary's end: no special ids of the byte tokenizer
MAX_STEPS = 200_000
VICTIM, FLOOD, ATTACKER = "victim", "flood", "attacker"


@dataclass(frozen=True)
class FloodWorkload:
    num_blocks: int = 128
    block_size: int = 16
    document_tokens: int = 160  # the victim's document: its reusable prefix
    question_tokens: int = 16
    victim_requests: int = 24
    victim_every: int = 32  # engine steps between the victim's requests (longer than one takes: none is held)
    flood_prompt_tokens: int = 320
    flood_in_flight: int = 4
    max_tokens: int = 8
    rounds: int = 40  # the watcher's rounds
    victim_burst: int = 2  # fresh prompts of document_tokens + question_tokens the victim sends in an active round
    attacker_shares: tuple[float, ...] = (0.7, 0.8, 0.9, 1.0)  # of the pool the watcher fills with its own prompts
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "document_tokens", "question_tokens", "victim_requests"):
            check_int("FloodWorkload", name, getattr(self, name), 1)
        for name in ("victim_every", "flood_prompt_tokens", "max_tokens", "rounds", "victim_burst"):
            check_int("FloodWorkload", name, getattr(self, name), 1)
        check_int("FloodWorkload", "flood_in_flight", self.flood_in_flight, 0)
        if not all(0 < s <= 1 for s in self.attacker_shares):
            raise ConfigError(f"FloodWorkload.attacker_shares must lie in (0, 1], got {self.attacker_shares}")

    def longest(self) -> int:
        return max(self.flood_prompt_tokens, self.document_tokens + self.question_tokens) + self.max_tokens


@dataclass(frozen=True)
class FloodRun:
    """The victim's view of one policy: ``eviction`` is "alone" for the victim without the flood."""

    eviction: str
    victim_prompt_tokens: int
    victim_hit_tokens: int
    reusable_tokens: int  # the document's whole blocks in every request but the first: what a cache can give
    ttft_steps_p50: float
    ttft_steps_p99: float
    ttft_p50: float
    ttft_p99: float
    flood_requests: int
    evictions: int
    outputs: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    @property
    def hit_share(self) -> float:
        return self.victim_hit_tokens / self.reusable_tokens if self.reusable_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["outputs"]
        return d | {"hit_share": self.hit_share}


@dataclass(frozen=True)
class WatchRun:
    """The attacker's view of one policy: its cached tokens per round, and whether the victim was active."""

    eviction: str
    attacker_share: float
    active: tuple[bool, ...]
    seen: tuple[int, ...]

    @property
    def auc(self) -> float | None:
        """P(a round with the victim active shows fewer cached tokens than an idle one), ties half."""
        on = np.array([s for s, a in zip(self.seen, self.active, strict=True) if a], dtype=float)
        off = np.array([s for s, a in zip(self.seen, self.active, strict=True) if not a], dtype=float)
        if not len(on) or not len(off):
            return None
        return float(np.mean(on[:, None] < off[None, :]) + 0.5 * np.mean(on[:, None] == off[None, :]))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"auc": self.auc}


@dataclass(frozen=True)
class FloodBench:
    workload: FloodWorkload
    floods: tuple[FloodRun, ...]
    watches: tuple[WatchRun, ...]

    def differing(self) -> list[str]:
        """The policies whose victim outputs differ from the victim alone's (none may)."""
        alone = next(r for r in self.floods if r.eviction == "alone")
        return [r.eviction for r in self.floods if r.outputs != alone.outputs]

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": asdict(self.workload),
            "floods": [r.as_dict() for r in self.floods],
            "watches": [r.as_dict() for r in self.watches],
            "differing_outputs": self.differing(),
        }


def _engine(loaded: LoadedModel, w: FloodWorkload, eviction: str) -> Engine:
    cache = CacheConfig(block_size=w.block_size, num_blocks=w.num_blocks, eviction=eviction)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=w.longest())
    return Engine(loaded, cache, sched)


def _text(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def run_flood(loaded: LoadedModel, w: FloodWorkload, eviction: str, flood: bool = True) -> FloodRun:
    """The victim's requests every ``victim_every`` steps, beside a flooder that keeps ``flood_in_flight``
    fresh prompts in flight (``flood=False``: the victim alone, under LRU)."""
    rng = random.Random(w.seed)
    vocab = loaded.config.vocab_size
    document = _text(rng, w.document_tokens, vocab)
    questions = [_text(rng, w.question_tokens, vocab) for _ in range(w.victim_requests)]
    eng = _engine(loaded, w, eviction if flood else "lru")
    params = SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True)
    victims: list[str] = []
    sent_at: dict[str, int] = {}
    first: dict[str, int] = {}
    floods: list[str] = []
    step = 0
    with paused_gc():
        while len(first) < w.victim_requests or any(not eng.is_finished(r) for r in victims):
            if step % w.victim_every == 0 and len(victims) < w.victim_requests:
                rid = eng.add_request(document + questions[len(victims)], params, cache_salt=VICTIM, tenant=VICTIM)
                victims.append(rid)
                sent_at[rid] = step
            while flood and sum(not eng.is_finished(r) for r in floods[-w.flood_in_flight :]) < w.flood_in_flight:
                prompt = _text(rng, w.flood_prompt_tokens, vocab)
                floods.append(eng.add_request(prompt, params, cache_salt=FLOOD, tenant=FLOOD))
            eng.advance()
            for rid in victims:
                if rid not in first and eng.sequences(rid)[0].metrics.first_token_time:
                    first[rid] = step
            step += 1
            if step > MAX_STEPS:
                raise RuntimeError(f"{eviction}: the victim's requests did not finish in {MAX_STEPS} steps")
    outs = [eng.output(r) for r in victims]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics.first_token_time]
    steps = [first[r] - sent_at[r] for r in victims]
    whole = w.document_tokens // w.block_size * w.block_size
    return FloodRun(
        eviction=eviction if flood else "alone",
        victim_prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        victim_hit_tokens=sum(o.num_cached_tokens for o in outs),
        reusable_tokens=whole * (w.victim_requests - 1),
        ttft_steps_p50=float(np.percentile(steps, 50)),
        ttft_steps_p99=float(np.percentile(steps, 99)),
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p99=float(np.percentile(ttft, 99)),
        flood_requests=len(floods),
        evictions=eng.kv.stats.evictions,
        outputs=tuple(tuple(o.token_ids) for o in outs),
    )


def run_watch(loaded: LoadedModel, w: FloodWorkload, eviction: str, share: float) -> WatchRun:
    """Each round the attacker fills ``share`` of the pool with fresh prompts of its own, the victim is active or
    not, then the attacker re-sends the oldest of this round's prompts and reads its cached tokens: whatever the
    victim's prompts evicted of the attacker's shows there."""
    rng = random.Random(w.seed + 1)
    vocab = loaded.config.vocab_size
    eng = _engine(loaded, w, eviction)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    length = w.document_tokens + w.question_tokens
    count = max(1, int(share * w.num_blocks) // max(1, length // w.block_size))  # a prompt caches its whole blocks

    def send(prompt: list[int], tenant: str) -> int:
        rid = eng.add_request(prompt, params, cache_salt=tenant, tenant=tenant)
        while not eng.is_finished(rid):
            eng.advance()
        return eng.output(rid).num_cached_tokens

    with paused_gc():
        active, seen = [], []
        for _ in range(w.rounds):
            fillers = [_text(rng, length, vocab) for _ in range(count)]
            for prompt in fillers:
                send(prompt, ATTACKER)
            active.append(rng.random() < 0.5)
            if active[-1]:
                for _ in range(w.victim_burst):
                    send(_text(rng, length, vocab), VICTIM)
            seen.append(send(fillers[0], ATTACKER))
    return WatchRun(eviction, share, tuple(active), tuple(seen))


def bench_flood(loaded: LoadedModel, w: FloodWorkload, evictions: tuple[str, ...] = EVICTIONS) -> FloodBench:
    for e in evictions:
        if e not in EVICTIONS:
            raise ConfigError(f"unknown eviction {e!r}; expected one of {', '.join(EVICTIONS)}")
    if w.longest() > loaded.config.max_position_embeddings:
        raise ConfigError(f"a request of {w.longest()} tokens does not fit {loaded.name}")
    warm_up(loaded)
    floods = [run_flood(loaded, w, "lru", flood=False)] + [run_flood(loaded, w, e) for e in evictions]
    watches = [run_watch(loaded, w, e, s) for s in w.attacker_shares for e in evictions]
    return FloodBench(w, tuple(floods), tuple(watches))


def flood_table(b: FloodBench, model: str, threads: int) -> ResultTable:
    w = b.workload
    cols = [Column("victim's cache beside", no_wrap=True)] + right_columns(
        "hits / reusable", "TTFT steps p50 / p99", "TTFT ms p50 / p99", "evictions", "flood requests", "= alone"
    )
    differ = set(b.differing())
    rows = [
        (
            "nobody (alone)" if r.eviction == "alone" else f"a flood, {r.eviction} eviction",
            f"{r.victim_hit_tokens:,} / {r.reusable_tokens:,} ({100 * r.hit_share:.0f}%)",
            f"{r.ttft_steps_p50:.0f} / {r.ttft_steps_p99:.0f}",
            f"{1e3 * r.ttft_p50:.1f} / {1e3 * r.ttft_p99:.1f}",
            str(r.evictions),
            str(r.flood_requests),
            "[red]differ[/red]" if r.eviction in differ else "yes",
        )
        for r in b.floods
    ]
    for r in b.watches:
        auc = r.auc
        rows.append(
            (
                f"watcher at {100 * r.attacker_share:.0f}% of the pool, {r.eviction}",
                f"AUC {auc:.2f}" if auc is not None else "AUC -",
                f"{sum(r.active)} active / {len(r.active)} rounds",
                f"seen {min(r.seen)}-{max(r.seen)} tokens",
                "",
                "",
                "",
            )
        )
    heading = (
        f"[bold]tenants --flood[/bold]: {model}, {w.num_blocks} blocks of {w.block_size}; the victim sends a "
        f"{w.document_tokens}-token document + {w.question_tokens}-token question every {w.victim_every} steps "
        f"({w.victim_requests} requests) beside {w.flood_in_flight} flood requests of {w.flood_prompt_tokens} "
        f"fresh tokens in flight; the watcher: {w.rounds} rounds, the victim active in about half with "
        f"{w.victim_burst} fresh prompts; {threads} threads"
    )
    notes = (
        "hits / reusable: the victim's prompt tokens found in the cache, of the document's whole blocks in every "
        "request but the first; TTFT from arrival to the first token (steps do not depend on the machine); "
        "= alone: the victim's greedy tokens equal its tokens without the flood; watcher AUC: how well the "
        "attacker's cached tokens on its oldest prompt of the round tell a round with the victim active from an "
        "idle one (0.5: not at all, 1.0: always)",
    )
    return result_table("tenants --flood: the shared pool between tenants", cols, rows, notes, heading)
