"""``kvlab probe``: does a server leak one request's KV state into another's output or timing?

A black-box probe has to be right on servers nobody here wrote, so it first finds out what the server
offers and how it behaves on its own, then measures, and backs every verdict with its evidence:

1. Capabilities (``client.detect_capabilities``): how to get token ids, whether ``cached_tokens`` is
   reported, whether ``cache_salt`` is accepted; whether /metrics answers the probe and its prefix-cache-hit
   counter moves for the probe's own repeated prompt (``metrics``). Only a server that answers neither of
   the first two completions ends the probe here (``ProbeError``: nothing could be measured).
2. Granularity (``granularity``): how long a prompt must be for a hit on it to show (vLLM's CPU blocks are
   128 tokens, llama.cpp's cache is per token), by cached_tokens or, with ``timing``, TTFT. The salt check's
   prompt and the timing prefixes are sized from it (at least two blocks, within the model's context); where
   no hit shows up to a bound short of the context, neither may say clean.
   Salts (``salts``): honoured, ignored (a leak) or rejected (then the probe carries on without them).
3. References: every prompt alone, one at a time, under a fresh salt where salts are accepted. With them,
   unrelated calibration prompts: how much unrelated answers share by chance sets the contamination
   criterion (``compare``). A reference that gives up after its retries leaves its group out of what
   follows (determinism, bursts): the contamination finding is then inconclusive, never clean, and says how
   many gave up and why; the other phases run as ever.
4. Determinism (``determinism``): each prompt alone again and in a burst of copies of itself.
5. Bursts of prefix-sharing prompts (``bursts``); non-prefix reuse trials (``reuse``); with ``timing``,
   TTFT and cached_tokens of hits and misses for several victim shapes, without and with salts (``timing``,
   with as many pairs as its tests need to be able to reach ``alpha``), the victim's requests sent with the
   victim's API key where one is given (another tenant), the attacker's with the probe's.
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
from kvlab.probe.budget import DEFAULT_MAX_SECONDS, Budget
from kvlab.probe.bursts import Group, run_bursts
from kvlab.probe.client import (
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    Answer,
    Capabilities,
    HTTPStatusError,
    ProbeClient,
    ProbeError,
    detect_capabilities,
)
from kvlab.probe.compare import Criterion, calibrate, classify
from kvlab.probe.determinism import Request, measure
from kvlab.probe.granularity import (
    SEARCH_TOKENS,
    START_TOKENS,
    Granularity,
    measure_granularity,
    search_requests,
)
from kvlab.probe.material import (
    TAG_CHARS,
    ReuseGroup,
    calibration_prompts,
    default_reuse_groups,
    new_nonce,
    sub_nonce,
    tag,
)
from kvlab.probe.metrics import check_metrics
from kvlab.probe.progress import Phases, ProgressCallback, Tick, no_tick
from kvlab.probe.report import ProbeReport, render
from kvlab.probe.reuse import TRIAL_REQUESTS, run_reuse
from kvlab.probe.salts import (
    SALT_PROMPT_CHARS,
    SaltFinding,
    check_with_cached_tokens,
    from_timing,
    not_measured,
    rejected,
)
from kvlab.probe.timing import SHAPES, Shape, TimingReport, run_timing, timing_plan


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
    timing: bool = True  # the TTFT runs (and the granularity search by TTFT where cached_tokens is not reported)
    timing_trials: int = 8  # hit/miss pairs per victim shape and salt condition (raised if it cannot reach alpha)
    timing_prefix_chars: int = 400  # at least; longer where the server's cache blocks need it (granularity)
    timing_shapes: tuple[Shape, ...] = SHAPES  # the victim shapes to measure (all of them unless testing one)
    alpha: float = 0.01  # timing: family-wise false-positive rate over all shapes and channels
    search_tokens: int = SEARCH_TOKENS  # the granularity search's longest prefix, where the context is longer
    request_timeout: float = DEFAULT_TIMEOUT  # seconds per attempt of a request (client.ProbeClient)
    retries: int = DEFAULT_RETRIES  # further attempts after a timeout, a connection error, a 429 or a 5xx
    max_seconds: float | None = DEFAULT_MAX_SECONDS  # the time budget the cuttable phases share (None: none)

    def validate(self) -> None:
        if min(self.concurrency, self.rounds, self.max_tokens, self.determinism_repeats, self.timing_trials) < 1:
            raise ValueError("concurrency, rounds, max_tokens, determinism_repeats and timing_trials must be >= 1")
        if self.timing_prefix_chars < 32:  # room for the nonce head and some words
            raise ValueError(f"timing_prefix_chars must be >= 32, got {self.timing_prefix_chars}")
        if self.search_tokens < START_TOKENS:
            raise ValueError(f"search_tokens must be >= {START_TOKENS} (the search's start), got {self.search_tokens}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0 (or None: no time bound), got {self.max_seconds}")
        if self.calibration_prompts < 2 or self.reuse_trials < 0 or not 0 < self.alpha < 1 or not self.timing_shapes:
            raise ValueError("calibration_prompts >= 2, reuse_trials >= 0, 0 < alpha < 1 and a timing shape required")


def plan_requests(cfg: ProbeConfig, pset: PassphraseSet, reuse_groups: list[ReuseGroup] | None) -> dict[str, int]:
    """The most requests each phase of ``run_probe`` sends with this configuration, before anything is known of
    the server (so as if it accepted salts and reported cached tokens; retries not counted): what the command
    says before its first request. ``reuse_groups``: as ``run_probe`` takes them."""
    groups = default_reuse_groups() if reuse_groups is None else reuse_groups
    prompts = sum(len(g.prompts) for g in pset.groups)
    determinism = cfg.determinism_repeats + 2 * cfg.concurrency  # alone again, copies, salted copies
    plan = {
        "capabilities": 6,
        "granularity": search_requests(cfg.search_tokens, cfg.timing),
        "salts": 4,
        "references": prompts + cfg.calibration_prompts,
        "determinism": prompts * determinism,
        "bursts": cfg.rounds * len(pset.groups) * cfg.concurrency,
    }
    if groups:
        plan["reuse"] = len(groups) * (1 + TRIAL_REQUESTS * cfg.reuse_trials + determinism)
    if cfg.timing:
        _, pairs = timing_plan(cfg.timing_trials, cfg.alpha, len(cfg.timing_shapes), True, True)
        per_condition = sum(2 * pairs * (shape.sends + 1) for shape in cfg.timing_shapes)
        # The warm-up requests (and a timed miss that paces the time budget), then without and with salts.
        plan["timing"] = 2 + (cfg.max_seconds is not None) + 2 * per_condition
    plan["metrics"] = 4
    return plan


def run_probe(
    base_url: str,
    model: str,
    passphrases: PassphraseSet,
    config: ProbeConfig | None = None,
    *,
    api_key: str | None = None,
    metrics_api_key: str | None = None,
    victim_api_key: str | None = None,
    reuse_groups: list[ReuseGroup] | None = None,
    progress: ProgressCallback | None = None,
    **overrides: Any,
) -> ProbeReport:
    """Probe ``base_url``, the server's root or its ``/v1`` URL (see the module docstring). ``overrides``
    replace fields of ``config``; ``reuse_groups``: None for the built-in ones, [] to skip non-prefix reuse;
    ``metrics_api_key``: read /metrics with it (an operator auditing their own server) instead of as a client
    can; ``victim_api_key``: the timing's victim sends with it, on a connection of its own (another tenant;
    None: the probe's own key); ``progress``: called as each phase starts, moves and ends
    (``kvlab.probe.progress``)."""
    cfg = dataclasses.replace(config or ProbeConfig(), **overrides)
    cfg.validate()
    groups = default_reuse_groups() if reuse_groups is None else reuse_groups
    with ProbeClient(base_url, model, cfg.request_timeout, api_key, cfg.concurrency, cfg.retries) as client:
        if victim_api_key is None or not cfg.timing:
            watch = client.watch(progress)
            return _run(client, passphrases, groups, cfg, (metrics_api_key, api_key), Phases(watch))
        with ProbeClient(base_url, model, cfg.request_timeout, victim_api_key, 2, cfg.retries) as victim:
            watch = victim.watch(client.watch(progress))  # both clients count their requests by phase
            return _run(client, passphrases, groups, cfg, (metrics_api_key, api_key), Phases(watch), victim)


def _references(
    client: ProbeClient, groups: list[Group], nonce: str, caps: Capabilities, cfg: ProbeConfig, tick: Tick = no_tick
) -> tuple[dict[str, list[Answer]], Criterion]:
    """Every prompt alone (under a fresh salt where salts are accepted, so that on a server that honours them
    a reference cannot meet anything cached), and the criterion calibrated on unrelated references; ``tick``
    after every request. A reference that gave up after its retries is dropped (``stats`` counts it): its
    group is left out of the answers returned (none of the group's answers could be told from another's
    reference), its answered references and the calibration prompts answered still calibrate."""

    def salt(label: str) -> str | None:
        return f"probe-ref-{sub_nonce(nonce, label)}" if caps.salt.accepted else None

    def complete(prompt: str, chat: bool, label: str) -> Answer | None:
        answer = client.try_complete(prompt, cfg.max_tokens, chat, salt(label))
        tick()
        return answer

    refs: dict[str, list[Answer]] = {}
    labelled: list[tuple[str, Answer]] = []
    for g in groups:
        answers = [complete(p, g.chat, f"{g.name}-{i}") for i, p in enumerate(g.prompts)]
        kept = [a for a in answers if a is not None]
        labelled += [(g.name, a) for a in kept]
        if len(kept) == len(answers):
            refs[g.name] = kept
    for k, prompt in enumerate(calibration_prompts(nonce, cfg.calibration_prompts)):
        if (answer := complete(prompt, False, f"cal-{k}")) is not None:
            labelled.append((f"calibration-{k}", answer))
    return refs, calibrate(labelled, caps.unit)


def _fill_blocks(groups: list[Group], nonce: str, gran: Granularity) -> list[Group]:
    """The burst groups, each with the preamble ``gran`` gives it after the nonce tag (where its prompts share
    less than one of the server's blocks); recorded in ``gran.filled``."""
    out = []
    for g in groups:
        pad = gran.preamble(g.prompts, f"fill-{nonce}-{g.name}")
        if pad:
            gran.filled[g.name] = len(pad)
            g = dataclasses.replace(g, prompts=tuple(p[:TAG_CHARS] + pad + p[TAG_CHARS:] for p in g.prompts))
        out.append(g)
    return out


def _salts(client: ProbeClient, caps: Capabilities, nonce: str, gran: Granularity | None = None) -> SaltFinding:
    """The salt check, its prompt sized from ``gran`` (not run where the granularity search saw no hit in
    cached_tokens: no prompt could show what a salt does)."""
    if caps.salt.unknown:
        return SaltFinding("undetermined", "", f"the acceptance check {caps.salt.message}; carried on without salts")
    if not caps.salt.accepted:
        return rejected(caps.salt)
    if not caps.cached_tokens:
        return SaltFinding("undetermined", detail="accepted; cached_tokens is not reported (the timing can tell)")
    if gran is not None and gran.channel != "cached_tokens":
        return not_measured(f"cached_tokens shows no hit, TTFT does ({gran.summary()}): the timing tells")
    if gran is not None and not gran.found:
        return not_measured(gran.summary())
    chars = SALT_PROMPT_CHARS if gran is None else gran.prompt_chars(SALT_PROMPT_CHARS)
    found = client.tolerate(check_with_cached_tokens, client, nonce, chars)
    if found is None:
        return SaltFinding("undetermined", "", "dropped")
    if gran is not None:
        found.detail += f" ({gran.sizing('the prompt', chars)}; the cache: {gran.summary()})"
    return found


def _not_salted_because(caps: Capabilities) -> str:
    if caps.salt.accepted:
        return ""
    return "the cache_salt check gave up after its retries" if caps.salt.unknown else "the server rejects cache_salt"


def _timing(
    client: ProbeClient,
    caps: Capabilities,
    nonce: str,
    cfg: ProbeConfig,
    tick: Tick = no_tick,
    gran: Granularity | None = None,
    victim: ProbeClient | None = None,
    budget: Budget | None = None,
) -> TimingReport:
    """The timing runs, their prefixes sized from ``gran`` (None: the search was dropped, so a non-detection
    proves nothing), the victim on ``victim`` where given, cut to the timing's share of ``budget``."""
    chars = cfg.timing_prefix_chars if gran is None else gran.prompt_chars(cfg.timing_prefix_chars)
    blind = "not measured: the cache granularity search was dropped" if gran is None else gran.blind
    described = "" if gran is None else f"{gran.summary()}; {gran.sizing('prefixes', chars)}"
    return run_timing(
        client,
        nonce=nonce,
        trials=cfg.timing_trials,
        prefix_chars=chars,
        seed=cfg.seed,
        salts=caps.salt.accepted,  # a server that refuses salts can only be measured without them
        not_salted_because=_not_salted_because(caps),
        alpha=cfg.alpha,
        shapes=cfg.timing_shapes,
        on_trial=tick,
        victim=victim,
        cached_tokens=caps.cached_tokens,
        blind=blind,
        granularity=described,
        prefix_tokens=round(chars / gran.chars_per_token) if gran is not None and gran.tokens_counted else None,
        allowance=None if budget is None else budget.allowance("timing"),
    )


def _run(
    client: ProbeClient,
    pset: PassphraseSet,
    reuse_groups: list[ReuseGroup],
    cfg: ProbeConfig,
    keys: tuple[str | None, str | None] = (None, None),
    phases: Phases | None = None,
    victim: ProbeClient | None = None,
) -> ProbeReport:
    """The probe's steps (see the module docstring); ``keys``: the metrics API key and the probe's own;
    ``phases``: where each phase is reported as it runs; ``victim``: the timing victim's client (its own key)."""
    t0 = time.perf_counter()
    budget = Budget(cfg.max_seconds)
    ph = phases or Phases()
    nonce, rng = new_nonce(), random.Random(cfg.seed)
    groups = [Group(g.name, tuple(tag(nonce, p) for p in g.prompts), g.chat_template) for g in pset.groups]
    with ph.phase("capabilities"):
        caps = detect_capabilities(client, tag(nonce, "Say hello."), any(g.chat for g in groups))
    for phase, planned in (("reuse", bool(reuse_groups)), ("timing", cfg.timing)):
        if not planned:
            budget.skip(phase)
    gran: Granularity | None = None
    if not (caps.cached_tokens or cfg.timing):
        budget.skip("granularity")
    else:  # TTFT alone is only worth its requests when the timing runs
        with ph.phase("granularity") as tick:
            gran = client.tolerate(
                measure_granularity,
                client,
                nonce,
                cached_tokens=caps.cached_tokens,
                ttft=cfg.timing,
                on_step=tick,
                search_tokens=cfg.search_tokens,
                allowance=budget.allowance("granularity"),
            )
    if gran is not None and gran.bound_by == "time":
        budget.cut("granularity", f"no length past {gran.bound} tokens: {gran.time_bound}")
    if gran is not None:
        groups = _fill_blocks(groups, nonce, gran)
    with ph.phase("salts"):
        salts = _salts(client, caps, nonce, gran)
    with ph.phase("references", sum(len(g.prompts) for g in groups) + cfg.calibration_prompts) as tick:
        refs, criterion = _references(client, groups, nonce, caps, cfg, tick)
    # A group that lost a reference is measured nowhere: the contamination finding says so (report).
    unreferenced = [g.name for g in groups if g.name not in refs]
    groups = [g for g in groups if g.name in refs]
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
            allowance=budget.allowance("determinism"),
            **burst_kw,
        )
    if det.left_out:
        budget.cut("determinism", f"{det.prompts} of {len(items)} prompts measured")
    with ph.phase("bursts", cfg.rounds * len(groups)) as tick:
        bursts = run_bursts(
            client,
            groups,
            refs,
            criterion,
            concurrency=cfg.concurrency,
            rounds=cfg.rounds,
            on_burst=tick,
            allowance=budget.allowance("bursts"),
            **burst_kw,
        )
    if bursts.rounds < cfg.rounds:
        budget.cut("bursts", f"{bursts.rounds} of {cfg.rounds} rounds")
    bursts.unreferenced_groups = unreferenced
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
                allowance=budget.allowance("reuse"),
                **burst_kw,
            )
        if reuse.trials_run < cfg.reuse_trials or reuse.determinism.left_out:
            det_of = reuse.determinism.prompts + reuse.determinism.left_out
            budget.cut(
                "reuse",
                f"{reuse.trials_run} of {cfg.reuse_trials} trials per group; the twins' determinism on "
                f"{reuse.determinism.prompts} of {det_of}",
            )
    timing = None
    if cfg.timing:
        runs, trials = timing_plan(
            cfg.timing_trials, cfg.alpha, len(cfg.timing_shapes), caps.salt.accepted, caps.cached_tokens
        )
        with ph.phase("timing", runs * trials) as tick:
            timing = client.tolerate(_timing, client, caps, nonce, cfg, tick, gran, victim, budget)
        if timing is not None and timing.cut:
            budget.cut("timing", timing.cut)
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
        rounds=bursts.rounds,
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
        granularity=gran,
        alpha=cfg.alpha,
        requests=client.stats,
        max_seconds=cfg.max_seconds,
        cuts=dict(budget.cuts),
    )
    report.conclude()
    report.seconds, report.phase_seconds = time.perf_counter() - t0, dict(ph.seconds)
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
    "plan_requests",
    "render",
    "run_probe",
]
