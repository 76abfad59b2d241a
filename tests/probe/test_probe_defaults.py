"""The probe right by default: ``kvlab probe --base-url URL`` alone decides every side channel it can see (the
contamination, the salts, ``cached_tokens`` and a powered timing test), bounded and planned before its first
request; exit codes mean one thing each, and a run that ends in 2 still writes every report asked for, in forms
CI tools take (SARIF by GitHub's upload rules, JUnit with times, skips and errors).

The stand-ins (``conftest``) play the servers: kvlab's default (one anonymous tenant, cached_tokens reported,
salts honoured), llama.cpp (salts accepted and ignored), a server with prefix caching off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from cli_output import words
from kvlab.cli import app
from kvlab.experiment.passphrases import default_passphrases
from kvlab.probe.client import Capabilities, SaltAcceptance
from kvlab.probe.granularity import Granularity, Sample
from kvlab.probe.probe import ProbeConfig, plan_requests, run_probe
from kvlab.probe.report import cached_tokens_finding
from kvlab.probe.sarif import sarif_log
from kvlab.probe.schema import error_document, json_schema

SARIF_SCHEMA = json.loads((Path(__file__).parent / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
# Small bursts: the channels, not the contamination, are under test here (nothing else is shortened).
SMALL = ["--rounds", "1", "--concurrency", "2", "--determinism-repeats", "1", "--no-reuse"]
KVLAB_DEFAULT: dict[str, Any] = dict(token_ids=True, report_cached="usage", max_model_len=1024)
LLAMA_CPP: dict[str, Any] = dict(salts="ignore", report_cached="timings", max_model_len=1024)
NO_CACHE: dict[str, Any] = dict(cache=False, report_cached="usage", max_model_len=1024, per_char=1e-5)


def probe_cli(url: str, *extra: str) -> tuple[int, dict[str, Any], str]:
    res = CliRunner().invoke(app, ["probe", "--base-url", url, *SMALL, *extra, "--json", "-"])
    data = json.loads(res.stdout) if res.stdout.lstrip().startswith("{") else {}
    return res.exit_code, data, res.output


def verdicts(data: dict[str, Any]) -> dict[str, str]:
    return {f["id"]: f["verdict"] for f in data["findings"]}


# ------------------------------------------------------------------ one default run, every channel
def test_no_flags_on_a_shared_cache_is_exposure_by_cached_tokens_and_ttft(standin) -> None:
    """kvlab serve's default (every key-less client one tenant): the old probe said CLEAN, exit 0."""
    code, data, out = probe_cli(standin(**KVLAB_DEFAULT))
    assert code == 3, out
    v = verdicts(data)
    assert v["cached_tokens"] == "exposure" and v["timing"] == "exposure" and v["salts"] == "clean"
    assert data["verdict"] == "exposure" and data["evidence"]["timing"] is not None  # the timing ran unasked
    assert "probe plan: at most" in out  # said before the first request


def test_no_flags_on_llama_cpp_is_a_leak(standin) -> None:
    code, data, out = probe_cli(standin(**LLAMA_CPP))
    assert code == 1, out
    assert verdicts(data)["salts"] == "leak" and data["verdict"] == "leak"


def test_no_flags_with_prefix_caching_off_finds_nothing(standin) -> None:
    """No hit up to the model's whole context, by cached_tokens and TTFT: clean, with the power said."""
    code, data, out = probe_cli(standin(**NO_CACHE))
    assert code == 0, out
    v = verdicts(data)
    assert v["cached_tokens"] == "clean" and v["timing"] == "clean" and data["verdict"] == "clean"


def test_the_search_is_bounded_and_says_what_it_did_not_reach(standin) -> None:
    """A context longer than --search-tokens: the search stops there, and nothing below it proves no cache."""
    url = standin(**{**NO_CACHE, "max_model_len": 4096})
    code, data, out = probe_cli(url, "--search-tokens", "256", "--no-timing")
    assert code == 0, out
    found = next(f for f in data["findings"] if f["id"] == "cached_tokens")
    assert found["verdict"] == "inconclusive" and "--search-tokens searches further" in found["reason"]
    assert "short of max_model_len 4096" in found["reason"]
    assert data["evidence"]["granularity"]["bound"] <= 256


def test_no_timing_skips_it_and_says_so(standin) -> None:
    code, data, out = probe_cli(standin(**KVLAB_DEFAULT), "--no-timing")
    assert code == 3, out  # cached_tokens alone tells
    assert verdicts(data)["timing"] == "not_measured" and "--no-timing" in out


