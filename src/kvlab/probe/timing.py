"""``kvlab probe --timing``: can a client tell from its own requests that another's prefix is cached?

(vLLM CVE-2025-46570: prefix-cache hits are visible in TTFT.) One sample: a "victim" sends a fresh long
prefix plus a suffix; then the "attacker" sends either the same prefix with another suffix (the *hit* arm:
a hit if the cache is shared with it) or a never-seen prefix of the same length (the *miss* arm), as a
1-token request whose latency is its TTFT. Both arms have a victim request right before the probe, so the
server's state differs only in whether the probe's prefix is the victim's: a single-slot server, which
keeps only the previous request, is measured as fairly as a block cache.

Servers decide differently what enters the cache, and one rule can hide every hit from one kind of victim:
transformers' continuous batching never registers the blocks of a request that ends during prefill (a
1-token victim), other caches admit a prompt only when it is seen again. So each measurement is repeated
for several victim *shapes* (``SHAPES``), and the report says which ones revealed the cache.

Two channels per run: TTFT (AUC = P(TTFT of a hit < TTFT of a miss), ties half; 0.5: cannot tell) and,
where the server reports it, ``cached_tokens`` (AUC of "a hit reports more"). A run *reveals* the cache
when an AUC is at least ``MIN_AUC`` and its permutation p-value is at most ``alpha`` divided by the number
of tests (Bonferroni: picking the best of several shapes is paid for).

Conditions: without salts (victim and attacker send none), and, where the server accepts ``cache_salt``,
with distinct salts. A hit visible across distinct salts is a **leak** (the salt does not isolate); visible
only without salts it is **exposure** (clients that share a cache namespace can see each other's prompts).
Every prompt carries the run's nonce (see ``material``): a re-run never meets the last run's entries.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlab.openai_http import cached_tokens_of
from kvlab.probe.client import ProbeClient
from kvlab.probe.material import sub_nonce, words

MIN_AUC = 0.75


@dataclass(frozen=True)
class Shape:
    name: str
    max_tokens: int  # the victim's request
    sends: int  # how often the victim sends it before the probe


SHAPES = (
    Shape("1-token victim, sent once", 1, 1),
    Shape("4-token victim, sent once", 4, 1),
    Shape("4-token victim, sent twice", 4, 2),
)


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """P(a positive's time is below a negative's), ties half: the Mann-Whitney AUC of "faster = hit"."""
    if not positives or not negatives:
        raise ValueError("the AUC needs at least one hit and one miss sample")
    wins = sum((p < n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def midranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``; tied values share their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def auc_p_value(
    positives: Sequence[float], negatives: Sequence[float], rng: random.Random, permutations: int = 4000
) -> float:
    """One-sided permutation p-value of ``auc(positives, negatives)``: labels shuffled, ranks kept. The AUC
    equals (rank sum of the negatives - n(n+1)/2) / (n_pos * n_neg), so a permutation costs one sample."""
    ranks = midranks([*positives, *negatives])
    n_pos, n_neg = len(positives), len(negatives)
    base = n_neg * (n_neg + 1) / 2
    observed = sum(ranks[n_pos:]) - base
    as_high = sum(sum(rng.sample(ranks, n_neg)) - base >= observed - 1e-9 for _ in range(permutations))
    return (as_high + 1) / (permutations + 1)


@dataclass
class TimingRun:
    shape: str
    salted: bool
    hit_ttft: list[float] = field(default_factory=list)
    miss_ttft: list[float] = field(default_factory=list)
    hit_cached: list[int | None] = field(default_factory=list)
    miss_cached: list[int | None] = field(default_factory=list)
    auc: float = 0.5
    p_value: float = 1.0
    cached_auc: float | None = None  # None: the server does not report cached tokens
    cached_p_value: float | None = None
    revealed_by: list[str] = field(default_factory=list)  # channels that showed the cache: TTFT, cached_tokens

    def analyse(self, rng: random.Random) -> None:
        self.auc = auc(self.hit_ttft, self.miss_ttft)
        self.p_value = auc_p_value(self.hit_ttft, self.miss_ttft, rng)
        hits, misses = self.hit_cached, self.miss_cached
        if all(c is not None for c in [*hits, *misses]):
            # "More cached" is the hit: negate, so the same "smaller = hit" statistic applies.
            neg_hits = [-float(c or 0) for c in hits]
            neg_misses = [-float(c or 0) for c in misses]
            self.cached_auc = auc(neg_hits, neg_misses)
            self.cached_p_value = auc_p_value(neg_hits, neg_misses, rng)

    def decide(self, threshold: float) -> None:
        self.revealed_by = []
        if self.auc >= MIN_AUC and self.p_value <= threshold:
            self.revealed_by.append("TTFT")
        if self.cached_auc is not None and self.cached_auc >= MIN_AUC and (self.cached_p_value or 1) <= threshold:
            self.revealed_by.append("cached_tokens")

    def brief(self) -> str:
        parts = [f"TTFT AUC {self.auc:.2f}, p {self.p_value:.2g}"]
        if self.cached_auc is not None:
            parts.append(f"cached_tokens AUC {self.cached_auc:.2f}, p {self.cached_p_value:.2g}")
        return "; ".join(parts)

    def describe(self) -> str:
        ms = (1000 * statistics.median(self.hit_ttft), 1000 * statistics.median(self.miss_ttft))
        text = f"median TTFT hit {ms[0]:.1f} ms, miss {ms[1]:.1f} ms, AUC {self.auc:.2f} (p {self.p_value:.2g})"
        if self.cached_auc is not None:
            text += f"; cached_tokens AUC {self.cached_auc:.2f}"
        return text


@dataclass
class TimingReport:
    trials: int
    prefix_chars: int
    alpha: float
    runs: list[TimingRun] = field(default_factory=list)
    salted_measured: bool = True
    not_salted_because: str = ""
    verdict: str = "clean"  # leak | exposure | clean
    reason: str = ""

    def revealing(self, salted: bool) -> list[TimingRun]:
        return [r for r in self.runs if r.salted == salted and r.revealed_by]

    def salt_handling(self) -> str | None:
        """What the timing says of salts: honoured, ignored, or None (the cache never showed, or no salts)."""
        if not self.salted_measured:
            return None
        if self.revealing(True):
            return "ignored"
        return "honoured" if self.revealing(False) else None

    def conclude(self) -> None:
        tests = sum(1 + (r.cached_auc is not None) for r in self.runs)
        for r in self.runs:
            r.decide(self.alpha / max(tests, 1))
        salted, plain = self.revealing(True), self.revealing(False)

        def shapes(runs: list[TimingRun]) -> str:
            return "; ".join(f"{r.shape} ({r.brief()})" for r in runs)

        if salted:
            self.verdict, self.reason = "leak", f"a cache hit is visible across distinct salts: {shapes(salted)}"
        elif plain:
            hidden = [r.shape for r in self.runs if not r.salted and not r.revealed_by]
            tail = f"; not revealed by: {', '.join(hidden)}" if hidden else ""
            self.verdict = "exposure"
            self.reason = f"a cache hit is visible to clients without salts: revealed by {shapes(plain)}{tail}"
        else:
            best = max(self.runs, key=lambda r: r.auc)
            self.verdict = "clean"
            self.reason = (
                f"no cache hit visible with any victim shape (best: {best.shape}, {best.describe()}): no sharing, "
                "or hits below this machine's timing noise"
            )

    def render(self) -> str:
        lines = [f"timing: {self.trials} hit/miss pairs per run, {self.prefix_chars}-character prefixes"]
        for r in self.runs:
            label = "distinct salts" if r.salted else "no salts"
            seen = f"REVEALED by {', '.join(r.revealed_by)}" if r.revealed_by else "not revealed"
            lines.append(f"  {label:14} {r.shape:28} {r.describe()}: {seen}")
        if not self.salted_measured:
            lines.append(f"  distinct salts: not measured ({self.not_salted_because})")
        return "\n".join(lines)


class Sampler:
    """The run's traffic: fresh prompts (texts from the nonce), the structure from the seed's generator."""

    def __init__(self, client: ProbeClient, nonce: str, prefix_chars: int) -> None:
        self.client, self.nonce, self.prefix_chars = client, nonce, prefix_chars
        self.text_rng = random.Random(f"timing-{nonce}")
        self.count = 0

    def fresh(self, kind: str) -> str:
        """A new prefix. Victims' start with "v", misses' with "m": a miss shares not even its first character
        with a victim's prompt (kvlab reuses a free cached block in place when the first token matches)."""
        self.count += 1
        head = f"{kind}{sub_nonce(self.nonce, f'timing-{self.count}')} "
        return head + words(self.text_rng, self.prefix_chars - len(head))

    def salt(self, who: str) -> str:
        self.count += 1
        return f"{who}-{sub_nonce(self.nonce, f'salt-{self.count}')}"

    def probe(self, prompt: str, salt: str | None) -> tuple[float, int | None]:
        data, seconds = self.client.completion(prompt, 1, salt=salt)
        return seconds, cached_tokens_of(data)

    def sample(self, run: TimingRun, shape: Shape, arm: str) -> None:
        victim_salt, attacker_salt = (self.salt("victim"), self.salt("attacker")) if run.salted else (None, None)
        prefix = self.fresh("v")
        for _ in range(shape.sends):
            self.client.completion(prefix + " A", shape.max_tokens, salt=victim_salt)
        probe = prefix + " B" if arm == "hit" else self.fresh("m") + " B"
        seconds, cached = self.probe(probe, attacker_salt)
        (run.hit_ttft if arm == "hit" else run.miss_ttft).append(seconds)
        (run.hit_cached if arm == "hit" else run.miss_cached).append(cached)


