"""What an auditor and a CI job read: the versioned JSON document (validated against its own JSON Schema), SARIF
2.1.0 (validated against the OASIS schema, vendored here: tests/probe/sarif-schema-2.1.0.json, the errata01 text
from oasis-tcs/sarif-spec sarif-2.1/schema/) and JUnit XML (parsed back)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from cli_output import words
from kvlab.cli import app
from kvlab.probe.attacks.base import ExtractReport, Step
from kvlab.probe.bursts import BurstResult, Observation
from kvlab.probe.client import PhaseRequests
from kvlab.probe.compare import Criterion
from kvlab.probe.determinism import Determinism
from kvlab.probe.junit import junit_xml
from kvlab.probe.report import Finding, contamination_finding, lost, timing_finding
from kvlab.probe.sarif import KINDS, sarif_log
from kvlab.probe.schema import REDACTED, extract_document, finding_doc, json_schema, redact_argv

SARIF_SCHEMA = json.loads((Path(__file__).parent / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def valid_document(data: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(json_schema()).validate(data)


def valid_sarif(log: dict[str, Any]) -> None:
    jsonschema.Draft4Validator(SARIF_SCHEMA).validate(log)


def test_the_json_schema_is_a_schema_and_is_printed() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    out = subprocess.run([sys.executable, "-m", "kvlab.probe.schema"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout) == schema
    jsonschema.Draft4Validator.check_schema(SARIF_SCHEMA)


def test_probe_json_sarif_and_junit_from_the_cli(standin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's behaviour (a salt accepted and ignored) is a leak: in all three reports, API key redacted."""
    url = standin(salts="ignore", report_cached="usage")
    sarif, junit = tmp_path / "probe.sarif", tmp_path / "probe.xml"
    args = ["probe", "--base-url", url + "/v1", "--rounds", "1", "--concurrency", "2", "--reuse-trials", "1"]
    args += ["--determinism-repeats", "1", "--api-key", "sekrit-key", "--request-timeout", "20", "--retries", "1"]
    args += ["--no-timing"]
    args += ["--json", "-", "--sarif", str(sarif), "--junit", str(junit)]
    monkeypatch.setattr(sys, "argv", ["kvlab", *args[:-6], "--metrics-api-key=op-sekrit", *args[-6:]])
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    valid_document(data)
    assert "sekrit" not in res.stdout and "sekrit" not in sarif.read_text() and "sekrit" not in junit.read_text()

    # The head: what ran, when, against what.
    assert data["schema_version"] == "1.2" and data["kind"] == "probe"
    assert data["tool"] == {"name": "kvlab probe", "version": version("kvlab")}
    assert ISO_UTC.match(data["started_at"]) and ISO_UTC.match(data["finished_at"])
    assert data["started_at"] <= data["finished_at"]
    assert data["command_line"][:2] == ["kvlab", "probe"] and "--metrics-api-key=***" in data["command_line"]
    assert data["command_line"][data["command_line"].index("--api-key") + 1] == REDACTED
    assert data["target"] == {"base_url": url, "model": "toy"}
    assert data["capabilities"]["cache_salt"]["accepted"] and data["capabilities"]["cached_tokens"]
    assert data["requests"]["timeout_seconds"] == 20 and data["requests"]["max_retries"] == 1
    assert data["requests"]["sent"] > 0 and data["requests"]["gave_up"] == 0
    assert all(" " not in c["id"] for c in data["side_channels"])
    # One finding per check, each with its severity, its one count and what to do.
    findings = {f["id"]: f for f in data["findings"]}
    assert list(findings) == ["contamination", "non_prefix_reuse", "salts", "cached_tokens", "timing"]
    # The stand-in shares its cache between clients without salts, and reports cached tokens: exposure there.
    assert findings["cached_tokens"]["verdict"] == "exposure" and findings["cached_tokens"]["count"]["observed"] > 0
    salts = findings["salts"]
    assert salts["verdict"] == "leak" and salts["severity"] == "high" and "llama.cpp" in salts["remediation"]
    assert salts["count"] == {
        "observed": 1,
        "measured": 1,
        "unit": "checks",
        "showing": "a cache hit across distinct salts",
    }
    assert findings["timing"]["verdict"] == "not_measured" and findings["timing"]["count"] is None
    for f in findings.values():
        if f["verdict"] == "leak":
            assert f["count"]["observed"] > 0
        if f["verdict"] == "clean" and f["count"] is not None:
            assert f["count"]["observed"] == 0 or f["id"] == "contamination"
    assert data["verdict"] == "leak" and data["exit_code"] == 1

    log = json.loads(sarif.read_text())
    valid_sarif(log)
    (run,) = log["runs"]
    assert run["tool"]["driver"]["name"] == "kvlab probe" and run["tool"]["driver"]["version"] == version("kvlab")
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == list(findings)
    results = {r["ruleId"]: r for r in run["results"]}
    assert results["salts"]["kind"] == "fail" and results["salts"]["level"] == "error"
    assert results["timing"]["kind"] == "notApplicable" and results["timing"]["level"] == "none"
    # The server is a logical location, never an artifact URI (GitHub takes only files of a repository).
    (where,) = results["salts"]["locations"]
    assert where == {"logicalLocations": [{"name": "toy", "fullyQualifiedName": url, "kind": "resource"}]}
    assert "artifacts" not in run and all(r["partialFingerprints"] for r in run["results"])
    assert run["invocations"][0]["exitCode"] == 1 and "--api-key '***'" in run["invocations"][0]["commandLine"]

    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == list(findings) and suite.get("tests") == "5" and suite.get("errors") == "0"
    assert float(cases["contamination"].get("time") or 0) > 0  # its phases' time
    failure = cases["salts"].find("failure")
    assert failure is not None and failure.get("type") == "leak" and "remediation:" in (failure.text or "")
    assert cases["timing"].find("skipped") is not None
    assert suite.get("failures") == str(sum(f["verdict"] in ("leak", "exposure") for f in findings.values()))
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["verdict"] == "leak" and props["kvlab_version"] == version("kvlab")


