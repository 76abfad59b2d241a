"""The probe's findings, each with a verdict and the evidence behind it, and the exit code they add up to.

Verdicts, most severe first: ``leak`` (another request's state reached an answer, or a cache hit is visible
across distinct salts), ``exposure`` (a cache hit is visible to clients that share a namespace: no salts),
``inconclusive`` (something changed, but the server is not deterministic on its own and the changes are
not significantly more frequent than in bursts of copies: the measured variance is given), ``clean``.
``info`` and ``not measured`` say what the probe found out or could not look at.
Exit code: 1 on a leak, 3 on exposure (and no leak), 0 otherwise; 2 is kept for a probe that failed, and
for a run that measured nothing at all: requests gave up and every finding is inconclusive or not measured,
with nothing counted (``ProbeReport.measured_nothing``; the report's last line says so).

Each finding also carries the one count its verdict rests on (``observed`` of ``measured`` in its ``unit``).
A request that gave up after its retries is dropped from its phase (``client.GaveUp``); the finding is then
drawn from what was measured and says how much was lost, and a phase that kept less than ``MIN_MEASURED`` of
its measurements cannot be called clean: inconclusive. A reference that gave up leaves its group unmeasured:
the contamination finding is then never clean, and says how many references gave up and why (its count stays
the answers measured under cross-traffic; the give-ups are in the requests per phase). The JSON document is
``kvlab.probe.schema``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from kvlab.probe.bursts import BurstResult, Observation
from kvlab.probe.client import Capabilities, PhaseRequests, RequestStats
from kvlab.probe.compare import Criterion, fisher_greater
from kvlab.probe.determinism import Determinism
from kvlab.probe.granularity import Granularity
from kvlab.probe.metrics import MetricsCheck
from kvlab.probe.reuse import CACHED_SLACK, ReuseResult
from kvlab.probe.salts import SaltFinding
from kvlab.probe.timing import TimingReport

SEVERITY = ("leak", "exposure", "inconclusive", "clean")
# Answers changed under cross-traffic at a rate above the server's own variance with this one-sided p: a leak.
RATE_ALPHA = 0.01
EXIT_CODES = {"leak": 1, "exposure": 3}
EXIT_NOTHING_MEASURED = 2  # as for a probe that could not run
# A phase that lost more of its measurements than this fraction to requests that gave up is not called clean.
MIN_MEASURED = 0.5
IDS_SOURCES = {
    "response": "token ids from the response (choices[].token_ids)",
    "return_token_ids": "token ids on request (return_token_ids)",
    "native": "token ids from the native /completion endpoint (return_tokens; chat answers via /tokenize)",
    "tokenize": "answers re-tokenized by the server's /tokenize",
    "text": "text, character by character (the server offers no token ids)",
}


def utc_now() -> str:
    """Now, in UTC, as ISO 8601 (``2025-01-31T12:00:00Z``)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Finding:
    name: str
    verdict: str  # one of SEVERITY, or info | not measured
    reason: str
    # The count the verdict rests on: ``observed`` of ``measured`` (in ``unit``) showed ``showing`` (answers
    # that follow another's reference, trials, runs that revealed a hit). None: nothing was counted.
    observed: int | None = None
    measured: int | None = None
    unit: str = ""
    showing: str = ""


