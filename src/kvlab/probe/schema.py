"""The JSON document of ``kvlab probe --json`` (and of ``--extract``): a versioned schema, as pydantic models.

What an auditor and a CI job read, in one shape for both kinds of run:

- ``schema_version`` (``SCHEMA_VERSION``: a new major version breaks readers, a new minor one only adds
  fields or kinds; 1.1 added the ``error`` kind, the ``cached_tokens`` check and ``evidence.granularity``; 1.2
  ``run.max_seconds`` and ``run.cuts``, what the time budget left out),
  ``kind`` (``probe``, ``extract``, or ``error``: a run that could not finish, exit status 2, with the
  ``error`` that stopped it and no findings), the ``tool`` and its version, when the run started and
  finished (UTC, ISO 8601), the command line (``sys.argv`` as given, API keys and URL credentials redacted:
  ``redact_argv``), the ``target`` server, its ``capabilities``;
- the ``verdict`` and the ``exit_code`` it gives; one entry per check in ``findings``, each with its verdict,
  a ``severity`` (``SEVERITIES``), the one ``count`` that verdict rests on, the reason and a ``remediation``;
- ``requests``: how many were sent, retried and given up (dropped from their phase);
- ``evidence``: the measurements themselves (``report.ProbeReport``'s, or ``attacks.base.ExtractReport.to_json``).

Identifiers are snake case (``non_prefix_reuse``, ``ttft_across_salts``); the human names stay beside them.
``json_schema()`` is the JSON Schema of the three documents (``python -m kvlab.probe.schema`` prints it);
``kvlab.probe.sarif`` and ``kvlab.probe.junit`` are written from a document.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, Field, TypeAdapter

from kvlab.probe.attacks.base import ExtractReport
from kvlab.probe.bursts import Observation
from kvlab.probe.client import DroppedRequest, PhaseRequests, RequestStats, SaltAcceptance
from kvlab.probe.determinism import Difference
from kvlab.probe.granularity import Granularity
from kvlab.probe.metrics import MetricsCheck
from kvlab.probe.report import EXIT_NOTHING_MEASURED, IDS_SOURCES, Finding, ProbeReport, utc_now
from kvlab.probe.reuse import ReuseResult
from kvlab.probe.salts import SaltFinding
from kvlab.probe.timing import TimingReport

SCHEMA_VERSION: Literal["1.2"] = "1.2"
TOOL_NAME = "kvlab probe"
REDACTED = "***"

Verdict = Literal["leak", "exposure", "inconclusive", "clean", "info", "not_measured"]
RunVerdict = Literal["leak", "exposure", "inconclusive", "clean", "error"]
Severity = Literal["critical", "high", "medium", "low", "info"]
SEVERITIES: tuple[str, ...] = get_args(Severity)
Timestamp = Annotated[str, Field(pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", description="UTC, ISO 8601")]


@dataclass(frozen=True)
class Check:
    """One check of the probe: a SARIF rule, a JUnit test case, a finding in every report."""

    id: str
    name: str  # as the text report says it
    title: str
    description: str
    leak_severity: str  # the severity of its leak
    phases: tuple[str, ...] = ()  # the probe's phases that measure it (their time is its JUnit test case's)


CHECKS = {
    c.id: c
    for c in (
        Check(
            "contamination",
            "contamination",
            "Cross-request contamination",
            "Does one request's answer carry another request's state? Bursts of prefix-sharing prompts, each answer "
            "compared with its prompt's reference alone, against the server's own determinism.",
            "critical",
            ("references", "determinism", "bursts"),
        ),
        Check(
            "non_prefix_reuse",
            "non-prefix reuse",
            "Non-prefix KV reuse",
            "Does the attacker's answer, or the cached-token count of its prompt, depend on text the victim sent "
            "before a chunk they share (K/V computed after the victim's secret)?",
            "critical",
            ("reuse",),
        ),
        Check(
            "salts",
            "salts",
            "cache_salt isolation",
            "Does the server honour, ignore or reject a request's cache_salt?",
            "high",
            ("salts",),
        ),
        Check(
            "cached_tokens",
            "cached tokens",
            "Prefix-cache hits in cached_tokens without salts",
            "Does usage.prompt_tokens_details.cached_tokens show a client without a salt what earlier prompts "
            "cached (exposure: every client sharing the namespace sees the others' cached prefixes)?",
            "high",
            ("granularity",),
        ),
        Check(
            "timing",
            "timing",
            "Prefix-cache side channel in TTFT and cached_tokens",
            "Can a client tell from its own requests' TTFT or cached_tokens that another's prefix is cached, "
            "without salts (exposure) and across distinct salts (leak)?",
            "high",
            ("timing",),
        ),
        Check(
            "prompt_extraction",
            "prompt extraction",
            "Prompt extraction through the prefix cache",
            "Can an attacker who knows a victim's prompt prefix recover its secret continuation through the cache "
            "(cached_tokens, /metrics or TTFT)?",
            "critical",
        ),
    )
}
CHECK_IDS = {c.name: c.id for c in CHECKS.values()}
SIDE_CHANNEL_IDS = {
    "answers": "answers",
    "cached_tokens": "cached_tokens",
    "TTFT without salts": "ttft_without_salts",
    "TTFT across distinct salts": "ttft_across_salts",
    "non-prefix reuse": "non_prefix_reuse",
    "/metrics": "metrics",
    "prompt extraction": "prompt_extraction",
}
ONE_SERVER = "use one server per tenant"
NO_CACHE = "disable prefix caching (vLLM: --no-enable-prefix-caching)"
REMEDIATION: dict[tuple[str, str], str] = {
    ("contamination", "leak"): (
        "Another request's state reached an answer: do not let tenants share this server (its cache or batching "
        "is unsafe); report it to the server's maintainers with this report's evidence (evidence.bursts)."
    ),
    ("contamination", "inconclusive"): (
        "Re-run on an otherwise idle server with more --rounds; a server that varies on its own needs answers "
        "to change far more often under cross-traffic than in bursts of copies before the probe can tell."
    ),
    ("non_prefix_reuse", "leak"): (
        f"Disable non-prefix KV reuse (llama.cpp: run without --cache-reuse), or {ONE_SERVER}."
    ),
    ("non_prefix_reuse", "inconclusive"): "Re-run with more --reuse-trials on an otherwise idle server.",
    ("non_prefix_reuse", "not_measured"): "Run without --no-reuse, with reuse groups that fit the model's context.",
    ("salts", "leak"): (
        f"The server accepts cache_salt and ignores it (llama.cpp does): a salt isolates nobody here; {ONE_SERVER}, "
        f"or {NO_CACHE}."
    ),
    (
        "salts",
        "info",
    ): f"The server rejects cache_salt: tenants cannot be isolated by salt; {ONE_SERVER}, or {NO_CACHE}.",
    ("salts", "not_measured"): "Run without --no-timing: the server does not report cached_tokens, TTFT can tell.",
    ("salts", "inconclusive"): "Re-run the check (raise --request-timeout or --retries if requests gave up).",
    ("salts", "clean"): "Send a cache_salt per tenant with every request: this server honours it.",
    (
        "timing",
        "leak",
    ): f"A cache hit shows across distinct salts: the salt does not isolate; {ONE_SERVER}, or {NO_CACHE}.",
    ("timing", "exposure"): (
        f"Set cache_salt per tenant (vLLM and kvlab honour it; llama.cpp ignores it: {ONE_SERVER}), or {NO_CACHE}."
    ),
    ("timing", "inconclusive"): (
        "Re-run with more --timing-trials on an otherwise idle server (raise --request-timeout or --retries if "
        "requests gave up)."
    ),
    ("timing", "not_measured"): "Run without --no-timing.",
    ("cached_tokens", "exposure"): (
        "Set cache_salt per tenant (vLLM and kvlab honour it), give tenants their own API keys on a server that "
        f"isolates by key (kvlab), hide cached_tokens from clients (vLLM: no --enable-prompt-tokens-details), "
        f"or {NO_CACHE}."
    ),
    ("cached_tokens", "inconclusive"): "Re-run with a larger --search-tokens (up to the model's context).",
    ("timing", "clean"): "None needed; hits below this machine's timing noise remain possible (more --timing-trials).",
    ("prompt_extraction", "leak"): (
        "A client recovered another's prompt through the cache: set cache_salt per tenant, hide cached_tokens and "
        f"/metrics from clients, or {ONE_SERVER}."
    ),
    ("prompt_extraction", "inconclusive"): (
        "Not a proof of safety: re-run on an otherwise idle server (more --ttft-repeats for the TTFT channel)."
    ),
}


def severity(check: str, verdict: str) -> str:
    """A finding's severity: its check's own for a leak, ``medium`` for exposure, ``low`` for inconclusive,
    ``info`` otherwise."""
    if verdict == "leak":
        return CHECKS[check].leak_severity if check in CHECKS else "high"
    return {"exposure": "medium", "inconclusive": "low"}.get(verdict, "info")


def remediation(check: str, verdict: str) -> str:
    if (check, verdict) in REMEDIATION:
        return REMEDIATION[check, verdict]
    return "None needed." if verdict == "clean" else "None."


def ident(name: str) -> str:
    """The snake-case identifier of a check or side channel named ``name``."""
    known = CHECK_IDS.get(name) or SIDE_CHANNEL_IDS.get(name)
    return known or re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


# ------------------------------------------------------------------------------------------------- redaction
# Options whose value is a credential: --api-key, --victim-api-key, --metrics-api-key, and any --*-key,
# --*token, --*password or --*secret (--max-tokens is none of them).
SECRET_OPTION = re.compile(r"^--(?:[a-z0-9-]*-)?(?:key|api-key|token|password|secret)$")
_URL_USERINFO = re.compile(r"(?<=://)([^/@\s:]*):([^/@\s]+)@")
_URL_SECRET_QUERY = re.compile(r"([?&](?:api[_-]?key|key|token|access_token|password)=)[^&#\s]+", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with URL passwords (``user:PASSWORD@host``) and credential query parameters redacted."""
    return _URL_SECRET_QUERY.sub(rf"\g<1>{REDACTED}", _URL_USERINFO.sub(rf"\g<1>:{REDACTED}@", text))


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line as given, with every credential's value replaced by ``REDACTED`` (``--api-key K``,
    ``--api-key=K``) and URL credentials redacted."""
    out: list[str] = []
    hide = False
    for arg in argv:
        if hide:
            out.append(REDACTED)
            hide = False
            continue
        name, eq, _ = arg.partition("=")
        if SECRET_OPTION.match(name):
            out.append(f"{name}={REDACTED}" if eq else arg)
            hide = not eq
            continue
        out.append(redact_url(arg))
    return out


def kvlab_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvlab")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


# ------------------------------------------------------------------------------------------------- the models
class Tool(BaseModel):
    name: str = TOOL_NAME
    version: str


class Target(BaseModel):
    base_url: str = Field(description="the server's root URL, as probed (credentials redacted)")
    model: str


class Count(BaseModel):
    """The count a finding's verdict rests on: ``observed`` of ``measured`` (in ``unit``) showed ``showing``."""

    observed: int
    measured: int
    unit: str
    showing: str


