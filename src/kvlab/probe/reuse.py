"""Non-prefix reuse: does the attacker's answer depend on text the victim sent *before* a shared chunk?

Per group (see ``material`` for the prompts' layout), each trial uses a fresh nonce, one request at a time:

1. the attacker's prompt alone (prefix + chunk): its first answer, kept as evidence; it is the first prompt
   of this nonce, so it cannot meet anything cached;
2. control: a prompt like the victim's but with another chunk, then the attacker's prompt: only the prefix
   can be reused (legitimately: same tokens at the same positions);
3. the same control and attacker prompts again: whether the server answers alike from the same cache state
   (a server that caches prompts need not answer a cached prompt as it answered it fresh: llama.cpp
   recomputes only the last token, in another kernel shape, and near-ties flip);
4. the victim's prompt (prefix + secret + chunk), then the attacker's prompt: a server that reuses the
   chunk's K/V from the victim's prompt hands the attacker state computed after the secret.

Before those steps, on two nonces of their own, the probe sends the victim's prompt then the attacker's, and
a control then the attacker's, each attacker prompt for the first time, and reads the cached-token count the
server reports (where it reports one). More cached tokens after the victim than after the control is chunk
reuse seen directly, beyond the shared prefix. It also survives a server with a host prompt cache
(llama.cpp's ``--cache-ram``, on by default), which restores the attacker's *repeated* prompt whole from its
own earlier sends and so never shifts the victim's chunk in during the paired steps below: those steps
alone reported a false "clean" there. A leak by this channel is the sign test over trials: more than
``CACHED_SLACK`` more cached tokens after the victim, against the trials with that many fewer, p <= ``alpha``.

The comparison of answers is paired: the answer after the victim against the answer after the control,
both given the same cached prefix, and step 3 measures how often that pair differs with no victim at all.
A leak is a divergence after the victim that the control repeats cannot explain (Fisher's exact test,
one-sided, at the probe's ``alpha``).

Sequential on purpose: a single-slot server (llama.cpp, 1 slot) keeps exactly the previous request's K/V,
and a multi-slot one sends a prompt to the slot most similar to it, which is the victim's. The server's own
determinism is measured on a twin of each attacker prompt (its own nonce: never near a victim), alone and
in bursts of copies; the trials are sequential, so what decides is the twin's answers alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlab.openai_http import cached_tokens_of
from kvlab.probe.budget import Allowance
from kvlab.probe.client import Answer, GaveUp, HTTPStatusError, ProbeClient
from kvlab.probe.compare import fisher_greater
from kvlab.probe.determinism import Determinism, Difference, Request, measure
from kvlab.probe.material import ReuseGroup, sub_nonce

# Differences of cached-token counts up to this many tokens are bookkeeping, not reuse: llama.cpp without chunk
# reuse reported up to 4 more or fewer between the two arms (its slot and host-cache matching); a reused chunk is
# at least --cache-reuse N tokens (tens to hundreds here).
CACHED_SLACK = 8


@dataclass
class ReuseTrial:
    group: str
    trial: int
    after_control: str  # same | diverged: after the second control, against the answer after the first
    after_victim: str  # same | diverged: after the victim's prompt, against the answer after the first control
    fresh_vs_cached: str = "same"  # same | diverged: after the first control, against the attacker's fresh answer
    # Cached tokens the server reported for the attacker's first-time prompt after the victim's, and after a
    # control's (two nonces of their own; None: not reported).
    cached_after_victim: int | None = None
    cached_after_control: int | None = None
    evidence: list[Difference] = field(default_factory=list)  # every diverged answer with its reference


@dataclass
class ReuseResult:
    groups: list[str] = field(default_factory=list)  # measured
    skipped: dict[str, str] = field(default_factory=dict)  # group -> the server's refusal
    trials: list[ReuseTrial] = field(default_factory=list)
    determinism: Determinism = field(default_factory=Determinism)
    # Trials (or a group, when its twin's reference) with a request that gave up after its retries: what it was.
    dropped: list[str] = field(default_factory=list)
    dropped_trials: int = 0  # the trials lost so (all of a group's when its twin's reference was lost)
    trials_run: int = 0  # per group (fewer than asked where the time budget ran out: ``budget``)

    @property
    def diverged(self) -> int:
        return sum(t.after_victim == "diverged" for t in self.trials)

    @property
    def control_diverged(self) -> int:
        return sum(t.after_control == "diverged" for t in self.trials)

    def cached_differences(self) -> list[int]:
        """Per trial where the server reported both: cached tokens after the victim minus after the control."""
        return [
            t.cached_after_victim - t.cached_after_control
            for t in self.trials
            if t.cached_after_victim is not None and t.cached_after_control is not None
        ]

    @property
    def cached_excess(self) -> int:
        """Trials whose first-time attacker prompt found more than ``CACHED_SLACK`` more cached tokens after the
        victim than after a control."""
        return sum(d > CACHED_SLACK for d in self.cached_differences())

    @property
    def cached_deficit(self) -> int:
        return sum(d < -CACHED_SLACK for d in self.cached_differences())

    def cached_p_value(self) -> float:
        """Sign test, one-sided: the chance of at least this many excesses among the trials that differ (scipy's
        ``binomtest`` at one half, alternative "greater")."""
        k, n = self.cached_excess, self.cached_excess + self.cached_deficit
        if not n:
            return 1.0
        from scipy.stats import binomtest  # imported here: importing the probe stays cheap

        return float(binomtest(k, n, 0.5, alternative="greater").pvalue)

    def p_value(self) -> float:
        """One-sided Fisher exact test: the chance of at least this many divergences after the victim if
        victim and control trials diverged alike (hypergeometric tail over the pooled count)."""
        n = len(self.trials)
        return fisher_greater(self.diverged, n, self.control_diverged, n)


TRIAL_REQUESTS = 12  # what one ``_trial`` sends (the probe's plan counts them)


def _trial(client: ProbeClient, g: ReuseGroup, t: int, nonce: str, max_tokens: int) -> ReuseTrial:
    n = sub_nonce(nonce, f"reuse-{g.name}-{t}")
    secret = g.secrets[t % len(g.secrets)]
    attacker, control = g.attacker(n), g.control(n, secret)
    first_v, first_c = sub_nonce(nonce, f"reuse-{g.name}-{t}-v"), sub_nonce(nonce, f"reuse-{g.name}-{t}-c")
    client.complete(g.victim(first_v, secret), max_tokens)
    cached_v = cached_tokens_of(client.completion(g.attacker(first_v), 1)[0])
    client.complete(g.control(first_c, secret), max_tokens)
    cached_c = cached_tokens_of(client.completion(g.attacker(first_c), 1)[0])
    fresh = client.complete(attacker, max_tokens)
    client.complete(control, max_tokens)
    after_control = client.complete(attacker, max_tokens)
    client.complete(control, max_tokens)
    again = client.complete(attacker, max_tokens)
    client.complete(g.victim(n, secret), max_tokens)
    after_victim = client.complete(attacker, max_tokens)
    trial = ReuseTrial(g.name, t, "same", "same", cached_after_victim=cached_v, cached_after_control=cached_c)
    if after_control.key() != fresh.key():
        trial.fresh_vs_cached = "diverged"
    if again.key() != after_control.key():
        trial.after_control = "diverged"
        trial.evidence.append(Difference.of(attacker, "after the control prompt, again", after_control, again))
    if after_victim.key() != after_control.key():
        trial.after_victim = "diverged"
        trial.evidence.append(Difference.of(attacker, "after the victim's prompt", after_control, after_victim))
    return trial


def run_reuse(
    client: ProbeClient,
    groups: Sequence[ReuseGroup],
    *,
    nonce: str,
    trials: int,
    repeats: int,
    copies: int,
    max_tokens: int,
    stagger: float,
    rng: random.Random,
    on_step: Callable[[], None] | None = None,
    allowance: Allowance | None = None,
) -> ReuseResult:
    """Each group's twin reference, then the trials round by round over the groups (trial 0 of every group,
    then trial 1, ...), then the determinism of each group's twin. ``on_step`` (the probe's progress) is called
    ``trials + 1`` times per group: after each trial and after its twin's measurements (all at once for a group
    that is skipped or a round left out); ``allowance``: the phase's share of the time budget (a round of
    trials it cannot afford is not run, the first always is; the twins' determinism is cut as ``measure``
    cuts it)."""
    tick = on_step if on_step is not None else lambda: None
    result = ReuseResult()
    twins: dict[str, tuple[Request, Answer]] = {}
    done: dict[str, list[ReuseTrial]] = {}

    def refused(g: ReuseGroup, exc: HTTPStatusError, ticks: int) -> None:
        """A refusal (e.g. longer than the server's context) skips ``g`` whole, saying why; others raise."""
        if not 400 <= exc.status < 500:
            raise exc
        result.skipped[g.name] = str(exc)
        done.pop(g.name, None)
        twins.pop(g.name, None)
        for _ in range(ticks):
            tick()

    for g in groups:
        twin = g.attacker(sub_nonce(nonce, f"reuse-twin-{g.name}"))
        try:
            twins[g.name] = (Request(twin), client.complete(twin, max_tokens))
            done[g.name] = []
        except HTTPStatusError as exc:
            refused(g, exc, trials + 1)
        except GaveUp as exc:  # the twin's reference: nothing of the group can be compared
            result.dropped.append(f"{g.name} (its reference): {exc}")
            result.dropped_trials += trials
            for _ in range(trials + 1):
                tick()
    live = [g for g in groups if g.name in done]
    rounds = None if allowance is None else allowance.from_now()
    for t in range(trials):
        if rounds is not None and not rounds.affords(t):
            for _ in range((trials - t) * len(done)):
                tick()
            break
        result.trials_run = t + 1
        for g in [g for g in live if g.name in done]:
            try:
                done[g.name].append(_trial(client, g, t, nonce, max_tokens))
            except GaveUp as exc:  # a request of this trial still failed after its retries: drop the trial
                result.dropped.append(f"{g.name} trial {t}: {exc}")
                result.dropped_trials += 1
            except HTTPStatusError as exc:  # refused: the group is skipped whole, as if refused at once
                refused(g, exc, trials - t + 1)  # this trial's tick, the later ones' and its twin's
                continue
            tick()
    for g in live:
        if g.name in done:
            result.groups.append(g.name)
            result.trials += done[g.name]
    result.determinism = measure(
        client,
        list(twins.values()),
        repeats=repeats,
        copies=copies,
        max_tokens=max_tokens,
        stagger=stagger,
        rng=rng,
        on_item=tick,
        allowance=None if allowance is None else allowance.from_now(),
    )
    return result