@dataclass
class ProbeReport:
    base_url: str
    model: str
    nonce: str
    seed: int
    rounds: int
    concurrency: int
    max_tokens: int
    capabilities: Capabilities
    criterion: Criterion
    salts: SaltFinding
    determinism: Determinism
    bursts: BurstResult
    reuse: ReuseResult | None = None
    timing: TimingReport | None = None
    metrics: MetricsCheck | None = None  # what /metrics showed the probe; None: not checked
    granularity: Granularity | None = None  # the cache granularity search; None: not run (or dropped)
    side_channels: dict[str, str] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    verdict: str = "clean"
    seconds: float = 0.0
    alpha: float = 0.01  # significance of the reuse test (ProbeConfig.alpha)
    requests: RequestStats | None = None  # what the client sent, retried and dropped; None: not recorded
    finished_at: str = ""  # UTC, ISO 8601: when the findings were drawn (``conclude``)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # how long each phase took
    max_seconds: float | None = None  # the time budget (``budget``); None: no bound
    cuts: dict[str, str] = field(default_factory=dict)  # phase -> what the time budget left out of it

    # The burst probe's numbers under their old names (the command's first lines, and older callers).
    @property
    def counts(self) -> dict[str, int]:
        return self.bursts.counts

    @property
    def contaminated(self) -> int:
        return self.bursts.contaminated

    @property
    def observations(self) -> list[Observation]:
        return self.bursts.observations

    @property
    def uninformative_groups(self) -> list[str]:
        return self.bursts.uninformative_groups

    def finding(self, name: str) -> Finding:
        return next(f for f in self.findings if f.name == name)

    @property
    def measured_nothing(self) -> bool:
        """Requests gave up and no finding rests on anything measured (each inconclusive or not measured, with
        nothing counted): the run could not measure the server (exit status 2)."""
        if self.requests is None or not self.requests.gave_up or not self.findings:
            return False
        return all(f.verdict in ("inconclusive", "not measured") and not f.measured for f in self.findings)

    @property
    def exit_code(self) -> int:
        return EXIT_NOTHING_MEASURED if self.measured_nothing else EXIT_CODES.get(self.verdict, 0)

    def phase_requests(self, phase: str) -> PhaseRequests:
        return self.requests.phase(phase) if self.requests is not None else PhaseRequests()

    def gave_up_why(self, phase: str) -> str:
        """Why the first listed request of ``phase`` that gave up did ("": none listed)."""
        drops = [d for d in self.requests.dropped if d.phase == phase] if self.requests is not None else []
        if not drops:
            return ""
        return str(drops[0])

    def conclude(self) -> None:
        refs = self.phase_requests("references")
        self.findings = [
            contamination_finding(self.bursts, self.determinism, self.criterion, refs, self.gave_up_why("references")),
            reuse_finding(self.reuse, self.alpha),
            salts_finding(self),
            cached_tokens_finding(self.granularity, self.capabilities, self.phase_requests("granularity")),
            timing_finding(self.timing, self.phase_requests("timing"), self.capabilities.lost),
        ]
        self.side_channels = side_channels(self)
        decisive = [f.verdict for f in self.findings if f.verdict in SEVERITY]
        self.verdict = min(decisive, key=SEVERITY.index) if decisive else "clean"
        self.finished_at = utc_now()


def lost(f: Finding, measured: int, dropped: int, what: str) -> Finding:
    """``f`` drawn from ``measured`` of ``measured + dropped`` planned measurements: a note of the loss, and a
    "clean" from too little (less than ``MIN_MEASURED``) becomes "inconclusive"."""
    if not dropped:
        return f
    note = f" ({dropped} of {measured + dropped} {what} dropped: a request gave up after its retries)"
    if f.verdict == "clean" and measured < MIN_MEASURED * (measured + dropped):
        return replace(f, verdict="inconclusive", reason=f"too little was measured to call it clean: {f.reason}{note}")
    return replace(f, reason=f.reason + note)


def contamination_finding(
    b: BurstResult, det: Determinism, crit: Criterion, references: PhaseRequests | None = None, why: str = ""
) -> Finding:
    """The verdict on the bursts (the rules below), with the count its reason gives: the answers that follow
    another prompt's reference beyond chance where there are any, else those that changed under cross-traffic,
    of all answers measured there. ``references``: the reference phase's requests; where some gave up (``why``:
    the first one's error), the finding is never clean (``lost_references``)."""
    total = sum(b.counts.values())
    f = _contamination(b, det, crit)
    f.observed, f.measured, f.unit = (b.contaminated or b.diverged), total, "answers"
    f.showing = "another prompt's reference, beyond chance" if b.contaminated else "a change under cross-traffic"
    if det.dropped:
        kept = det.alone + det.burst + det.salted
        f.reason += f" (the determinism controls lost {det.dropped} of {kept + det.dropped} requests: they gave up)"
        if f.verdict == "leak" and not b.contaminated and kept < MIN_MEASURED * (kept + det.dropped):
            # A leak by a change of answers rests on the controls: too few of them cannot show it.
            f.verdict, f.reason = "inconclusive", "too little of the determinism controls was measured: " + f.reason
    f = lost(f, total, b.dropped, "answers under cross-traffic")
    return lost_references(f, b, references or PhaseRequests(), why)