class FindingDoc(BaseModel):
    id: str = Field(description="the check: one of CHECKS (contamination, non_prefix_reuse, salts, ...)")
    name: str
    verdict: Verdict
    severity: Severity
    count: Count | None
    reason: str
    remediation: str


class SideChannelDoc(BaseModel):
    id: str
    name: str
    status: str = Field(description="measured (and what it showed), not measured or not measurable, and why")


class RequestsDoc(BaseModel):
    """What it took to get the answers: a request is sent once and retried after a timeout, a connection
    error, a 429 or a 5xx; one that still failed gave up and was dropped from its phase."""

    timeout_seconds: float
    max_retries: int
    sent: int
    retried: int
    retries: int
    gave_up: int
    phases: dict[str, PhaseRequests]
    dropped: list[DroppedRequest]


class RunDoc(BaseModel):
    nonce: str
    seed: int
    rounds: int
    concurrency: int
    max_tokens: int
    alpha: float
    seconds: float
    phase_seconds: dict[str, float] = Field(default_factory=dict, description="each phase's time (schema 1.1)")
    max_seconds: float | None = Field(default=None, description="the time budget, --max-seconds (schema 1.2)")
    cuts: dict[str, str] = Field(
        default_factory=dict, description="phase -> what the time budget left out of it (schema 1.2)"
    )


