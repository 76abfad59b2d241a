"""A slow or failing server must not end a probe with its first slow answer (issue: ``transformers serve
--continuous-batching`` ended a run after 134 requests with a ReadTimeout). A flaky proxy in front of a
stand-in stalls some requests past the timeout and answers 503 to others: the probe retries them, counts
it, drops what still fails and draws each verdict from what it measured."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.experiment.passphrases import default_passphrases
from kvlab.probe.client import GaveUp, HTTPStatusError, ProbeClient, ProbeError
from kvlab.probe.material import default_reuse_groups
from kvlab.probe.probe import ProbeReport, render, run_probe
from kvlab.probe.progress import PhaseProgress
from kvlab.probe.schema import probe_document

FAST: dict[str, Any] = dict(
    concurrency=4, rounds=2, reuse_trials=1, determinism_repeats=1, calibration_prompts=4, timing=False
)


@dataclass
class Flakiness:
    stall_every: int = 0  # the n-th POST (from 1) waits ``stall`` seconds before it is passed on, n % stall_every == 0
    stall: float = 0.0
    fail_every: int = 0  # the n-th POST is answered 503, n % fail_every == 0
    retry_after: str | None = None  # the 503's Retry-After header
    refuse_overlap: bool = False  # 503 to any POST that arrives while another one is in flight
    status: int = 503
    # Where given, only the POSTs these say misbehave as above: those numbered in ``posts`` (from 1), and those
    # whose body's cache_salt starts with ``salt`` (the probe's references carry "probe-ref-...").
    posts: frozenset[int] | None = None
    salt: str | None = None

    def picks(self, n: int, body: bytes) -> bool:
        if self.posts is not None and n not in self.posts:
            return False
        if self.salt is not None:
            salt = json.loads(body or b"{}").get("cache_salt")
            return isinstance(salt, str) and salt.startswith(self.salt)
        return True


class FlakyProxy:
    """An ASGI proxy to ``upstream`` that misbehaves as ``Flakiness`` says, counting what it did."""

    def __init__(self, upstream: str, f: Flakiness) -> None:
        self.upstream, self.f = upstream, f
        self.posts = self.stalled = self.failed = self.in_flight = 0
        self.client: httpx.AsyncClient | None = None

    async def reply(self, send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        self.in_flight += 1
        try:
            if scope["method"] == "POST":
                self.posts += 1
                n, f = self.posts, self.f
                picked = f.picks(n, body)
                failing = (f.refuse_overlap and self.in_flight > 1) or (f.fail_every and n % f.fail_every == 0)
                failing = failing and picked
                if failing:
                    self.failed += 1
                    headers = [(b"content-type", b"application/json")]
                    if f.retry_after is not None:
                        headers.append((b"retry-after", f.retry_after.encode()))
                    await self.reply(send, f.status, b'{"error": "overloaded"}', headers)
                    return
                if f.stall_every and n % f.stall_every == 0 and picked:
                    self.stalled += 1
                    await asyncio.sleep(f.stall)  # then computed all the same, as a slow server would
            if self.client is None:
                self.client = httpx.AsyncClient(base_url=self.upstream, timeout=30)
            path = scope["path"] + (f"?{scope['query_string'].decode()}" if scope["query_string"] else "")
            keep = {b"content-type", b"authorization"}
            headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in keep}
            resp = await self.client.request(scope["method"], path, content=body, headers=headers)
            await self.reply(send, resp.status_code, resp.content, [(b"content-type", b"application/json")])
        finally:
            self.in_flight -= 1


class Served:
    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="critical", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture
def flaky(standin, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``flaky(behaviour={...}, **flakiness)``: a stand-in behind a flaky proxy; returns (its URL, the proxy).
    Retries wait 10 ms at first, not the default half second."""
    monkeypatch.setattr("kvlab.probe.client.BACKOFF", 0.01)
    started: list[Served] = []

    def make(behaviour: dict[str, Any] | None = None, **kw: Any) -> tuple[str, FlakyProxy]:
        proxy = FlakyProxy(standin(**(behaviour or {})), Flakiness(**kw))
        started.append(Served(proxy))
        return started[-1].base_url, proxy

    yield make
    for s in started:
        s.stop()