def lost_references(f: Finding, b: BurstResult, refs: PhaseRequests, why: str = "") -> Finding:
    """``f`` after ``refs.gave_up`` reference requests gave up: their groups (``b.unreferenced_groups``) were
    measured nowhere, and the calibration lost pairs, so a "clean" becomes "inconclusive" (a group left out
    may be the one that leaks); a leak shown by the groups measured stands. The reason says how many and why."""
    if not refs.gave_up:
        return f
    what = f"{refs.gave_up} of {refs.sent} reference requests gave up after their retries" + (
        f" ({why})" if why else ""
    )
    groups = b.unreferenced_groups
    left = f"group(s) {', '.join(groups)} not measured" if groups else "calibration prompts only: fewer chance pairs"
    if f.verdict != "clean":
        return replace(f, reason=f"{f.reason} ({what}; {left})")
    if not f.measured:  # contamination_finding's count: every answer measured under cross-traffic
        return replace(f, verdict="inconclusive", reason=f"nothing could be measured: {what}; {left}")
    reason = f"a reference was lost, so it cannot be called clean: {what}; {left}; measured: {f.reason}"
    return replace(f, verdict="inconclusive", reason=reason)


def _contamination(b: BurstResult, det: Determinism, crit: Criterion) -> Finding:
    total = sum(b.counts.values())
    if b.contaminated:
        o = next(o for o in b.observations if o.outcome == "contaminated")
        return Finding(
            "contamination",
            "leak",
            f"{b.contaminated} of {total} answers follow another prompt's reference beyond chance (e.g. group "
            f"{o.group} prompt {o.prompt_index} follows prompt {o.closest_other}'s for {o.excess} {crit.unit} past "
            f"where their references part; needed {crit.min_match})",
        )
    if b.diverged and det.deterministic:
        return Finding(
            "contamination",
            "leak",
            f"{b.diverged} of {total} answers changed under cross-traffic, though the server gave every prompt "
            f"the same answer alone and in bursts of copies ({det.variance()}): evidence of shared state",
        )
    if b.diverged and det.batch_deterministic:
        # Copies sharing the cache varied, copies batched under salts of their own did not: what changes the
        # answers is the shared cache, between copies of one prompt as between different prompts.
        return Finding(
            "contamination",
            "leak",
            f"{b.diverged} of {total} answers changed under cross-traffic, though the server gave every prompt "
            f"the same answer alone and batched with copies under salts of their own ({det.variance()}): "
            "evidence of shared state",
        )
    # A server that varies on its own still shows shared state when answers change under cross-traffic far
    # more often than in bursts of copies of themselves, the control with the same concurrency and no foreign
    # text (a leak between copies of one prompt, as a cache without copy-on-write has, makes copies vary too).
    p = fisher_greater(b.diverged, total, det.burst_differ, det.burst)  # 1.0 with no change or no copies
    if p <= RATE_ALPHA:
        return Finding(
            "contamination",
            "leak",
            f"{b.diverged} of {total} answers changed under cross-traffic, far more often than copies of the same "
            f"prompts did in bursts of themselves ({det.variance()}; Fisher p = {p:.2g}): evidence of shared state",
        )
    if b.diverged:
        return Finding(
            "contamination",
            "inconclusive",
            f"{b.diverged} of {total} answers changed under cross-traffic, but none beyond chance and the server "
            f"is not deterministic on its own: {det.variance()}",
        )
    blind = set(b.uninformative_groups) | set(b.unreachable_groups)
    if total and len(blind) == len({o.group for o in b.observations}):
        return Finding("contamination", "inconclusive", "no group could show contamination: " + _blind(b, crit))
    note = "" if det.deterministic else f" (the server itself varies: {det.variance()})"
    return Finding("contamination", "clean", f"all {total} answers under cross-traffic equal their references{note}")