def test_the_command_line_is_redacted() -> None:
    argv = ["kvlab", "probe", "--api-key", "k1", "--victim-api-key=k2", "--metrics-api-key", "k3", "--max-tokens", "8"]
    argv += ["--base-url", "http://alice:pw@host:8000/v1?api_key=k4&x=1", "--secret", "s3cret", "--model", "m"]
    out = redact_argv(argv)
    assert out == [
        "kvlab", "probe", "--api-key", REDACTED, f"--victim-api-key={REDACTED}", "--metrics-api-key", REDACTED,
        "--max-tokens", "8", "--base-url", f"http://alice:{REDACTED}@host:8000/v1?api_key={REDACTED}&x=1",
        "--secret", REDACTED, "--model", "m",
    ]  # fmt: skip


def test_the_contamination_count_agrees_with_its_verdict() -> None:
    """The old JSON said ``contaminated: 0`` beside a contamination LEAK (the determinism rule: answers changed
    under cross-traffic on a server deterministic on its own). The finding's count is the changed answers."""
    bursts = BurstResult(counts={"same": 10, "diverged": 2, "contaminated": 0})
    det = Determinism(prompts=4, alone=4, burst=8)
    f = contamination_finding(bursts, det, Criterion("tokens", 4, 2, 10, 4))
    assert f.verdict == "leak" and (f.observed, f.measured, f.unit) == (2, 12, "answers")
    doc = finding_doc(f)
    assert doc.id == "contamination" and doc.severity == "critical" and doc.count is not None
    assert doc.count.observed == 2 and doc.count.showing == "a change under cross-traffic"
    # Where answers follow another prompt's reference, the count is theirs, as the reason says.
    bursts = BurstResult(counts={"same": 9, "diverged": 2, "contaminated": 1})
    bursts.observations = [Observation("g", 0, 0, "contaminated", 1, 1, 9, 6)]
    f = contamination_finding(bursts, det, Criterion("tokens", 4, 2, 10, 4))
    assert f.verdict == "leak" and f.reason.startswith("1 of 12 answers follow") and (f.observed, f.measured) == (1, 12)


