"""The probe's findings, each with a verdict and the evidence behind it, and the exit code they add up to.

Verdicts, most severe first: ``leak`` (another request's state reached an answer, or a cache hit is visible
across distinct salts), ``exposure`` (a cache hit is visible to clients that share a namespace: no salts),
``inconclusive`` (something changed, but the server is not deterministic on its own and the changes are
not significantly more frequent than in bursts of copies: the measured variance is given), ``clean``.
``info`` and ``not measured`` say what the probe found out or could not look at.
Exit code: 1 on a leak, 3 on exposure (and no leak), 0 otherwise; 2 is kept for a probe that failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvlab.probe.bursts import BurstResult, Observation
from kvlab.probe.client import Capabilities
from kvlab.probe.compare import Criterion, fisher_greater
from kvlab.probe.determinism import Determinism
from kvlab.probe.metrics import MetricsCheck
from kvlab.probe.reuse import CACHED_SLACK, ReuseResult
from kvlab.probe.salts import SaltFinding
from kvlab.probe.timing import TimingReport

SEVERITY = ("leak", "exposure", "inconclusive", "clean")
# Answers changed under cross-traffic at a rate above the server's own variance with this one-sided p: a leak.
RATE_ALPHA = 0.01
EXIT_CODES = {"leak": 1, "exposure": 3}
IDS_SOURCES = {
    "response": "token ids from the response (choices[].token_ids)",
    "return_token_ids": "token ids on request (return_token_ids)",
    "native": "token ids from the native /completion endpoint (return_tokens; chat answers via /tokenize)",
    "tokenize": "answers re-tokenized by the server's /tokenize",
    "text": "text, character by character (the server offers no token ids)",
}


@dataclass
class Finding:
    name: str
    verdict: str  # one of SEVERITY, or info | not measured
    reason: str


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
    side_channels: dict[str, str] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    verdict: str = "clean"
    seconds: float = 0.0
    alpha: float = 0.01  # significance of the reuse test (ProbeConfig.alpha)

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
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.verdict, 0)

    def conclude(self) -> None:
        self.findings = [
            contamination_finding(self.bursts, self.determinism, self.criterion),
            reuse_finding(self.reuse, self.alpha),
            Finding("salts", self.salts.verdict, f"{self.salts.handling}: {self.salts.detail}"),
            timing_finding(self.timing),
        ]
        self.side_channels = side_channels(self)
        decisive = [f.verdict for f in self.findings if f.verdict in SEVERITY]
        self.verdict = min(decisive, key=SEVERITY.index) if decisive else "clean"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["counts"] = self.counts  # kept at the top, where scripts read it
        data["criterion"]["statement"] = self.criterion.statement()
        data["determinism"]["variance"] = self.determinism.variance()
        data["exit_code"] = self.exit_code
        return data


def contamination_finding(b: BurstResult, det: Determinism, crit: Criterion) -> Finding:
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
    if r is None:
        return Finding("non-prefix reuse", "not measured", "skipped (--no-reuse)")
    if not r.groups:
        why = "; ".join(f"{g}: {msg}" for g, msg in r.skipped.items())
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


def timing_finding(t: TimingReport | None) -> Finding:
    if t is None:
        return Finding("timing", "not measured", "run with --timing to measure TTFT hits and misses")
    return Finding("timing", t.verdict, t.reason)


def side_channels(r: ProbeReport) -> dict[str, str]:
    """Which channels this run measured, and why the others were not."""
    caps = r.capabilities
    out = {"answers": f"measured: contamination and non-prefix reuse, compared by {IDS_SOURCES[caps.ids_mode]}"}
    out["cached_tokens"] = (
        "reported by the server: used for the salt check" + (" and in timing" if r.timing else "")
        if caps.cached_tokens
        else "not measurable: the server does not report cached tokens"
    )
    if r.timing is None:
        out["TTFT without salts"] = out["TTFT across distinct salts"] = "not measured (run with --timing)"
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
    lines = [
        f"probe of {r.base_url} ({r.model}), run {r.nonce}: {r.rounds} rounds x {r.concurrency} concurrent "
        f"requests per group, {r.seconds:.1f}s",
        f"  server: answers compared by {IDS_SOURCES[caps.ids_mode]}; cached_tokens "
        f"{'reported' if caps.cached_tokens else 'not reported'}; cache_salt {salt}",
        f"  criterion: {r.criterion.statement()}",
        f"  determinism: {det.variance()}",
        f"  bursts: same {c.get('same', 0)}   diverged {c.get('diverged', 0)}   "
        f"contaminated {c.get('contaminated', 0)}",
    ]
    for o in [o for o in r.observations if o.outcome != "same"][:5]:
        lines.append(
            f"    {o.outcome}: group {o.group} prompt {o.prompt_index} (round {o.round}): own reference for "
            f"{o.own_prefix} {r.criterion.unit}, prompt {o.closest_other}'s for {o.other_prefix} "
            f"({o.excess} past their parting); answer {o.answer!r:.60}"
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
    return "\n".join(lines)