class CapabilitiesDoc(BaseModel):
    ids_mode: Literal["response", "return_token_ids", "native", "tokenize", "text"]
    compared_by: str
    unit: Literal["tokens", "characters"]
    tokenize: str | None
    cached_tokens: bool = Field(description="does a response say how much of its prompt was cached?")
    cache_salt: SaltAcceptance


class CriterionDoc(BaseModel):
    unit: Literal["tokens", "characters"]
    min_match: int
    chance_max: int
    pairs: int
    floor: int
    statement: str


class DeterminismDoc(BaseModel):
    prompts: int
    alone: int
    alone_differ: int
    burst: int
    burst_differ: int
    salted: int
    salted_differ: int
    most_distinct: int
    examples: list[Difference]
    dropped: int
    deterministic: bool
    batch_deterministic: bool
    variance: str


class BurstsDoc(BaseModel):
    outcomes: dict[Literal["same", "diverged", "contaminated"], int] = Field(
        description="answers under cross-traffic by outcome (the contamination finding's count is the changed ones)"
    )
    dropped: int
    uninformative_groups: list[str]
    unreachable_groups: list[str]
    observations: list[Observation]


class ProbeEvidence(BaseModel):
    criterion: CriterionDoc
    salts: SaltFinding
    determinism: DeterminismDoc
    bursts: BurstsDoc
    reuse: ReuseResult | None
    timing: TimingReport | None
    metrics: MetricsCheck | None
    granularity: Granularity | None = Field(
        default=None, description="the cache granularity search (schema 1.1); None: not run or dropped"
    )