def test_a_phase_that_lost_most_of_its_measurements_is_not_clean() -> None:
    clean = Finding("contamination", "clean", "all 3 answers equal their references", 0, 3, "answers")
    assert lost(clean, 3, 1, "answers").verdict == "clean"  # lost a little: a note
    assert "(1 of 4 answers dropped" in lost(clean, 3, 1, "answers").reason
    assert lost(clean, 3, 9, "answers").verdict == "inconclusive"
    leak = Finding("contamination", "leak", "2 of 3 changed", 2, 3, "answers")
    assert lost(leak, 3, 9, "answers").verdict == "leak"  # what was measured stands
    # A leak by changed answers rests on the server's determinism: most of its controls lost, it cannot stand.
    bursts = BurstResult(counts={"same": 10, "diverged": 2, "contaminated": 0})
    thin = contamination_finding(
        bursts, Determinism(prompts=4, alone=4, burst=1, dropped=20), Criterion("tokens", 4, 2, 10, 4)
    )
    assert thin.verdict == "inconclusive" and "determinism controls lost 20 of 25" in thin.reason
    dropped = timing_finding(None, PhaseRequests(sent=5, gave_up=1))
    assert dropped.verdict == "inconclusive" and "--request-timeout" in dropped.reason
    assert timing_finding(None).verdict == "not measured"


def test_lost_references_and_a_lost_channel_are_never_clean() -> None:
    """The three rules of a reference that gave up (its groups measured nowhere), and a timing "clean" whose
    cached_tokens channel the capability check could not read."""
    det, crit = Determinism(prompts=4, alone=4, burst=8), Criterion("tokens", 4, 2, 10, 4)
    refs = PhaseRequests(sent=10, gave_up=1)
    seen = [Observation("g", 0, 0, "same", 9, None, 0, 0)]  # a group that could show contamination, and did not
    clean = BurstResult(counts={"same": 12}, unreferenced_groups=["x"], observations=seen)
    f = contamination_finding(clean, det, crit, refs, "timed out")
    assert f.verdict == "inconclusive" and f.reason.startswith("a reference was lost, so it cannot be called clean")
    assert "1 of 10 reference requests gave up after their retries (timed out); group(s) x not measured" in f.reason
    leak = BurstResult(counts={"same": 10, "diverged": 2}, unreferenced_groups=["x"])
    f = contamination_finding(leak, det, crit, refs)
    assert f.verdict == "leak" and f.reason.endswith("(1 of 10 reference requests gave up after their retries; "
                                                     "group(s) x not measured)")  # fmt: skip
    nothing = contamination_finding(BurstResult(unreferenced_groups=["x", "y"]), det, crit, refs)
    assert nothing.verdict == "inconclusive" and nothing.reason.startswith("nothing could be measured")
    assert contamination_finding(clean, det, crit).verdict == "clean"  # the control: no reference lost
    from types import SimpleNamespace

    quiet = SimpleNamespace(verdict="clean", reason="no run revealed a hit", runs=[])
    lost_channel = timing_finding(quiet, None, "the capability check gave up")  # type: ignore[arg-type]
    assert lost_channel.verdict == "inconclusive"
    assert lost_channel.reason == "no run revealed a hit; but the capability check gave up"
    assert timing_finding(quiet).verdict == "clean"  # type: ignore[arg-type]
    shown = SimpleNamespace(verdict="leak", reason="a run revealed a hit", runs=[])
    assert timing_finding(shown, None, "the capability check gave up").verdict == "leak"  # type: ignore[arg-type]