def _blind(b: BurstResult, crit: Criterion) -> str:
    parts = []
    if b.uninformative_groups:
        parts.append(f"every reference equal in {', '.join(b.uninformative_groups)}")
    if b.unreachable_groups:
        parts.append(
            f"answers too short to follow another's reference for {crit.min_match} {crit.unit} in "
            f"{', '.join(b.unreachable_groups)} (raise --max-tokens)"
        )
    return "; ".join(parts)


def reuse_finding(r: ReuseResult | None, alpha: float = 0.01) -> Finding:
    """The verdict on the reuse trials, with its count: the trials in which the victim's prompt changed the
    attacker's answer or its cached-token count (beyond ``CACHED_SLACK``), of the trials measured."""
    if r is None:
        return Finding("non-prefix reuse", "not measured", "skipped (--no-reuse)")
    shown = sum(
        t.after_victim == "diverged"
        or (
            t.cached_after_victim is not None
            and t.cached_after_control is not None
            and t.cached_after_victim - t.cached_after_control > CACHED_SLACK
        )
        for t in r.trials
    )
    f = replace(_reuse(r, alpha), observed=shown, measured=len(r.trials), unit="trials")
    f.showing = "the victim's prompt changing the attacker's answer or its cached tokens"
    if r.dropped:
        f = lost(f, len(r.trials), r.dropped_trials, "reuse trials")
        f.reason += f"; dropped: {'; '.join(r.dropped[:3])}" + ("; ..." if len(r.dropped) > 3 else "")
    return f


def _reuse(r: ReuseResult, alpha: float) -> Finding:
    if not r.groups:
        why = "; ".join([f"{g}: {msg}" for g, msg in r.skipped.items()] + r.dropped)
        if r.dropped:
            return Finding("non-prefix reuse", "inconclusive", f"no group could be measured ({why})")
        return Finding("non-prefix reuse", "not measured", f"every group was refused ({why})")
    n, p = len(r.trials), r.p_value()
    fresh = sum(t.fresh_vs_cached == "diverged" for t in r.trials)
    counts = (
        f"the attacker's answer changed after the victim's prompt in {r.diverged} of {n} trials, and between two "
        f"identical control rounds in {r.control_diverged} of {n} (Fisher p = {p:.2g}; a cached prefix alone "
        f"changed the fresh answer in {fresh} of {n})"
    )
    if differences := r.cached_differences():
        counts += (
            f"; a first-time attacker prompt found more than {CACHED_SLACK} more cached tokens after the victim than "
            f"after a control in {r.cached_excess} of {len(differences)} trials, that many fewer in "
            f"{r.cached_deficit} (differences {min(differences)} to {max(differences)}; sign test p = "
            f"{r.cached_p_value():.2g})"
        )
    skipped = f"; skipped {', '.join(r.skipped)} (refused)" if r.skipped else ""
    by_answers = r.diverged > 0 and p <= alpha
    by_cache = r.cached_excess > 0 and r.cached_p_value() <= alpha
    if by_answers or by_cache:
        how = " and ".join(w for w, hit in (("its answers", by_answers), ("the cached-token counts", by_cache)) if hit)
        return Finding(
            "non-prefix reuse",
            "leak",
            f"{counts}: the attacker gets K/V computed after text the victim sent before the shared chunk "
            f"(shown by {how}){skipped}",
        )
    if r.diverged or r.cached_excess:
        return Finding(
            "non-prefix reuse",
            "inconclusive",
            f"{counts}: not beyond what the server's own variation explains (needs p <= {alpha}){skipped}",
        )
    return Finding("non-prefix reuse", "clean", f"{counts}; groups {', '.join(r.groups)}{skipped}")