def test_the_plan_bounds_every_phase(standin) -> None:
    """The plan printed before the first request is an upper bound of what each phase sent (retries apart)."""
    cfg = ProbeConfig(concurrency=2, rounds=1, determinism_repeats=1, reuse_trials=1, timing_trials=6)
    url = standin(**KVLAB_DEFAULT)
    plan = plan_requests(cfg, default_passphrases(), None)
    r = run_probe(url, "toy", default_passphrases(), cfg)
    assert r.requests is not None
    sent = {phase: r.requests.phase(phase).sent for phase in plan}
    assert all(sent[p] <= plan[p] for p in plan), (sent, plan)
    assert sent["timing"] > 0 and sent["reuse"] > 0 and sent["granularity"] > 0


# ------------------------------------------------------------------ the cached_tokens finding
def caps(cached: bool = True) -> Capabilities:
    return Capabilities("response", None, cached_tokens=cached, salt=SaltAcceptance(True))


def test_the_cached_tokens_finding_reads_the_search() -> None:
    hit = Granularity("cached_tokens", context=1024, bound=64, bound_by="", first_hit=64, block=16)
    hit.samples = [Sample(16, 64, 0), Sample(32, 128, 0), Sample(64, 256, 64)]
    f = cached_tokens_finding(hit, caps())
    assert f.verdict == "exposure" and (f.observed, f.measured) == (1, 3) and "reported 64 cached tokens" in f.reason
    none = Granularity("cached_tokens", context=1024, bound=990, bound_by="context", samples=[Sample(990, 3960, 0)])
    assert cached_tokens_finding(none, caps()).verdict == "clean"
    short = Granularity("cached_tokens", context=None, bound=2048, bound_by="probe", samples=[Sample(2048, 8192, 0)])
    assert cached_tokens_finding(short, caps()).verdict == "inconclusive"
    # A server that reports 0 while TTFT steps: this channel hides the hit (the timing finding has it).
    ttft = Granularity("TTFT", context=1024, first_hit=128, samples=[Sample(128, 512, 0)])
    ttft.notes.append("cached_tokens reported no hit up to 990 tokens, but TTFT steps at 128")
    assert cached_tokens_finding(ttft, caps()).verdict == "clean"
    assert cached_tokens_finding(None, caps(False)).verdict == "not measured"
    assert cached_tokens_finding(None, caps()).verdict == "inconclusive"  # the search was dropped


# ------------------------------------------------------------------ exit 2 writes its reports
def reports(tmp_path: Path) -> tuple[Path, Path, Path, list[str]]:
    j, s, x = tmp_path / "r.json", tmp_path / "r.sarif", tmp_path / "r.xml"
    return j, s, x, ["--json", str(j), "--sarif", str(s), "--junit", str(x)]


def check_error_reports(j: Path, s: Path, x: Path, why: str) -> None:
    doc = json.loads(j.read_text())
    jsonschema.Draft202012Validator(json_schema()).validate(doc)
    assert doc["kind"] == "error" and doc["exit_code"] == 2 and doc["verdict"] == "error" and why in doc["error"]
    log = json.loads(s.read_text())
    jsonschema.Draft4Validator(SARIF_SCHEMA).validate(log)
    (invocation,) = log["runs"][0]["invocations"]
    assert invocation["executionSuccessful"] is False and invocation["exitCode"] == 2
    assert why in invocation["toolExecutionNotifications"][0]["message"]["text"]
    suite = ET.parse(x).getroot().find("testsuite")
    assert suite is not None and suite.get("errors") == "1" and suite.get("tests") == "1"
    error = suite.find("testcase/error")
    assert error is not None and why in (error.get("message") or "")


@pytest.mark.parametrize("model", [None, "toy"])
def test_an_unreachable_server_exits_2_with_every_report(tmp_path: Path, model: str | None) -> None:
    """Without --model the discovery fails; with it, the first completion: either way exit 2 and three reports."""
    j, s, x, args = reports(tmp_path)
    extra = ["--model", model] if model else []
    res = CliRunner().invoke(app, ["probe", "--base-url", "http://127.0.0.1:9", *extra, *args])
    assert res.exit_code == 2, res.output
    check_error_reports(j, s, x, "127.0.0.1:9")


def test_a_server_that_answers_no_completion_exits_2_with_every_report(standin, tmp_path: Path) -> None:
    j, s, x, args = reports(tmp_path)
    url = standin()
    res = CliRunner().invoke(app, ["probe", "--base-url", url + "/nothere", "--model", "toy", *args])
    assert res.exit_code == 2, res.output
    check_error_reports(j, s, x, "answered 404")


def test_a_bad_passphrase_file_exits_2_with_every_report(tmp_path: Path) -> None:
    j, s, x, args = reports(tmp_path)
    bad = tmp_path / "p.yaml"
    bad.write_text("groups: 3\n", encoding="utf-8")
    res = CliRunner().invoke(
        app, ["probe", "--base-url", "http://127.0.0.1:9", "--model", "m", "--passphrases", str(bad), *args]
    )
    assert res.exit_code == 2, res.output
    check_error_reports(j, s, x, "p.yaml")