def extraction(verdict: str = "leak") -> ExtractReport:
    return ExtractReport(
        base_url="http://127.0.0.1:9/",
        model="toy",
        alphabet="abcd",
        secret="abcdab",
        prefix_chars=64,
        channel="cached_tokens",
        granularity=1,
        recovered="abcd",
        correct_chars=4,
        chance=1 / 256,
        verdict=verdict,
        reason="recovered 4 of 6 characters",
        steps=[Step(0, 1, 4, 2, "recovered", "a", True)],
        seconds=1.5,
    )


@pytest.mark.parametrize(
    ("verdict", "mapped"), [("leak", "leak"), ("no leak", "clean"), ("inconclusive", "inconclusive")]
)
def test_the_extraction_report_has_the_same_head(verdict: str, mapped: str) -> None:
    report = extraction(verdict)
    doc = extract_document(report, ["kvlab", "probe", "--extract", "--victim-api-key", "v"])
    data = doc.model_dump(mode="json")
    valid_document(data)
    assert data["kind"] == "extract" and data["verdict"] == mapped and data["exit_code"] == int(verdict == "leak")
    assert data["command_line"][-1] == REDACTED and ISO_UTC.match(data["finished_at"])
    assert data["evidence"] == json.loads(json.dumps(report.to_json()))  # the report's own JSON, whole
    (finding,) = data["findings"]
    assert finding["id"] == "prompt_extraction" and finding["verdict"] == mapped
    assert finding["count"] == {
        "observed": 4, "measured": 6, "unit": "secret characters", "showing": "recovered by the attacker"
    }  # fmt: skip
    assert finding["severity"] == {"leak": "critical", "clean": "info", "inconclusive": "low"}[mapped]
    valid_sarif(sarif_log(doc))
    (case,) = ET.fromstring(junit_xml(doc)).iter("testcase")
    assert (case.find("failure") is not None) == (verdict == "leak")


def test_sarif_levels_follow_the_kinds() -> None:
    """SARIF 2.1.0 §3.27.10: a result whose kind is not ``fail`` has level ``none``."""
    for verdict, kind in KINDS.items():
        f = Finding("timing", verdict.replace("_", " "), "why")
        doc = extract_document(extraction())
        doc.findings = [finding_doc(f)]
        (result,) = sarif_log(doc)["runs"][0]["results"]
        assert result["kind"] == kind
        assert (result["level"] == "none") == (kind != "fail"), result
        valid_sarif(sarif_log(doc))


def test_junit_carries_no_character_xml_cannot() -> None:
    doc = extract_document(extraction())
    doc.findings = [finding_doc(Finding("contamination", "leak", "an answer with \x00 and \x1b[0m in it", 1, 1, "x"))]
    case = ET.fromstring(junit_xml(doc)).find("testsuite/testcase/failure")
    assert case is not None and "\ufffd and \ufffd[0m" in (case.text or "")


@pytest.mark.parametrize("option", ["--json", "--sarif", "--junit"])
def test_an_output_path_that_cannot_be_written_is_a_usage_error_before_any_request(tmp_path, monkeypatch, option):
    """Exit 2 (could not run), naming the option and the path, and no request sent: not a whole probe and then a
    traceback with the leak code."""
    import kvlab.openai_http as openai_http
    import kvlab.probe.probe as probe

    def no_request(*args, **kwargs):
        raise AssertionError("a request was sent before the output paths were checked")

    monkeypatch.setattr(openai_http, "discover_model", no_request)
    monkeypatch.setattr(probe, "run_probe", no_request)
    runner = CliRunner()
    for bad, why in [(tmp_path / "missing" / "r.out", "does not exist"), (tmp_path, "is a folder")]:
        res = runner.invoke(app, ["probe", "--base-url", "http://127.0.0.1:9", option, str(bad)])
        assert res.exit_code == 2, res.output
        assert option in words(res.output) and why in words(res.output)