class ExtractCapabilities(BaseModel):
    channel: str = Field(description="cached_tokens | metrics | ttft: what the attack read")
    channel_label: str
    granularity: int | None
    metrics: str


class Document(BaseModel):
    schema_version: Literal["1.2"] = SCHEMA_VERSION
    kind: str
    tool: Tool
    started_at: Timestamp
    finished_at: Timestamp
    command_line: list[str] = Field(description="sys.argv as given, credentials redacted; empty: not recorded")
    target: Target
    verdict: RunVerdict
    exit_code: int
    findings: list[FindingDoc]
    requests: RequestsDoc | None = Field(description="None: not recorded (the extraction attack's own clients)")


class ProbeDocument(Document):
    kind: Literal["probe"] = "probe"
    run: RunDoc
    capabilities: CapabilitiesDoc
    side_channels: list[SideChannelDoc]
    evidence: ProbeEvidence


class ExtractDocument(Document):
    kind: Literal["extract"] = "extract"
    capabilities: ExtractCapabilities
    evidence: ExtractReport


class ErrorDocument(Document):
    """A run that could not finish (exit status 2): what stopped it, and no findings."""

    kind: Literal["error"] = "error"
    error: str = Field(description="what stopped the run, as the command printed it")


AnyDocument = Annotated[ProbeDocument | ExtractDocument | ErrorDocument, Field(discriminator="kind")]


