"""``kvlab probe --sarif PATH``: a report (``kvlab.probe.schema``) as a SARIF 2.1.0 log, for code-scanning UIs.

One run; its tool is ``kvlab probe`` at kvlab's version, with one rule per check the run made (``schema.CHECKS``)
and one result per finding. A finding that found a problem (leak, exposure) is a result of kind ``fail`` with
the level of its severity (critical and high: ``error``, medium: ``warning``, low: ``note``); the others are
results of kind ``review`` (inconclusive), ``pass`` (clean), ``notApplicable`` (not measured) or
``informational``, whose level SARIF fixes at ``none`` (§3.27.10). The invocation has the (redacted) command
line, the exit code and the times; a run that could not finish (exit status 2) has ``executionSuccessful:
false`` and a notification saying why.

For GitHub code scanning (its SARIF upload rules, ``tests/probe/test_probe_report_formats.py``): no artifact
has an ``http(s)`` URI (the server is no file of a repository): every result names the server as a logical
location (kind ``resource``, the model and the redacted URL), and points at a file only where the run was
configured by one (``--passphrases``, ``--reuse-groups``, ``--dictionary``, ``--candidates``: ``config``);
every result has ``partialFingerprints`` (the check, the server and the model: the same alert from run to
run), every rule a ``help`` text and a ``security-severity``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

from kvlab.probe.report import EXIT_NOTHING_MEASURED
from kvlab.probe.schema import CHECKS, Check, Document, ErrorDocument, FindingDoc, remediation

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
LEVELS = {"critical": "error", "high": "error", "medium": "warning", "low": "note", "info": "note"}
KINDS = {
    "leak": "fail",
    "exposure": "fail",
    "inconclusive": "review",
    "clean": "pass",
    "not_measured": "notApplicable",
    "info": "informational",
}
# GitHub code scanning's numeric severity of a security rule (its critical starts at 9.0, high at 7.0).
SECURITY_SEVERITY = {"critical": "9.5", "high": "8.0", "medium": "5.5", "low": "3.0", "info": "0.0"}
EXIT_CODES = "0: no leak or exposure; 1: a leak; 3: exposure only; 2: the probe failed or measured nothing"


def level(f: FindingDoc) -> str:
    return LEVELS[f.severity] if KINDS[f.verdict] == "fail" else "none"


def rule(check: Check) -> dict[str, Any]:
    """The reportingDescriptor of a check: its id, a PascalCase name, descriptions, and what to do on a leak."""
    todo = remediation(check.id, "leak")
    return {
        "id": check.id,
        "name": "".join(w[:1].upper() + w[1:] for w in re.split(r"[^A-Za-z0-9]+", check.title) if w),
        "shortDescription": {"text": check.title},
        "fullDescription": {"text": check.description},
        "help": {"text": todo, "markdown": f"**{check.title}**: {todo}"},
        "defaultConfiguration": {"level": LEVELS[check.leak_severity]},
        "properties": {
            "tags": ["security", "kv-cache", "isolation"],
            "security-severity": SECURITY_SEVERITY[check.leak_severity],
        },
    }


def fingerprint(doc: Document, check: str) -> str:
    """The same for the same check of the same server and model, run after run (GitHub matches alerts by it)."""
    return hashlib.sha256(f"{check}|{doc.target.base_url}|{doc.target.model}".encode()).hexdigest()[:32]


def artifact_uri(config: Path) -> str:
    """A configuration file as an artifact URI: relative as given (to the repository it is checked out in),
    else a ``file:`` URI."""
    return config.as_uri() if config.is_absolute() else config.as_posix()


def result(doc: Document, f: FindingDoc, index: int, config: Path | None = None) -> dict[str, Any]:
    properties: dict[str, Any] = {"verdict": f.verdict, "severity": f.severity, "remediation": f.remediation}
    properties["server"] = doc.target.base_url
    if f.count is not None:
        properties["count"] = f.count.model_dump()
    location: dict[str, Any] = {
        "logicalLocations": [
            {"name": doc.target.model or "server", "fullyQualifiedName": doc.target.base_url, "kind": "resource"}
        ]
    }
    if config is not None:
        location["physicalLocation"] = {
            "artifactLocation": {"uri": artifact_uri(config), "index": 0},
            "region": {"startLine": 1},
        }
    return {
        "ruleId": f.id,
        "ruleIndex": index,
        "kind": KINDS[f.verdict],
        "level": level(f),
        "message": {"text": f"{f.name}: {f.verdict.replace('_', ' ')}: {f.reason}"},
        "locations": [location],
        "partialFingerprints": {"kvlabProbeCheck/v1": fingerprint(doc, f.id)},
        "properties": properties,
    }


def sarif_log(doc: Document, config: Path | None = None) -> dict[str, Any]:
    """The SARIF 2.1.0 log of a report document (see the module docstring); ``config``: the file that
    configured the run, if one did."""
    checks = [CHECKS.get(f.id) or Check(f.id, f.name, f.name, f.reason, "high") for f in doc.findings]
    invocation: dict[str, Any] = {
        "executionSuccessful": doc.exit_code != EXIT_NOTHING_MEASURED,
        "exitCode": doc.exit_code,
        "exitCodeDescription": EXIT_CODES,
        "startTimeUtc": doc.started_at,
        "endTimeUtc": doc.finished_at,
    }
    why = doc.error if isinstance(doc, ErrorDocument) else ""
    if doc.exit_code == EXIT_NOTHING_MEASURED:
        why = why or "nothing could be measured: requests gave up after their retries (see the results)"
        invocation["toolExecutionNotifications"] = [{"level": "error", "message": {"text": why}}]
    if doc.command_line:
        invocation["commandLine"] = shlex.join(doc.command_line)
        invocation["arguments"] = doc.command_line[1:]
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": doc.tool.name,
                "version": doc.tool.version,
                "rules": [rule(c) for c in checks],
            }
        },
        "invocations": [invocation],
        "results": [result(doc, f, i, config) for i, f in enumerate(doc.findings)],
        "properties": {
            "kind": doc.kind,
            "verdict": doc.verdict,
            "model": doc.target.model,
            "schemaVersion": doc.schema_version,
            "server": doc.target.base_url,
        },
    }
    if config is not None:
        what = {"text": "the file that configured the probe's run"}
        run["artifacts"] = [{"location": {"uri": artifact_uri(config)}, "description": what}]
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": [run]}


def write_sarif(path: Path, doc: Document, config: Path | None = None) -> None:
    path.write_text(json.dumps(sarif_log(doc, config), indent=2, ensure_ascii=False), encoding="utf-8")