def probe(url: str, **kw: Any) -> ProbeReport:
    return run_probe(url, "toy", default_passphrases(), **{**FAST, **kw})


# ------------------------------------------------------------------------------------------------- the client
def test_a_503_is_retried_and_a_4xx_is_not(flaky) -> None:
    url, proxy = flaky(fail_every=2)  # every second POST fails: each request's retry succeeds
    events: list[PhaseProgress] = []
    with ProbeClient(url, "toy", timeout=5, retries=1) as client:
        watch = client.watch(events.append)
        watch(PhaseProgress("references", 0, None))
        for _ in range(3):
            client.completion("Say hello.", 2)
        watch(PhaseProgress("bursts", 0, None))
        client.completion("Say hello.", 2)
    assert len(events) == 2  # passed on
    refs, bursts = client.stats.phase("references"), client.stats.phase("bursts")
    assert (refs.sent, refs.retried, refs.retries, refs.gave_up) == (3, 2, 2, 0)  # POSTs 2 and 4 failed
    assert (bursts.sent, bursts.retried) == (1, 1) and proxy.failed == 3
    # A 4xx is an answer: refused at once.
    url, proxy = flaky({"reject_unknown": True})
    with ProbeClient(url, "toy", retries=3) as client, pytest.raises(HTTPStatusError) as refused:
        client.completion("Say hello.", 2, salt="s")
    assert refused.value.status == 422 and client.stats.retried == 0


def test_a_request_that_keeps_failing_gives_up_with_its_url_and_attempts(flaky) -> None:
    url, proxy = flaky(fail_every=1, retry_after="0")  # every POST fails
    with ProbeClient(url, "toy", timeout=5, retries=2) as client:
        with pytest.raises(GaveUp) as gave_up:
            client.completion("Say hello.", 2)
        assert client.try_complete("Say hello.", 2) is None  # the phases' way: dropped, counted
    exc = gave_up.value
    assert exc.attempts == 3 and exc.status == 503 and exc.url == f"{url}/v1/completions"
    assert str(exc).startswith(f"POST {url}/v1/completions gave up after 3 attempts: answered 503")
    assert proxy.failed == 6 and client.stats.gave_up == 2 and client.stats.retries == 4
    assert [d.attempts for d in client.stats.dropped] == [3, 3]


def test_a_stall_past_the_timeout_is_retried(flaky) -> None:
    url, proxy = flaky(stall_every=2, stall=2.0)
    with ProbeClient(url, "toy", timeout=0.3, retries=1) as client:
        t0 = time.perf_counter()
        client.completion("Say hello.", 2)  # POST 1
        client.completion("Say hello.", 2)  # POST 2 stalls, POST 3 answers
        took = time.perf_counter() - t0
    phase = client.stats.phase("other")
    assert proxy.stalled == 1 and phase.retried == 1 and phase.timed_out == 1 and phase.gave_up == 0
    assert took < 1.5  # the stall was not waited out


def test_retry_after_is_honoured_up_to_a_cap(flaky) -> None:
    url, _ = flaky(fail_every=2, retry_after="0.4")
    with ProbeClient(url, "toy", retries=1) as client:
        client.completion("Say hello.", 2)
        t0 = time.perf_counter()
        client.completion("Say hello.", 2)
        assert time.perf_counter() - t0 >= 0.4