def salts_finding(r: ProbeReport) -> Finding:
    """What the salt check (or the timing, where it told) found, with its count: 1 of 1 checks when a salt
    was ignored, 0 of 1 when honoured, none when undetermined or rejected."""
    s, phase = r.salts, r.phase_requests("salts")
    decided = s.handling in ("honoured", "ignored")
    f = Finding("salts", s.verdict, f"{s.handling}: {s.detail}", int(s.handling == "ignored"), int(decided), "checks")
    f.showing = "a cache hit across distinct salts"
    if not decided:
        f.observed = f.measured = None
    gave_up = phase.gave_up + int(r.capabilities.salt.unknown)  # the acceptance check itself, where it was lost
    if gave_up and s.handling == "undetermined":
        f.verdict = "inconclusive"
        f.reason += f" ({gave_up} of its requests gave up after their retries)"
    elif phase.timed_out and s.handling == "ignored" and s.channel == "cached_tokens":
        # The check's second salt may have hit its own first attempt, computed after the client gave up on it.
        f.verdict = "inconclusive"
        f.reason += (
            f" (but {phase.timed_out} of the check's requests were retried after a timeout: the server may have "
            "cached an attempt the probe gave up on, and a retry under the other salt then finds it)"
        )
    return f


def cached_tokens_finding(g: Granularity | None, caps: Capabilities, phase: PhaseRequests | None = None) -> Finding:
    """Does ``cached_tokens`` show a client without a salt what was cached before? Read off the granularity
    search, whose prompts carry no salt: exposure when one of its lengths hit, with the count of lengths that
    did; clean when none did up to the model's whole context (or only TTFT showed the hit: this channel hides
    it); inconclusive when the search stopped short of the context or was dropped."""
    name, unit, showing = "cached tokens", "prompt lengths", "a cache hit without salts, in cached_tokens"
    if not caps.cached_tokens:
        why = f"not measured: {caps.lost}" if caps.lost else "the server does not report cached tokens"
        return Finding(name, "not measured", f"{why} (the timing reads TTFT)")
    if g is None:
        gave_up = (phase or PhaseRequests()).gave_up
        return Finding(name, "inconclusive", f"the granularity search was dropped ({gave_up} request(s) gave up)")
    samples = [s for s in g.samples if s.cached is not None]
    hits = [s for s in samples if s.cached]
    if g.channel == "cached_tokens" and hits:
        first = min(hits, key=lambda s: s.tokens)
        return Finding(
            name,
            "exposure",
            f"a {first.tokens}-token prompt sent without a salt, then again with another ending, reported "
            f"{first.cached} cached tokens: every client that shares the cache namespace (no salt, the same tenant) "
            f"sees what the others' prompts cached ({g.summary()})",
            len(hits),
            len(samples),
            unit,
            showing,
        )
    if g.channel == "TTFT" or g.no_cache:
        why = g.notes[0] if g.channel == "TTFT" and g.notes else g.summary()
        return Finding(name, "clean", f"cached_tokens shows no hit: {why}", 0, len(samples), unit, showing)
    return Finding(name, "inconclusive", g.summary(), 0, len(samples), unit, showing)


def timing_finding(t: TimingReport | None, phase: PhaseRequests | None = None, lost_channel: str = "") -> Finding:
    """The timing verdict, with its count: the runs (victim shape x salt condition) that revealed a hit.
    ``lost_channel``: why the capability check could not read cached_tokens (``Capabilities.lost``); a "clean"
    then becomes "inconclusive", since that channel of the timing went unread."""
    phase = phase or PhaseRequests()
    if t is None:
        if phase.gave_up:
            return Finding(
                "timing",
                "inconclusive",
                f"the timing phase was dropped: {phase.gave_up} request(s) gave up after their retries "
                "(raise --request-timeout or --retries)",
            )
        return Finding("timing", "not measured", "skipped (--no-timing): TTFT hits and misses not measured")
    f = Finding("timing", t.verdict, t.reason, sum(bool(r.revealed_by) for r in t.runs), len(t.runs), "timing runs")
    f.showing = "another client's cached prefix (in TTFT or cached_tokens)"
    if phase.timed_out:
        f.reason += (
            f" ({phase.timed_out} timing requests were retried after a timeout; a retried prompt can only look "
            "more cached than it was)"
        )
    if lost_channel and f.verdict == "clean":
        return replace(f, verdict="inconclusive", reason=f"{f.reason}; but {lost_channel}")
    return f


