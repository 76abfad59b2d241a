"""``kvlab probe --timing``: can an attacker tell from time-to-first-token that a prefix is cached?

(vLLM CVE-2025-46570: prefix-cache hits are visible in TTFT.) Each trial draws a fresh random long
prefix. A "victim" request warms it; then the "attacker" sends the same prefix with another suffix
(a hit, if the cache is shared with it) and a never-seen prefix of the same length (a miss), in
random order. TTFT is the latency of a 1-token request. In the ``salted`` run the victim and the
attacker carry different cache salts, so on a server that honours salts the "hit" must miss too.

The AUC is P(TTFT of the hit < TTFT of the miss), ties counted half: 0.5 means the attacker
cannot tell, 1.0 means every hit is faster than every miss.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from dataclasses import dataclass

from kvlab.probe.probe import Client

_WORDS = [
    "amber",
    "falcon",
    "silver",
    "otter",
    "violet",
    "maple",
    "cobalt",
    "river",
    "ivory",
    "stone",
    "jade",
    "lantern",
    "coral",
    "harbor",
    "slate",
    "meadow",
]


@dataclass
class TimingRun:
    salted: bool
    hit_ttft: list[float]
    miss_ttft: list[float]

    @property
    def auc(self) -> float:
        return auc(self.hit_ttft, self.miss_ttft)


@dataclass
class TimingReport:
    trials: int
    prefix_chars: int
    unsalted: TimingRun
    salted: TimingRun

    def render(self) -> str:
        lines = [f"timing: {self.trials} trials, {self.prefix_chars}-character shared prefixes"]
        for run in (self.unsalted, self.salted):
            label = "distinct salts" if run.salted else "no salts     "
            lines.append(
                f"  {label}: median TTFT hit {1000 * statistics.median(run.hit_ttft):.1f} ms, "
                f"miss {1000 * statistics.median(run.miss_ttft):.1f} ms, AUC {run.auc:.2f}"
            )
        return "\n".join(lines)


def auc(positives: list[float], negatives: list[float]) -> float:
    """P(a positive's time is below a negative's), ties half: the Mann-Whitney AUC of "faster = hit"."""
    if not positives or not negatives:
        raise ValueError("the AUC needs at least one hit and one miss sample")
    wins = sum((p < n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def _prefix(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(_WORDS))
    return " ".join(words)[:chars]


def _ttft(client: Client, prompt: str, salt: str | None) -> float:
    t0 = time.perf_counter()
    client.complete(prompt, 1, salt=salt)
    return time.perf_counter() - t0


def timing_run(client: Client, rng: random.Random, salted: bool, trials: int, prefix_chars: int) -> TimingRun:
    """``trials`` hit and miss TTFT samples, the victim and the attacker salted apart or not at all."""
    hits: list[float] = []
    misses: list[float] = []
    for _ in range(trials):
        victim, attacker = (f"victim-{uuid.uuid4().hex}", f"attacker-{uuid.uuid4().hex}") if salted else (None, None)
        shared = _prefix(rng, prefix_chars)
        client.complete(shared + " A", 1, salt=victim)
        miss = _prefix(rng, prefix_chars)
        # A miss that shares even its first token with the victim's prompt takes over that cached block and
        # overwrites the rest of it (kvlab reuses a free cached block in place), so the hit would miss too.
        while miss[0] == shared[0]:
            miss = _prefix(rng, prefix_chars)
        tests = [("hit", shared + " B"), ("miss", miss + " B")]
        rng.shuffle(tests)
        for kind, prompt in tests:
            (hits if kind == "hit" else misses).append(_ttft(client, prompt, attacker))
    return TimingRun(salted, hits, misses)


def run_timing(
    base_url: str,
    model: str,
    *,
    trials: int = 20,
    prefix_chars: int = 400,
    seed: int = 0,
    api_key: str | None = None,
) -> TimingReport:
    with Client(base_url, model, api_key=api_key) as client:
        return _run_timing(client, trials, prefix_chars, seed)


def _run_timing(client: Client, trials: int, prefix_chars: int, seed: int) -> TimingReport:
    rng = random.Random(seed)
    # One discarded request: the first one pays for lazy initialisation on many servers.
    client.complete(_prefix(rng, prefix_chars), 1, salt=f"probe-warmup-{uuid.uuid4().hex}")
    unsalted = timing_run(client, rng, False, trials, prefix_chars)
    salted = timing_run(client, rng, True, trials, prefix_chars)
    return TimingReport(trials, prefix_chars, unsalted, salted)