# ------------------------------------------------------------------------------------------------- the probe
def test_the_probe_finishes_through_stalls_and_503s_and_reports_the_retries(flaky) -> None:
    url, proxy = flaky(stall_every=23, stall=1.5, fail_every=7)
    r = probe(url, request_timeout=0.5, retries=3)
    assert r.requests is not None
    print(f"\nflaky server: {proxy.posts} POSTs, {proxy.stalled} stalled, {proxy.failed} 503; {r.requests.summary()}")
    assert proxy.stalled > 0 and proxy.failed > 0
    assert r.requests.retried >= proxy.failed and r.requests.gave_up == 0
    assert sum(p.timed_out for p in r.requests.phases.values()) > 0
    assert {"capabilities", "references", "determinism", "bursts", "reuse"} <= set(r.requests.phases)
    # What the stand-in's behaviour warrants, as without the proxy: nothing was lost.
    v = {f.name: f.verdict for f in r.findings}
    assert v["contamination"] == "clean" and v["non-prefix reuse"] == "clean", r.findings
    assert r.verdict == "clean" and r.exit_code == 0
    doc = probe_document(r).model_dump(mode="json")
    assert doc["requests"]["retried"] == r.requests.retried and doc["requests"]["gave_up"] == 0


def test_a_server_that_refuses_concurrent_requests_leaves_contamination_inconclusive(flaky) -> None:
    """Every request that overlaps another is refused: most burst answers are dropped after their retries, so
    the bursts cannot show the server clean. The sequential phases (references, reuse) are measured."""
    url, proxy = flaky({"busy": 0.05}, refuse_overlap=True)
    r = probe(url, retries=1)
    assert r.requests is not None
    print(f"\nrefusing server: {r.requests.summary()}")
    bursts = r.requests.phase("bursts")
    assert bursts.gave_up == r.bursts.dropped > 0 and r.requests.phase("references").gave_up == 0
    assert proxy.failed == r.requests.retries + r.requests.gave_up  # each refusal was retried or given up on
    total = sum(r.bursts.counts.values())
    assert total < r.bursts.dropped  # most were lost
    contamination = r.finding("contamination")
    assert contamination.verdict == "inconclusive", contamination
    assert contamination.reason.startswith("too little was measured to call it clean")
    assert f"{r.bursts.dropped} of {total + r.bursts.dropped} answers under cross-traffic dropped" in (
        contamination.reason
    )
    assert (contamination.observed, contamination.measured) == (0, total)
    assert r.determinism.dropped > 0
    assert r.finding("non-prefix reuse").verdict == "clean"  # sequential: all measured
    assert r.verdict == "inconclusive" and r.exit_code == 0
    assert "gave up" in r.requests.summary() and "bursts:" in r.requests.summary()


# ------------------------------------------------------------------------------------- references that give up
def test_references_that_give_up_leave_contamination_inconclusive_and_the_other_phases_measured(flaky) -> None:
    """The server stalls past the timeout on every reference request (the probe's baseline answers, salted
    "probe-ref-..."), and on nothing else. The run completes: contamination, which rests on the references,
    is INCONCLUSIVE with the give-up count and the error; non-prefix reuse keeps its real verdict."""
    url, proxy = flaky(stall_every=1, stall=1.0, salt="probe-ref-")
    r = probe(url, request_timeout=0.4, retries=1, calibration_prompts=2)
    assert r.requests is not None
    shown = ("requests:", "contamination:", "non-prefix reuse:", "verdict:")
    print("\n" + "\n".join(line for line in render(r).splitlines() if line.lstrip().startswith(shown)))
    refs = r.requests.phase("references")
    planned = sum(len(g.prompts) for g in default_passphrases().groups) + 2
    assert refs.sent == refs.gave_up == planned and r.requests.gave_up == planned
    assert proxy.stalled == 2 * planned  # each reference tried twice, nothing else stalled
    assert r.bursts.unreferenced_groups == [g.name for g in default_passphrases().groups]
    assert r.requests.phase("bursts").sent == 0 and r.determinism.prompts == 0  # no reference to compare with
    contamination = r.finding("contamination")
    assert contamination.verdict == "inconclusive", contamination
    assert contamination.reason.startswith(
        f"nothing could be measured: {planned} of {planned} reference requests gave up after their retries "
        f"(POST {url}/v1/completions gave up after 2 attempts: ReadTimeout"
    )
    assert (contamination.observed, contamination.measured) == (0, 0)
    reuse = r.finding("non-prefix reuse")
    assert reuse.verdict == "clean" and reuse.measured == len(default_reuse_groups()), reuse
    assert r.verdict == "inconclusive" and not r.measured_nothing and r.exit_code == 0
    doc = probe_document(r).model_dump(mode="json")
    found = {f["id"]: f for f in doc["findings"]}
    assert found["contamination"]["verdict"] == "inconclusive" and found["contamination"]["count"]["measured"] == 0
    assert found["non_prefix_reuse"]["verdict"] == "clean"
    assert doc["requests"]["phases"]["references"]["gave_up"] == planned and doc["exit_code"] == 0
    assert {d["phase"] for d in doc["requests"]["dropped"]} == {"references"}