def test_a_bad_alpha_is_a_usage_error() -> None:
    res = CliRunner().invoke(app, ["probe", "--base-url", "http://127.0.0.1:9", "--alpha", "1"])
    assert res.exit_code == 2 and "strictly between 0 and 1" in words(res.output)


# ------------------------------------------------------------------ SARIF by GitHub's upload rules
def github_rules(log: dict[str, Any]) -> list[str]:
    """The rules of GitHub's SARIF upload this test holds kvlab's SARIF to (docs.github.com, "SARIF support for
    code scanning"): version 2.1.0; every rule has an id, a shortDescription, a fullDescription and a help text,
    and a numeric security-severity; every result names a known rule, has a message, at least one location
    and partialFingerprints; no artifact URI has an http(s) scheme (GitHub reads them as repository files)."""
    problems = []
    if log.get("version") != "2.1.0":
        problems.append("version")
    for run in log["runs"]:
        rules = run["tool"]["driver"]["rules"]
        ids = [r["id"] for r in rules]
        for r in rules:
            for key in ("shortDescription", "fullDescription", "help"):
                if not r.get(key, {}).get("text"):
                    problems.append(f"rule {r['id']}: no {key}")
            float(r["properties"]["security-severity"])
        for res in run["results"]:
            if res["ruleId"] not in ids or not res["message"]["text"] or not res.get("partialFingerprints"):
                problems.append(f"result {res['ruleId']}: rule, message or fingerprints")
            if not res.get("locations"):
                problems.append(f"result {res['ruleId']}: no location")
        uris = [a["location"]["uri"] for a in run.get("artifacts", [])]
        uris += [
            loc["physicalLocation"]["artifactLocation"]["uri"]
            for res in run["results"]
            for loc in res["locations"]
            if "physicalLocation" in loc
        ]
        problems += [f"artifact URI {u}" for u in uris if u.startswith(("http:", "https:"))]
    return problems


def multitool(path: Path) -> list[str]:
    """Microsoft's SARIF Multitool (npm @microsoft/sarif-multitool, installed by scripts/test.sh) with its
    GitHub rule set: the errors it reports."""
    tool = os.environ.get("KVLAB_SARIF_MULTITOOL") or shutil.which("Sarif.Multitool")
    if not tool:
        pytest.skip("the SARIF Multitool is not installed (scripts/test.sh installs it with npm)")
    out = path.with_suffix(".validation.sarif")
    done = subprocess.run(
        [tool, "validate", "--rule-kind", "Sarif;Gh", "-o", str(out), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), done.stdout + done.stderr
    results = json.loads(out.read_text())["runs"][0]["results"]
    return [f"{r['ruleId']}: {r['message']}" for r in results if r.get("level") == "error"]


def test_the_sarif_passes_githubs_upload_rules(standin, tmp_path: Path) -> None:
    passphrases = tmp_path / "phrases.yaml"
    text = (Path(__file__).parents[2] / "src/kvlab/experiment/data/default.yaml").read_text(encoding="utf-8")
    passphrases.write_text(text, encoding="utf-8")
    sarif, plain = tmp_path / "with-config.sarif", tmp_path / "plain.sarif"
    url = standin(**KVLAB_DEFAULT)
    res = CliRunner().invoke(
        app,
        ["probe", "--base-url", url, *SMALL, "--no-timing", "--passphrases", str(passphrases), "--sarif", str(sarif)],
    )
    assert res.exit_code == 3, res.output
    res = CliRunner().invoke(app, ["probe", "--base-url", url, *SMALL, "--no-timing", "--sarif", str(plain)])
    assert res.exit_code == 3, res.output
    failed = tmp_path / "failed.sarif"
    failed.write_text(json.dumps(sarif_log(error_document(url, "toy", "it broke", "2026-01-01T00:00:00Z"))))
    for path in (sarif, plain, failed):
        log = json.loads(path.read_text())
        jsonschema.Draft4Validator(SARIF_SCHEMA).validate(log)
        assert github_rules(log) == [], (path.name, github_rules(log))
    # The server is each result's logical location; with a configuration file, every result also points at it
    # (an absolute path as a file: URI; a relative one as given, relative to the repository checked out).
    log = json.loads(sarif.read_text())
    results = log["runs"][0]["results"]
    where = {loc["physicalLocation"]["artifactLocation"]["uri"] for r in results for loc in r["locations"]}
    assert where == {passphrases.as_uri()} and log["runs"][0]["artifacts"][0]["location"]["uri"] == where.pop()
    assert all(r["locations"][0]["logicalLocations"][0]["fullyQualifiedName"] == url for r in results)
    for path in (sarif, plain, failed):
        assert multitool(path) == [], path