def run_timing(
    client: ProbeClient,
    *,
    nonce: str,
    trials: int = 12,
    prefix_chars: int = 400,
    seed: int = 0,
    salts: bool = True,
    not_salted_because: str = "",
    alpha: float = 0.01,
    shapes: Sequence[Shape] = SHAPES,
    on_trial: Callable[[], None] | None = None,
) -> TimingReport:
    """Every shape without salts, then (if ``salts``) with distinct salts; see the module docstring.
    ``on_trial`` is called after each hit/miss pair (the probe's progress: ``trials`` per shape and condition)."""
    rng = random.Random(seed)  # the structure: which arm of a trial goes first, and the permutations
    sampler = Sampler(client, nonce, prefix_chars)
    sampler.probe(sampler.fresh("w"), None)  # discarded: the first request pays for lazy initialisation
    report = TimingReport(trials, prefix_chars, alpha, salted_measured=salts, not_salted_because=not_salted_because)
    for salted in (False, True) if salts else (False,):
        for shape in shapes:
            run = TimingRun(shape.name, salted)
            for _ in range(trials):
                for arm in rng.sample(["hit", "miss"], 2):
                    sampler.sample(run, shape, arm)
                if on_trial is not None:
                    on_trial()
            run.analyse(rng)
            report.runs.append(run)
    report.conclude()
    return report