def test_a_run_that_measured_nothing_exits_2_and_says_so(flaky, tmp_path) -> None:
    """The same losses with nothing else to measure (no reuse groups, no cached_tokens for the salt check):
    the report is written, INCONCLUSIVE, and the exit status is 2, as for a probe that could not run."""
    url, _ = flaky(fail_every=1, retry_after="0", salt="probe-ref-")
    args = [
        "probe",
        "--base-url",
        url,
        "--model",
        "toy",
        "--no-reuse",
        "--no-timing",
        "--rounds",
        "1",
        "--retries",
        "1",
    ]
    sarif = tmp_path / "probe.sarif"
    res = CliRunner().invoke(app, [*args, "--determinism-repeats", "1", "--json", "-", "--sarif", str(sarif)])
    assert res.exit_code == 2, res.output
    data = json.loads(res.stdout)
    (invocation,) = json.loads(sarif.read_text())["runs"][0]["invocations"]
    assert invocation["exitCode"] == 2 and invocation["executionSuccessful"] is False
    assert data["verdict"] == "inconclusive" and data["exit_code"] == 2
    assert {f["id"]: f["verdict"] for f in data["findings"]}["contamination"] == "inconclusive"
    assert data["requests"]["gave_up"] == data["requests"]["phases"]["references"]["gave_up"] > 0
    r = probe(url, reuse_groups=[], retries=1)
    assert r.measured_nothing and r.exit_code == 2
    assert render(r).splitlines()[-1].startswith("  verdict: INCONCLUSIVE: nothing could be measured (")


def test_capability_requests_that_give_up_cost_only_what_they_would_have_told(flaky) -> None:
    """The probe's first request (its baseline) gives up: the salt check's answer tells the same, and the
    run is as without the loss. The salt check gives up: salts are unknown, not sent, and the salts finding is
    INCONCLUSIVE. Both give up: the server answers no completion, and the probe says nothing could be
    measured (a ProbeError: exit status 2)."""
    url, _ = flaky({"report_cached": "usage"}, fail_every=1, retry_after="0", posts=frozenset({1, 2}))
    r = probe(url, retries=1)
    assert r.requests is not None and r.requests.phase("capabilities").gave_up == 1
    assert r.capabilities.cached_tokens and r.capabilities.salt.accepted and not r.capabilities.lost
    assert r.finding("salts").verdict == "clean" and r.finding("contamination").verdict == "clean"
    # The stand-in shares its cache between clients without salts and says so in cached_tokens: exposure.
    assert r.finding("cached tokens").verdict == "exposure" and r.verdict == "exposure" and r.exit_code == 3

    url, _ = flaky({"report_cached": "usage"}, fail_every=1, retry_after="0", posts=frozenset({2, 3}))
    r = probe(url, retries=1)
    assert r.capabilities.salt.unknown and r.capabilities.cached_tokens
    salts = r.finding("salts")
    assert salts.verdict == "inconclusive" and salts.reason.endswith("(1 of its requests gave up after their retries)")
    assert r.finding("contamination").verdict == "clean" and r.finding("non-prefix reuse").verdict == "clean"
    assert r.verdict == "exposure" and r.exit_code == 3  # cached_tokens still tells, as above

    url, _ = flaky(fail_every=1, retry_after="0", posts=frozenset({1, 2, 3, 4}))
    with pytest.raises(ProbeError, match="nothing could be measured: the server answered neither"):
        probe(url, retries=1)
