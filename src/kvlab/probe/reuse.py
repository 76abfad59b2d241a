"""Non-prefix reuse: does the attacker's answer depend on text the victim sent *before* a shared chunk?

Per group (see ``material`` for the prompts' layout), each trial uses a fresh nonce, one request at a time:

1. the attacker's prompt alone (prefix + chunk): its reference; it is the first prompt of this nonce, so it
   cannot meet anything cached;
2. control: a prompt like the victim's but with another chunk, then the attacker's prompt again: only the
   prefix can be reused (legitimately: same tokens at the same positions);
3. the victim's prompt (prefix + secret + chunk), then the attacker's prompt again: a server that reuses
   the chunk's K/V from the victim's prompt hands the attacker state computed after the secret.

Sequential on purpose: a single-slot server (llama.cpp, 1 slot) keeps exactly the previous request's K/V,
and a multi-slot one sends a prompt to the slot most similar to it, which is the victim's. The server's own
determinism is measured on a twin of each attacker prompt (its own nonce: never near a victim), alone and
in bursts of copies; the trials are sequential, so what decides is the twin's answers alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlab.probe.client import Answer, Client, HTTPStatusError
from kvlab.probe.determinism import Determinism, Difference, Request, measure
from kvlab.probe.material import ReuseGroup, sub_nonce


@dataclass
class ReuseTrial:
    group: str
    trial: int
    after_control: str  # same | diverged: the attacker's answer after prefix-only traffic
    after_victim: str  # same | diverged: after the victim's prompt
    evidence: list[Difference] = field(default_factory=list)  # every diverged answer with its reference


@dataclass
class ReuseResult:
    groups: list[str] = field(default_factory=list)  # measured
    skipped: dict[str, str] = field(default_factory=dict)  # group -> the server's refusal
    trials: list[ReuseTrial] = field(default_factory=list)
    determinism: Determinism = field(default_factory=Determinism)

    @property
    def diverged(self) -> int:
        return sum(t.after_victim == "diverged" for t in self.trials)

    @property
    def control_diverged(self) -> int:
        return sum(t.after_control == "diverged" for t in self.trials)


def _trial(client: Client, g: ReuseGroup, t: int, nonce: str, max_tokens: int) -> ReuseTrial:
    n = sub_nonce(nonce, f"reuse-{g.name}-{t}")
    secret = g.secrets[t % len(g.secrets)]
    attacker = g.attacker(n)
    ref = client.complete(attacker, max_tokens)
    client.complete(g.control(n, secret), max_tokens)
    after_control = client.complete(attacker, max_tokens)
    client.complete(g.victim(n, secret), max_tokens)
    after_victim = client.complete(attacker, max_tokens)
    trial = ReuseTrial(g.name, t, "same", "same")
    for label, ans in (("after the control prompt", after_control), ("after the victim's prompt", after_victim)):
        if ans.key() != ref.key():
            trial.evidence.append(Difference.of(attacker, label, ref, ans))
            if label.endswith("victim's prompt"):
                trial.after_victim = "diverged"
            else:
                trial.after_control = "diverged"
    return trial


def run_reuse(
    client: Client,
    groups: Sequence[ReuseGroup],
    *,
    nonce: str,
    trials: int,
    repeats: int,
    copies: int,
    max_tokens: int,
    stagger: float,
    rng: random.Random,
) -> ReuseResult:
    result = ReuseResult()
    twins: list[tuple[Request, Answer]] = []
    for g in groups:
        twin = g.attacker(sub_nonce(nonce, f"reuse-twin-{g.name}"))
        try:
            ref = client.complete(twin, max_tokens)
            group_trials = [_trial(client, g, t, nonce, max_tokens) for t in range(trials)]
        except HTTPStatusError as exc:  # e.g. longer than the server's context: skip the group, say why
            if not 400 <= exc.status < 500:
                raise
            result.skipped[g.name] = str(exc)
            continue
        twins.append((Request(twin), ref))
        result.groups.append(g.name)
        result.trials += group_trials
    result.determinism = measure(
        client, twins, repeats=repeats, copies=copies, max_tokens=max_tokens, stagger=stagger, rng=rng
    )
    return result