def json_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of the documents ``kvlab probe --json`` writes, any kind."""
    schema = TypeAdapter(AnyDocument).json_schema()
    schema["title"] = f"kvlab probe report, schema version {SCHEMA_VERSION}"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# ------------------------------------------------------------------------------------------------- building
def finding_doc(f: Finding) -> FindingDoc:
    check = ident(f.name)
    verdict = f.verdict.replace(" ", "_")
    count = None
    if f.observed is not None and f.measured is not None:
        count = Count(observed=f.observed, measured=f.measured, unit=f.unit, showing=f.showing)
    return FindingDoc(
        id=check,
        name=f.name,
        verdict=verdict,  # type: ignore[arg-type]  # the report's verdicts, validated here
        severity=severity(check, verdict),  # type: ignore[arg-type]
        count=count,
        reason=f.reason,
        remediation=remediation(check, verdict),
    )


def requests_doc(stats: RequestStats | None) -> RequestsDoc | None:
    if stats is None:
        return None
    return RequestsDoc(
        timeout_seconds=stats.timeout,
        max_retries=stats.max_retries,
        sent=stats.sent,
        retried=stats.retried,
        retries=stats.retries,
        gave_up=stats.gave_up,
        phases=stats.phases,
        dropped=[DroppedRequest(d.phase, d.method, redact_url(d.url), d.attempts, d.reason) for d in stats.dropped],
    )


def _started(finished: str, seconds: float) -> str:
    end = datetime.strptime(finished, "%Y-%m-%dT%H:%M:%SZ")
    return (end - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def probe_document(r: ProbeReport, argv: Sequence[str] | None = None) -> ProbeDocument:
    """The document of a passphrase probe's report; ``argv``: its command line (redacted here)."""
    finished = r.finished_at or utc_now()
    caps, det, crit, b = r.capabilities, r.determinism, r.criterion, r.bursts
    return ProbeDocument(
        tool=Tool(version=kvlab_version()),
        started_at=_started(finished, r.seconds),
        finished_at=finished,
        command_line=redact_argv(argv or []),
        target=Target(base_url=redact_url(r.base_url), model=r.model),
        verdict=r.verdict,  # type: ignore[arg-type]
        exit_code=r.exit_code,
        findings=[finding_doc(f) for f in r.findings],
        requests=requests_doc(r.requests),
        run=RunDoc(
            nonce=r.nonce,
            seed=r.seed,
            rounds=r.rounds,
            concurrency=r.concurrency,
            max_tokens=r.max_tokens,
            alpha=r.alpha,
            seconds=r.seconds,
            phase_seconds=r.phase_seconds,
            max_seconds=r.max_seconds,
            cuts=r.cuts,
        ),
        capabilities=CapabilitiesDoc(
            ids_mode=caps.ids_mode,  # type: ignore[arg-type]
            compared_by=IDS_SOURCES[caps.ids_mode],
            unit=caps.unit,  # type: ignore[arg-type]
            tokenize=caps.tokenize,
            cached_tokens=caps.cached_tokens,
            cache_salt=caps.salt,
        ),
        side_channels=[
            SideChannelDoc(id=ident(name), name=name, status=what) for name, what in r.side_channels.items()
        ],
        evidence=ProbeEvidence(
            criterion=CriterionDoc(**asdict(crit), statement=crit.statement()),
            salts=r.salts,
            determinism=DeterminismDoc(
                **asdict(det),
                deterministic=det.deterministic,
                batch_deterministic=det.batch_deterministic,
                variance=det.variance(),
            ),
            bursts=BurstsDoc(
                outcomes=b.counts,  # type: ignore[arg-type]
                dropped=b.dropped,
                uninformative_groups=b.uninformative_groups,
                unreachable_groups=b.unreachable_groups,
                observations=b.observations,
            ),
            reuse=r.reuse,
            timing=r.timing,
            metrics=r.metrics,
            granularity=r.granularity,
        ),
    )


EXTRACT_VERDICTS = {"leak": "leak", "no leak": "clean", "inconclusive": "inconclusive"}


def extract_document(r: ExtractReport, argv: Sequence[str] | None = None) -> ExtractDocument:
    """The document of a prompt-extraction report (its ``to_json`` as the evidence); ``argv`` as above."""
    verdict = EXTRACT_VERDICTS.get(r.verdict, "inconclusive")
    finding = Finding("prompt extraction", verdict, r.reason, r.correct_chars, len(r.secret), "secret characters")
    finding.showing = "recovered by the attacker"
    finished = utc_now()
    return ExtractDocument(
        tool=Tool(version=kvlab_version()),
        started_at=_started(finished, r.seconds),
        finished_at=finished,
        command_line=redact_argv(argv or []),
        target=Target(base_url=redact_url(r.base_url), model=r.model),
        verdict=verdict,  # type: ignore[arg-type]
        exit_code=r.exit_code,
        findings=[finding_doc(finding)],
        requests=None,
        capabilities=ExtractCapabilities(
            channel=r.channel, channel_label=r.channel_label, granularity=r.granularity, metrics=r.metrics
        ),
        evidence=TypeAdapter(ExtractReport).validate_python(r.to_json()),
    )


def error_document(
    base_url: str, model: str | None, error: str, started: str, argv: Sequence[str] | None = None
) -> ErrorDocument:
    """The document of a run that stopped on ``error`` (exit status 2), begun at ``started`` (UTC)."""
    return ErrorDocument(
        tool=Tool(version=kvlab_version()),
        started_at=started,
        finished_at=utc_now(),
        command_line=redact_argv(argv or []),
        target=Target(base_url=redact_url(base_url), model=model or ""),
        verdict="error",
        exit_code=EXIT_NOTHING_MEASURED,
        findings=[],
        requests=None,
        error=redact_url(error),
    )


def dump(doc: Document) -> dict[str, Any]:
    """The document as JSON data (what ``--json`` writes)."""
    return doc.model_dump(mode="json")


if __name__ == "__main__":  # python -m kvlab.probe.schema > kvlab-probe-report.schema.json
    print(json.dumps(json_schema(), indent=2))
