"""``kvlab probe``: does a server leak one request's KV state into another's output or timing?

A black-box probe has to be right on servers nobody here wrote, so it first finds out what the server
offers and how it behaves on its own, then measures, and backs every verdict with its evidence:

1. Capabilities (``client.detect_capabilities``): how to get token ids, whether ``cached_tokens`` is
   reported, whether ``cache_salt`` is accepted; whether /metrics answers the probe and its prefix-cache-hit
   counter moves for the probe's own repeated prompt (``metrics``).
2. Salts (``salts``): honoured, ignored (a leak) or rejected (then the probe carries on without them).
3. References: every prompt alone, one at a time, under a fresh salt where salts are accepted. With them,
   unrelated calibration prompts: how much unrelated answers share by chance sets the contamination
   criterion (``compare``).
4. Determinism (``determinism``): each prompt alone again and in a burst of copies of itself.
5. Bursts of prefix-sharing prompts (``bursts``); non-prefix reuse trials (``reuse``); with ``timing``,
   TTFT and cached_tokens of hits and misses for several victim shapes, without and with salts (``timing``).
6. Findings and the verdict (``report``).

The caller may watch: ``run_probe(progress=)`` gets each phase as it starts, moves and ends (``progress``;
the probe itself never prints).

Every prompt starts with a per-run nonce (``material``): a re-run never meets the previous run's entries.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any

from kvlab.experiment.passphrases import PassphraseSet
from kvlab.probe.bursts import Group, run_bursts
from kvlab.probe.client import (
    Answer,
    Capabilities,
    HTTPStatusError,
    ProbeClient,
    ProbeError,
    detect_capabilities,
)
from kvlab.probe.compare import Criterion, calibrate, classify
from kvlab.probe.determinism import Request, measure
from kvlab.probe.material import ReuseGroup, calibration_prompts, default_reuse_groups, new_nonce, sub_nonce, tag
from kvlab.probe.metrics import check_metrics
from kvlab.probe.progress import Phases, ProgressCallback, Tick, no_tick
from kvlab.probe.report import ProbeReport, render
from kvlab.probe.reuse import run_reuse
from kvlab.probe.salts import SaltFinding, check_with_cached_tokens, from_timing, rejected
from kvlab.probe.timing import SHAPES, Shape, TimingReport, run_timing


@dataclass
class ProbeConfig:
    concurrency: int = 8
    rounds: int = 3
    max_tokens: int = 16
    stagger: float = 0.02  # seconds over which a burst's arrivals are spread
    seed: int = 0  # the structure (orders, offsets); the texts come from the run's nonce
    determinism_repeats: int = 2  # each prompt alone again, this many times
    calibration_prompts: int = 8  # unrelated prompts for the chance rate
    reuse_trials: int = 3  # per non-prefix reuse group
    timing: bool = False
    timing_trials: int = 12  # hit/miss pairs per victim shape and salt condition
    timing_prefix_chars: int = 400
    timing_shapes: tuple[Shape, ...] = SHAPES  # the victim shapes to measure (all of them unless testing one)
    alpha: float = 0.01  # timing: family-wise false-positive rate over all shapes and channels

    def validate(self) -> None:
        if min(self.concurrency, self.rounds, self.max_tokens, self.determinism_repeats, self.timing_trials) < 1:
            raise ValueError("concurrency, rounds, max_tokens, determinism_repeats and timing_trials must be >= 1")
        if self.timing_prefix_chars < 32:  # room for the nonce head and some words
            raise ValueError(f"timing_prefix_chars must be >= 32, got {self.timing_prefix_chars}")
        if self.calibration_prompts < 2 or self.reuse_trials < 0 or not 0 < self.alpha < 1 or not self.timing_shapes:
            raise ValueError("calibration_prompts >= 2, reuse_trials >= 0, 0 < alpha < 1 and a timing shape required")


def run_probe(
    base_url: str,
    model: str,
    passphrases: PassphraseSet,
    config: ProbeConfig | None = None,
    *,
    api_key: str | None = None,
    metrics_api_key: str | None = None,
    reuse_groups: list[ReuseGroup] | None = None,
    progress: ProgressCallback | None = None,
    **overrides: Any,
) -> ProbeReport:
    """Probe ``base_url``, the server's root or its ``/v1`` URL (see the module docstring). ``overrides``
    replace fields of ``config``; ``reuse_groups``: None for the built-in ones, [] to skip non-prefix reuse;
    ``metrics_api_key``: read /metrics with it (an operator auditing their own server) instead of as a client
    can; ``progress``: called as each phase starts, moves and ends (``kvlab.probe.progress``)."""
    cfg = dataclasses.replace(config or ProbeConfig(), **overrides)
    cfg.validate()
    groups = default_reuse_groups() if reuse_groups is None else reuse_groups
    with ProbeClient(base_url, model, api_key=api_key, max_connections=cfg.concurrency) as client:
        return _run(client, passphrases, groups, cfg, (metrics_api_key, api_key), Phases(progress))


def _references(
    client: ProbeClient, groups: list[Group], nonce: str, caps: Capabilities, cfg: ProbeConfig, tick: Tick = no_tick
) -> tuple[dict[str, list[Answer]], Criterion]:
    """Every prompt alone (under a fresh salt where salts are accepted, so that on a server that honours them
    a reference cannot meet anything cached), and the criterion calibrated on unrelated references; ``tick``
    after every request."""

    def salt(label: str) -> str | None:
        return f"probe-ref-{sub_nonce(nonce, label)}" if caps.salt.accepted else None

    def complete(prompt: str, chat: bool, label: str) -> Answer:
        answer = client.complete(prompt, cfg.max_tokens, chat, salt(label))
        tick()
        return answer

    refs = {g.name: [complete(p, g.chat, f"{g.name}-{i}") for i, p in enumerate(g.prompts)] for g in groups}
    labelled = [(name, a) for name, answers in refs.items() for a in answers]
    for k, prompt in enumerate(calibration_prompts(nonce, cfg.calibration_prompts)):
        labelled.append((f"calibration-{k}", complete(prompt, False, f"cal-{k}")))
    return refs, calibrate(labelled, caps.unit)


def _salts(client: ProbeClient, caps: Capabilities, nonce: str) -> SaltFinding:
    if not caps.salt.accepted:
        return rejected(caps.salt)
    if caps.cached_tokens:
        return check_with_cached_tokens(client, nonce)
    return SaltFinding("undetermined", detail="accepted; cached_tokens is not reported (--timing can tell)")


def _timing(
    client: ProbeClient, caps: Capabilities, nonce: str, cfg: ProbeConfig, tick: Tick = no_tick
) -> TimingReport:
    return run_timing(
        client,
        nonce=nonce,
        trials=cfg.timing_trials,
        prefix_chars=cfg.timing_prefix_chars,
        seed=cfg.seed,
        salts=caps.salt.accepted,  # a server that refuses salts can only be measured without them
        not_salted_because="" if caps.salt.accepted else "the server rejects cache_salt",
        alpha=cfg.alpha,
        shapes=cfg.timing_shapes,
        on_trial=tick,
    )


def _run(
    client: ProbeClient,
    pset: PassphraseSet,
    reuse_groups: list[ReuseGroup],
    cfg: ProbeConfig,
    keys: tuple[str | None, str | None] = (None, None),
    phases: Phases | None = None,
) -> ProbeReport:
    """The probe's steps (see the module docstring); ``keys``: the metrics API key and the probe's own;
    ``phases``: where each phase is reported as it runs."""
    t0 = time.perf_counter()
    ph = phases or Phases()
    nonce, rng = new_nonce(), random.Random(cfg.seed)
    groups = [Group(g.name, tuple(tag(nonce, p) for p in g.prompts), g.chat_template) for g in pset.groups]
    with ph.phase("capabilities"):
        caps = detect_capabilities(client, tag(nonce, "Say hello."), any(g.chat for g in groups))
    with ph.phase("salts"):
        salts = _salts(client, caps, nonce)
    with ph.phase("references", sum(len(g.prompts) for g in groups) + cfg.calibration_prompts) as tick:
        refs, criterion = _references(client, groups, nonce, caps, cfg, tick)
    burst_kw: dict[str, Any] = dict(max_tokens=cfg.max_tokens, stagger=cfg.stagger, rng=rng)
    items = [(Request(p, g.chat), refs[g.name][i]) for g in groups for i, p in enumerate(g.prompts)]
    copy_salt = (lambda label: f"probe-copy-{sub_nonce(nonce, label)}") if caps.salt.accepted else None
    with ph.phase("determinism", len(items)) as tick:
        det = measure(
            client,
            items,
            repeats=cfg.determinism_repeats,
            copies=cfg.concurrency,
            salt=copy_salt,
            on_item=tick,
            **burst_kw,
        )
    with ph.phase("bursts", cfg.rounds * len(groups)) as tick:
        bursts = run_bursts(
            client,
            groups,
            refs,
            criterion,
            concurrency=cfg.concurrency,
            rounds=cfg.rounds,
            on_burst=tick,
            **burst_kw,
        )
    reuse = None
    if reuse_groups:
        with ph.phase("reuse", len(reuse_groups) * (cfg.reuse_trials + 1)) as tick:
            reuse = run_reuse(
                client,
                reuse_groups,
                nonce=nonce,
                trials=cfg.reuse_trials,
                repeats=cfg.determinism_repeats,
                copies=cfg.concurrency,
                on_step=tick,
                **burst_kw,
            )
    timing = None
    if cfg.timing:
        conditions = 2 if caps.salt.accepted else 1  # without salts, and with distinct ones where accepted
        with ph.phase("timing", conditions * len(cfg.timing_shapes) * cfg.timing_trials) as tick:
            timing = _timing(client, caps, nonce, cfg, tick)
    if timing is not None and salts.handling == "undetermined":
        salts = from_timing(timing.salt_handling()) or salts
    # Its two requests carry the nonce, after everything else: they meet nothing of the run's.
    with ph.phase("metrics"):
        metrics = check_metrics(client, tag(nonce, "Does /metrics count the cache hit of this prompt? " * 2), *keys)
    report = ProbeReport(
        base_url=client.base_url,
        model=client.model,
        nonce=nonce,
        seed=cfg.seed,
        rounds=cfg.rounds,
        concurrency=cfg.concurrency,
        max_tokens=cfg.max_tokens,
        capabilities=caps,
        criterion=criterion,
        salts=salts,
        determinism=det,
        bursts=bursts,
        reuse=reuse,
        timing=timing,
        metrics=metrics,
        alpha=cfg.alpha,
    )
    report.conclude()
    report.seconds = time.perf_counter() - t0
    return report


__all__ = [
    "Answer",
    "HTTPStatusError",
    "ProbeClient",
    "ProbeConfig",
    "ProbeError",
    "ProbeReport",
    "ProgressCallback",
    "classify",
    "render",
    "run_probe",
]
