"""A slow or failing server must not end a probe with its first slow answer (issue: ``transformers serve
--continuous-batching`` ended a run after 134 requests with a ReadTimeout). A flaky proxy in front of a
stand-in stalls some requests past the timeout and answers 503 to others: the probe retries them, counts
it, drops what still fails and draws each verdict from what it measured."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from kvlab.experiment.passphrases import default_passphrases
from kvlab.probe.client import GaveUp, HTTPStatusError, ProbeClient
from kvlab.probe.probe import ProbeReport, run_probe
from kvlab.probe.progress import PhaseProgress

FAST: dict[str, Any] = dict(concurrency=4, rounds=2, reuse_trials=1, determinism_repeats=1, calibration_prompts=4)


@dataclass
class Flakiness:
    stall_every: int = 0  # the n-th POST (from 1) waits ``stall`` seconds before it is passed on, n % stall_every == 0
    stall: float = 0.0
    fail_every: int = 0  # the n-th POST is answered 503, n % fail_every == 0
    retry_after: str | None = None  # the 503's Retry-After header
    refuse_overlap: bool = False  # 503 to any POST that arrives while another one is in flight
    status: int = 503


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
                failing = (f.refuse_overlap and self.in_flight > 1) or (f.fail_every and n % f.fail_every == 0)
                if failing:
                    self.failed += 1
                    headers = [(b"content-type", b"application/json")]
                    if f.retry_after is not None:
                        headers.append((b"retry-after", f.retry_after.encode()))
                    await self.reply(send, f.status, b'{"error": "overloaded"}', headers)
                    return
                if f.stall_every and n % f.stall_every == 0:
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
    doc = r.to_json()
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
