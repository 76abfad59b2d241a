"""Bursts of prefix-sharing prompts: does one request's answer carry another's state?

The prompts of one passphrase group (a long shared prefix, a short private suffix) are sent concurrently,
``concurrency`` requests cycling through the group with small staggered arrivals (so later ones find the
earlier ones' prefixes in the cache), without salts, so sharing is possible. Each answer is ``same`` (equal
to its own reference), ``contaminated`` (it follows another prompt's reference beyond chance: see
``compare``) or ``diverged`` (different, with no sign of another prompt).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlab.probe.budget import Allowance
from kvlab.probe.client import Answer, ProbeClient
from kvlab.probe.compare import Criterion, classify, reachable
from kvlab.probe.determinism import Request, burst

OUTCOMES = ("same", "diverged", "contaminated")


@dataclass(frozen=True)
class Group:
    name: str
    prompts: tuple[str, ...]  # as sent: the run's nonce tag included
    chat: bool = False


@dataclass
class Observation:
    group: str
    prompt_index: int
    round: int
    outcome: str
    own_prefix: int  # common-prefix length with its own reference
    closest_other: int | None  # the other prompt whose reference it follows furthest
    other_prefix: int
    excess: int  # how far past the point where the two references part (see compare)
    # The evidence, for every answer that is not the same as its reference:
    answer: str | None = None
    answer_ids: list[int] | None = None
    reference: str | None = None
    reference_ids: list[int] | None = None
    other_reference: str | None = None
    other_reference_ids: list[int] | None = None


@dataclass
class BurstResult:
    counts: dict[str, int] = field(default_factory=dict)
    uninformative_groups: list[str] = field(default_factory=list)  # every reference equal
    unreachable_groups: list[str] = field(default_factory=list)  # answers too short to beat chance
    unreferenced_groups: list[str] = field(default_factory=list)  # not sent: a reference gave up (probe)
    observations: list[Observation] = field(default_factory=list)
    dropped: int = 0  # requests that gave up after their retries: in no count
    rounds: int = 0  # rounds run (fewer than asked where the time budget ran out)

    @property
    def contaminated(self) -> int:
        return self.counts.get("contaminated", 0)

    @property
    def diverged(self) -> int:
        return self.counts.get("diverged", 0)


def observe(group: Group, idx: int, rnd: int, ans: Answer, refs: Sequence[Answer], crit: Criterion) -> Observation:
    v = classify(ans, idx, refs, crit)
    obs = Observation(group.name, idx, rnd, v.outcome, v.own_prefix, v.closest_other, v.other_prefix, v.excess)
    if v.outcome != "same":
        obs.answer, obs.answer_ids = ans.text, _ids(ans)
        obs.reference, obs.reference_ids = refs[idx].text, _ids(refs[idx])
        if v.closest_other is not None:
            other = refs[v.closest_other]
            obs.other_reference, obs.other_reference_ids = other.text, _ids(other)
    return obs


def _ids(a: Answer) -> list[int] | None:
    return list(a.token_ids) if a.token_ids is not None else None


def run_bursts(
    client: ProbeClient,
    groups: Sequence[Group],
    refs: dict[str, list[Answer]],
    criterion: Criterion,
    *,
    concurrency: int,
    rounds: int,
    max_tokens: int,
    stagger: float,
    rng: random.Random,
    on_burst: Callable[[], None] | None = None,
    allowance: Allowance | None = None,
) -> BurstResult:
    """``rounds`` bursts of every group; ``on_burst`` is called after each burst (the probe's progress);
    ``allowance``: the phase's share of the time budget (a round it cannot afford is not run)."""
    result = BurstResult()
    for g in groups:
        if len({a.key() for a in refs[g.name]}) < 2:
            result.uninformative_groups.append(g.name)
        elif not reachable(refs[g.name], criterion):
            result.unreachable_groups.append(g.name)
    counts: Counter[str] = Counter({o: 0 for o in OUTCOMES})
    for r in range(rounds):
        if allowance is not None and not allowance.affords(r):
            break
        result.rounds = r + 1
        for g in groups:
            order = [i % len(g.prompts) for i in range(concurrency)]
            rng.shuffle(order)
            answers = burst(client, [Request(g.prompts[i], g.chat) for i in order], max_tokens, stagger, rng)
            for idx, ans in zip(order, answers, strict=True):
                if ans is None:  # gave up after its retries: the burst is measured without it
                    result.dropped += 1
                    continue
                obs = observe(g, idx, r, ans, refs[g.name], criterion)
                counts[obs.outcome] += 1
                result.observations.append(obs)
            if on_burst is not None:
                on_burst()
    result.counts = dict(counts)
    return result
