"""``kvlab probe --junit PATH``: a report (``kvlab.probe.schema``) as JUnit XML, for CI test reports.

One testsuite (inside ``<testsuites>``), one testcase per check, its ``time`` the phases that measured it. A
leak is a failure; so is exposure (the probe exits 3 on it: a job that fails on the exit code shows why); a
check that was not measured, or measured without a conclusion (inconclusive), is skipped with its reason;
the others pass, their verdict and reason in ``system-out``. A run that could not finish (exit status 2: an
error document, or a run that measured nothing) has one more testcase, ``run``, with an ``<error>``, counted
in ``errors``. Properties: the versions, the target, the verdict and exit code, the (redacted) command line
and the request counts.
"""

from __future__ import annotations

import re
import shlex
import xml.etree.ElementTree as ET
from datetime import datetime
from pathlib import Path

from kvlab.probe.report import EXIT_NOTHING_MEASURED
from kvlab.probe.schema import CHECKS, Document, ErrorDocument, ExtractDocument, FindingDoc, ProbeDocument

FAILURES = ("leak", "exposure")
SKIPPED = ("not_measured", "inconclusive")
# Characters XML 1.0 cannot carry (an answer or an error body quoted in a reason may have them).
_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)


def seconds(doc: Document) -> float:
    if isinstance(doc, ProbeDocument):
        return doc.run.seconds
    if isinstance(doc, ExtractDocument):
        return doc.evidence.seconds
    when = [datetime.strptime(t, "%Y-%m-%dT%H:%M:%SZ") for t in (doc.started_at, doc.finished_at)]
    return (when[1] - when[0]).total_seconds()


def case_seconds(doc: Document, f: FindingDoc) -> float:
    """The time of a finding's testcase: its check's phases (the whole run for an extraction)."""
    if isinstance(doc, ProbeDocument):
        check = CHECKS.get(f.id)
        return sum(doc.run.phase_seconds.get(p, 0.0) for p in (check.phases if check is not None else ()))
    return seconds(doc)


def error_of(doc: Document) -> str:
    """Why the run could not finish ("" when it did)."""
    if isinstance(doc, ErrorDocument):
        return doc.error
    if doc.exit_code == EXIT_NOTHING_MEASURED:
        return "nothing could be measured: requests gave up after their retries (see the findings)"
    return ""


def junit_xml(doc: Document) -> str:
    """The JUnit XML of a report document (see the module docstring)."""
    error = error_of(doc)
    failures = sum(f.verdict in FAILURES for f in doc.findings)
    skipped = sum(f.verdict in SKIPPED for f in doc.findings)
    counts = {
        "tests": str(len(doc.findings) + bool(error)),
        "failures": str(failures),
        "errors": str(int(bool(error))),
        "skipped": str(skipped),
    }
    took = f"{seconds(doc):.3f}"
    root = ET.Element("testsuites", {"name": doc.tool.name, "time": took, **counts})
    suite = ET.SubElement(
        root,
        "testsuite",
        {
            "name": _xml(f"{doc.tool.name} {doc.target.base_url} ({doc.target.model})"),
            "timestamp": doc.started_at.removesuffix("Z"),  # JUnit's timestamp has no zone; it is UTC
            "time": took,
            **counts,
        },
    )
    props = ET.SubElement(suite, "properties")
    values = {
        "kvlab_version": doc.tool.version,
        "schema_version": doc.schema_version,
        "kind": doc.kind,
        "base_url": doc.target.base_url,
        "model": doc.target.model,
        "verdict": doc.verdict,
        "exit_code": str(doc.exit_code),
        "started_at": doc.started_at,
        "finished_at": doc.finished_at,
        "command_line": shlex.join(doc.command_line),
    }
    if doc.requests is not None:
        values |= {
            "requests_sent": str(doc.requests.sent),
            "requests_retried": str(doc.requests.retried),
            "requests_gave_up": str(doc.requests.gave_up),
        }
    for name, value in values.items():
        ET.SubElement(props, "property", name=name, value=_xml(value))
    classname = f"kvlab.probe.{doc.kind}"
    if error:
        case = ET.SubElement(suite, "testcase", classname=classname, name="run", time=took)
        ET.SubElement(case, "error", type="probe-error", message=_xml(error[:300])).text = _xml(error)
    for f in doc.findings:
        case = ET.SubElement(suite, "testcase", classname=classname, name=f.id, time=f"{case_seconds(doc, f):.3f}")
        text = _xml(f"{f.name}: {f.verdict.replace('_', ' ')} ({f.severity}): {f.reason}")
        if f.verdict in FAILURES:
            failure = ET.SubElement(case, "failure", type=f.verdict, message=_xml(f"{f.severity}: {f.reason[:300]}"))
            failure.text = f"{text}\nremediation: {_xml(f.remediation)}"
        elif f.verdict in SKIPPED:
            ET.SubElement(case, "skipped", message=_xml(f"{f.verdict.replace('_', ' ')}: {f.reason}"))
            ET.SubElement(case, "system-out").text = f"{text}\nremediation: {_xml(f.remediation)}"
        else:
            ET.SubElement(case, "system-out").text = text
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(path: Path, doc: Document) -> None:
    path.write_text(junit_xml(doc), encoding="utf-8")
