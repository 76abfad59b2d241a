"""`kvlab probe` against live servers: silent on a healthy one, loud on an unsafe one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.experiment.passphrases import default_passphrases
from kvlab.probe.probe import Answer, classify, run_probe


def test_classify() -> None:
    own, other = Answer("", (1, 2, 3, 4)), Answer("", (1, 9, 9, 9))
    assert classify(Answer("", (1, 2, 3, 4)), own, {1: other})[0] == "same"
    assert classify(Answer("", (1, 9, 9, 9)), own, {1: other})[0] == "contaminated"
    assert classify(Answer("", (1, 9, 5, 5)), own, {1: other})[0] == "contaminated"
    assert classify(Answer("", (1, 2, 3, 7)), own, {1: other})[0] == "diverged"
    assert classify(Answer("", (5, 5, 5, 5)), own, {1: other})[0] == "diverged"
    # A reference equal to our own cannot tell contamination from correctness.
    assert classify(Answer("", (1, 2, 3, 7)), own, {1: own})[0] == "diverged"
    # Without token ids (another server), text is compared.
    assert classify(Answer("bonjour", None), Answer("hello", None), {1: Answer("bonjour", None)})[0] == "contaminated"


def test_probe_healthy_server_reports_no_contamination(http) -> None:
    report = run_probe(http.base_url, "mini", default_passphrases(), concurrency=6, rounds=3)
    print(f"\nhealthy server: {report.counts}")
    assert report.contaminated == 0, [o for o in report.observations if o.outcome == "contaminated"]
    # Not vacuous: responses were compared, and some groups' references differ (a leak would show).
    assert report.counts["same"] > 0
    assert len(report.uninformative_groups) < len(default_passphrases().groups)


def test_probe_catches_shared_no_cow(make_server) -> None:
    _, http = make_server(unsafe_strategy="shared-no-cow")
    # Leaks depend on arrival timing; 4 rounds have always shown several (5 to 10 at 3 rounds here).
    report = run_probe(http.base_url, "mini", default_passphrases(), concurrency=6, rounds=4)
    print(f"\nshared-no-cow server: {report.counts}")
    assert report.contaminated > 0, report.counts


def test_probe_cli_json(http, tmp_path) -> None:
    # The /v1 form the openai client takes, and no --model: the first id of /v1/models.
    args = ["probe", "--base-url", http.base_url + "/v1/", "--rounds", "1", "--concurrency", "3"]
    res = CliRunner().invoke(app, [*args, "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["counts"]["contaminated"] == 0 and sum(data["counts"].values()) == 3 * 4
    assert data["model"] == "mini"
    out = tmp_path / "probe.json"
    res = CliRunner().invoke(app, [*args, "--json", str(out)])  # --json PATH, as in every command
    assert res.exit_code == 0 and "verdict" in res.output
    assert json.loads(out.read_text())["counts"]["contaminated"] == 0

    bad = CliRunner().invoke(app, ["probe", "--base-url", http.base_url, "--model", "nope"])
    assert bad.exit_code == 2 and "404" in bad.output


def test_kvlab_serve_command() -> None:
    """The real `kvlab serve` process: starts, serves, refuses an unknown strategy."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvlab.cli import main; main()", "serve", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None:
            assert time.monotonic() < deadline and proc.poll() is None, "kvlab serve did not start"
            m = re.search(r"serving mini on (http://\S+)", proc.stderr.readline())
            url = m and m.group(1)
        import urllib.request

        body = json.dumps({"model": "mini", "prompt": "hi", "max_tokens": 3}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()
    bad = subprocess.run(
        [sys.executable, "-c", "from kvlab.cli import main; main()", "serve", "--unsafe-strategy", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown strategy 'nope'" in bad.stderr


def test_timing_runs_hit_the_cache_only_without_salts(http) -> None:
    import random

    from kvlab.probe.probe import Client
    from kvlab.probe.timing import auc, timing_run

    client, rng, trials, chars = Client(http.base_url, "mini"), random.Random(1), 4, 200
    before = http.metrics()["prefix_cache_hits"]
    plain = timing_run(client, rng, False, trials, chars)
    mid = http.metrics()["prefix_cache_hits"]
    salted = timing_run(client, rng, True, trials, chars)
    after = http.metrics()["prefix_cache_hits"]
    assert len(plain.hit_ttft) == len(plain.miss_ttft) == len(salted.hit_ttft) == trials
    # Unsalted, each "hit" request finds its whole shared prefix; salted, at most a chance first word or so.
    assert mid - before >= trials * chars
    assert after - mid < trials * 20
    assert 0.0 <= plain.auc <= 1.0 and 0.0 <= salted.auc <= 1.0
    assert auc([1.0, 2.0], [3.0, 4.0]) == 1.0 and auc([3.0], [1.0]) == 0.0 and auc([1.0], [1.0]) == 0.5
