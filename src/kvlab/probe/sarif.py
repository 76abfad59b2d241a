"""``kvlab probe --sarif PATH``: a report (``kvlab.probe.schema``) as a SARIF 2.1.0 log, for code-scanning UIs.

One run; its tool is ``kvlab probe`` at kvlab's version, with one rule per check the run made (``schema.CHECKS``)
and one result per finding. A finding that found a problem (leak, exposure) is a result of kind ``fail`` with
the level of its severity (critical and high: ``error``, medium: ``warning``, low: ``note``); the others are
results of kind ``review`` (inconclusive), ``pass`` (clean), ``notApplicable`` (not measured) or
``informational``, whose level SARIF fixes at ``none`` (§3.27.10). Every result is located at the probed server's
URL, the run's one artifact. The invocation has the (redacted) command line, the exit code and the times.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from kvlab.probe.report import EXIT_NOTHING_MEASURED
from kvlab.probe.schema import CHECKS, Check, Document, FindingDoc, remediation

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
    return {
        "id": check.id,
        "name": "".join(w[:1].upper() + w[1:] for w in re.split(r"[^A-Za-z0-9]+", check.title) if w),
        "shortDescription": {"text": check.title},
        "fullDescription": {"text": check.description},
        "help": {"text": remediation(check.id, "leak")},
        "defaultConfiguration": {"level": LEVELS[check.leak_severity]},
        "properties": {
            "tags": ["security", "kv-cache", "isolation"],
            "security-severity": SECURITY_SEVERITY[check.leak_severity],
        },
    }


def result(f: FindingDoc, index: int, uri: str) -> dict[str, Any]:
    properties: dict[str, Any] = {"verdict": f.verdict, "severity": f.severity, "remediation": f.remediation}
    if f.count is not None:
        properties["count"] = f.count.model_dump()
    return {
        "ruleId": f.id,
        "ruleIndex": index,
        "kind": KINDS[f.verdict],
        "level": level(f),
        "message": {"text": f"{f.name}: {f.verdict.replace('_', ' ')}: {f.reason}"},
        "locations": [{"physicalLocation": {"artifactLocation": {"uri": uri, "index": 0}}}],
        "properties": properties,
    }


def sarif_log(doc: Document) -> dict[str, Any]:
    """The SARIF 2.1.0 log of a report document (see the module docstring)."""
    checks = [CHECKS.get(f.id) or Check(f.id, f.name, f.name, f.reason, "high") for f in doc.findings]
    uri = doc.target.base_url
    invocation: dict[str, Any] = {
        "executionSuccessful": doc.exit_code != EXIT_NOTHING_MEASURED,
        "exitCode": doc.exit_code,
        "exitCodeDescription": EXIT_CODES,
        "startTimeUtc": doc.started_at,
        "endTimeUtc": doc.finished_at,
    }
    if doc.command_line:
        invocation["commandLine"] = shlex.join(doc.command_line)
        invocation["arguments"] = doc.command_line[1:]
    run = {
        "tool": {
            "driver": {
                "name": doc.tool.name,
                "version": doc.tool.version,
                "rules": [rule(c) for c in checks],
            }
        },
        "invocations": [invocation],
        "artifacts": [
            {"location": {"uri": uri}, "description": {"text": f"the server probed, serving {doc.target.model}"}}
        ],
        "results": [result(f, i, uri) for i, f in enumerate(doc.findings)],
        "properties": {
            "kind": doc.kind,
            "verdict": doc.verdict,
            "model": doc.target.model,
            "schemaVersion": doc.schema_version,
        },
    }
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": [run]}


def write_sarif(path: Path, doc: Document) -> None:
    path.write_text(json.dumps(sarif_log(doc), indent=2, ensure_ascii=False), encoding="utf-8")