def side_channels(r: ProbeReport) -> dict[str, str]:
    """Which channels this run measured, and why the others were not."""
    caps = r.capabilities
    out = {"answers": f"measured: contamination and non-prefix reuse, compared by {IDS_SOURCES[caps.ids_mode]}"}
    out["cached_tokens"] = (
        "reported by the server: used for the salt check" + (" and in timing" if r.timing else "")
        if caps.cached_tokens
        else f"not measured: {caps.lost}"
        if caps.lost
        else "not measurable: the server does not report cached tokens"
    )
    if r.timing is None:
        out["TTFT without salts"] = out["TTFT across distinct salts"] = "not measured (--no-timing)"
    elif not r.timing.runs:
        out["TTFT without salts"] = out["TTFT across distinct salts"] = r.timing.reason
    else:
        for salted, name in ((False, "TTFT without salts"), (True, "TTFT across distinct salts")):
            shown = r.timing.revealing(salted)
            seen = f"hit visible ({'; '.join(x.shape for x in shown)})" if shown else "no hit visible, any victim shape"
            out[name] = "measured: " + seen
        if not r.timing.salted_measured:
            out["TTFT across distinct salts"] = f"not measurable: {r.timing.not_salted_because}"
    if r.reuse is not None and r.reuse.skipped:
        out["non-prefix reuse"] = f"groups refused by the server: {', '.join(r.reuse.skipped)}"
    out["/metrics"] = "not checked" if r.metrics is None else r.metrics.summary()
    out["prompt extraction"] = "not run here (kvlab probe --extract)"
    return out


def render(r: ProbeReport) -> str:
    """The report as the lines a terminal shows."""
    c, caps, det = r.counts, r.capabilities, r.determinism
    salt = "accepted" if caps.salt.accepted else f"rejected ({caps.salt.status})"
    salt = "unknown (its check gave up; not sent)" if caps.salt.unknown else salt
    cached = "reported" if caps.cached_tokens else "unknown" if caps.lost else "not reported"
    lines = [
        f"probe of {r.base_url} ({r.model}), run {r.nonce}: {r.rounds} rounds x {r.concurrency} concurrent "
        f"requests per group, {r.seconds:.1f}s",
        f"  server: answers compared by {IDS_SOURCES[caps.ids_mode]}; cached_tokens {cached}; cache_salt {salt}",
        f"  criterion: {r.criterion.statement()}",
        f"  determinism: {det.variance()}",
        f"  bursts: same {c.get('same', 0)}   diverged {c.get('diverged', 0)}   "
        f"contaminated {c.get('contaminated', 0)}" + (f"   dropped {r.bursts.dropped}" if r.bursts.dropped else ""),
    ]
    for o in [o for o in r.observations if o.outcome != "same"][:5]:
        lines.append(
            f"    {o.outcome}: group {o.group} prompt {o.prompt_index} (round {o.round}): own reference for "
            f"{o.own_prefix} {r.criterion.unit}, prompt {o.closest_other}'s for {o.other_prefix} "
            f"({o.excess} past their parting); answer {o.answer!r:.60}"
        )
    if r.requests is not None:
        lines.append(f"  requests: {r.requests.summary()}")
    if r.cuts:
        lines.append(
            f"  time budget (--max-seconds {r.max_seconds or 0:g}): cut "
            + "; ".join(f"{phase}: {what}" for phase, what in r.cuts.items())
        )
    if r.reuse is not None:
        lines.append(
            f"  non-prefix reuse: {len(r.reuse.trials)} trials over {', '.join(r.reuse.groups) or 'no group'}: "
            f"changed after the victim {r.reuse.diverged}, after the control {r.reuse.control_diverged}"
        )
    if r.timing is not None:
        lines.append(r.timing.render())
    lines.append("  side channels:")
    lines += [f"    {name}: {what}" for name, what in r.side_channels.items()]
    lines += [f"  {f.name}: {f.verdict.upper()}: {f.reason}" for f in r.findings]
    lines.append(f"  verdict: {r.verdict.upper()}")
    if r.measured_nothing:
        assert r.requests is not None  # measured_nothing says so
        lines[-1] += (
            f": nothing could be measured ({r.requests.gave_up} requests gave up after their retries; raise "
            f"--request-timeout or --retries), exit status {EXIT_NOTHING_MEASURED}"
        )
    return "\n".join(lines)
