"""``kvlab bench serve``: the client-side serving benchmark, against kvlab's own server on the mini model and
against stand-ins that fail a request or send no usage chunk. Real values are asserted (token counts, texts,
the order of timestamps, the URL and status of a failure), never speed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from kvlab import LLM, SamplingParams
from kvlab.bench.serve import ServeBenchError, Workload, arrival_schedule, bench_serve, prompt_indices, serve_workload
from kvlab.bench.serve_results import RequestResult, ServeBenchResult, max_in_flight
from kvlab.cli import app
from kvlab.openai_http import server_root
from oracle_cache import mini
from probe.conftest import Behaviour, StandIn
from server.conftest import server as kvlab_server  # noqa: F401  (the fixture: kvlab's server on mini, module-wide)

MAX_TOKENS = 5


def offline_texts(prompts: list[list[int]], max_tokens: int) -> tuple[list[str], list[int]]:
    """What kvlab's LLM gives on the same token prompts, greedy with EOS ignored, as the bench asks a server."""
    llm = LLM(mini())
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.text for o in outs], [len(o.token_ids) for o in outs]


# --------------------------------------------------------------------------------------------------------------
# kvlab's own server


def test_w4_against_kvlab_server_matches_offline_generate(kvlab_server) -> None:  # noqa: F811
    workload = serve_workload(mini(), 4)
    base = kvlab_server.base_url
    bench = bench_serve(base + "/v1/", [workload], MAX_TOKENS)  # with /v1 and a trailing slash: the same server
    assert bench.served_model == mini().name  # discovered through GET /v1/models
    assert bench.warmup is not None and len(bench.warmup.requests) == 2 and not bench.warmup.failed
    (r,) = bench.results
    assert r.url == f"{base}/v1/completions"
    assert (r.completed, r.failed, r.first_error) == (4, 0, None)
    assert r.output_tokens == 4 * MAX_TOKENS and r.output_tokens_from == "usage" and r.notes == ()
    for req in r.requests:
        assert req.ok and req.status == 200 and req.url == f"{base}/v1/completions"
        assert req.output_tokens == MAX_TOKENS
        assert req.prompt_tokens == req.prompt_tokens_sent == len(workload.token_ids[req.index])
        assert req.ttft is not None and req.tpot is not None
        assert 0 < req.ttft <= req.e2e
        assert req.tpot == pytest.approx((req.e2e - req.ttft) / (MAX_TOKENS - 1))
        # The warm-up cached the 100-token shared prefix: at least its 6 whole blocks of 16 are reused.
        assert req.cached_tokens is not None and req.cached_tokens >= 96
    assert r.wall_seconds == max(q.end for q in r.requests) - min(q.start for q in r.requests)
    assert r.output_tokens_per_second == pytest.approx(20 / r.wall_seconds)
    assert r.requests_per_second == pytest.approx(4 / r.wall_seconds)
    e2es = sorted(q.e2e for q in r.requests)
    # numpy's percentiles, as vLLM's: the median of 4 is the mean of the middle two, p99 lies between the top two
    assert r.e2e.median == pytest.approx((e2es[1] + e2es[2]) / 2) and r.e2e.count == 4
    assert r.e2e.p99 == pytest.approx(e2es[2] + 0.97 * (e2es[3] - e2es[2]))
    assert r.max_concurrent_requests == 4  # all at once, no limit: every stream overlapped every other
    assert r.arrivals == (0.0,) * 4 and all(q.start >= q.arrival for q in r.requests)
    # One gap per text chunk after the first (the mini model's bytes may hold text back to a later chunk).
    assert r.itl.count == sum(q.content_chunks - 1 for q in r.requests) == sum(len(q.itl) for q in r.requests)
    texts, counts = offline_texts([list(p) for p in workload.token_ids], MAX_TOKENS)
    assert list(r.texts) == texts  # exact: same engine, same weights, greedy
    assert list(r.token_counts) == counts == [MAX_TOKENS] * 4


def test_repeats_report_the_best_round_and_compare_outputs(kvlab_server) -> None:  # noqa: F811
    workload = serve_workload(mini(), 2)
    bench = bench_serve(kvlab_server.base_url, [workload], 3, repeats=2, warmup=False, served_model=mini().name)
    (r,) = bench.results
    assert bench.warmup is None
    assert len(r.round_walls) == 2 and r.wall_seconds == min(r.round_walls) == r.round_walls[r.best_round]
    assert r.outputs_identical_across_repeats is True
    assert r.output_tokens == 6


def test_text_prompts_that_do_not_round_trip_are_flagged(kvlab_server) -> None:  # noqa: F811
    # The mini workload is random bytes: as text, invalid UTF-8 becomes U+FFFD (3 bytes) and the server's
    # byte tokenizer counts a longer prompt than the workload's. The bench says so instead of hiding it.
    workload = serve_workload(mini(), 2)
    bench = bench_serve(kvlab_server.base_url, [workload], 2, prompt_format="text", warmup=False)
    (r,) = bench.results
    assert r.failed == 0 and r.prompt_token_mismatches == 2
    for q in r.requests:
        assert q.prompt_tokens == len(workload.texts[q.index].encode()) > q.prompt_tokens_sent
    (note,) = r.notes
    assert note.startswith("the server counted other prompt lengths than the workload's in 2 of 2 requests")


# --------------------------------------------------------------------------------------------------------------
# Stand-ins: probe's StandIn (free port, uvicorn thread) serving a streaming app of this file


@dataclass
class Script:
    """What the stand-in does: which prompts fail and how, whether it sends the usage chunk."""

    fail_status: dict[str, int] = field(default_factory=dict)  # json(prompt) -> HTTP status
    fail_event: set[str] = field(default_factory=set)  # json(prompt): one text chunk, then an error event
    plain: set[str] = field(default_factory=set)  # json(prompt): a whole JSON answer, "stream" ignored
    usage: bool = True  # False: two tokens per chunk and no usage chunk, whatever the client asks
    # llama.cpp's final chunk: usage without prompt_tokens_details, and timings whose cache_n counts the cached
    # prompt tokens (here: all but the last of a prompt seen before, none of a new one).
    llama_cpp: bool = False
    chunk_delay: float = 0.001  # seconds before each text chunk
    # Every request waits (up to 30 s) until this many are in flight at once, so a limit that holds can be told
    # from a run where the requests happened not to overlap; 0: no wait.
    gate: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    # Requests in flight at the stand-in, from the request read to the last event before [DONE] (so a client
    # that sends its next request only after [DONE] can never be counted twice), and the most at once.
    in_flight: int = 0
    max_in_flight: int = 0
    opened: asyncio.Event | None = None  # made in the server's event loop, on the first request


def streaming_app(script: Script) -> FastAPI:
    api = FastAPI()

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "toy", "object": "model"}]}

    def leave() -> None:
        script.in_flight -= 1

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        key, n = json.dumps(body["prompt"]), int(body["max_tokens"])
        seen = any(json.dumps(b["prompt"]) == key for b in script.bodies)
        script.bodies.append(body)
        script.in_flight += 1
        script.max_in_flight = max(script.max_in_flight, script.in_flight)
        if script.opened is None:
            script.opened = asyncio.Event()
        if script.in_flight >= script.gate:
            script.opened.set()
        if script.gate:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(script.opened.wait(), 30)
        if key in script.fail_status:
            leave()
            status = script.fail_status[key]
            return JSONResponse({"error": {"message": "stand-in refuses this prompt", "code": status}}, status)
        words = [f" w{k}" for k in range(n)]
        if key in script.plain:
            leave()
            return JSONResponse({"choices": [{"index": 0, "text": "".join(words), "finish_reason": "length"}]})
        per_chunk = 1 if script.usage else 2

        async def events() -> AsyncIterator[str]:
            try:
                async for event in content():
                    yield event
            finally:
                leave()
            yield "data: [DONE]\n\n"

        async def content() -> AsyncIterator[str]:
            for i in range(0, n, per_chunk):
                await asyncio.sleep(script.chunk_delay)
                choice = {"index": 0, "text": "".join(words[i : i + per_chunk]), "finish_reason": None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if key in script.fail_event:
                    yield f"data: {json.dumps({'error': {'message': 'engine down', 'code': 503}})}\n\n"
                    break
            else:
                if script.llama_cpp:
                    yield f"data: {json.dumps(llama_cpp_final(len(body['prompt']), n, seen))}\n\n"
                elif script.usage and body.get("stream_options", {}).get("include_usage"):
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": 0}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return api


def llama_cpp_final(prompt_tokens: int, completion_tokens: int, seen: bool) -> dict[str, Any]:
    """The last chunk of a llama.cpp /v1/completions stream: an empty choice, the usage, and the timings."""
    cached = prompt_tokens - 1 if seen else 0
    return {
        "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
        "object": "text_completion",
        "usage": {"completion_tokens": completion_tokens, "prompt_tokens": prompt_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "timings": {"cache_n": cached, "prompt_n": prompt_tokens - cached, "prompt_ms": 1.0,
                    "predicted_n": completion_tokens, "predicted_ms": 1.0},
    }  # fmt: skip


class StreamingStandIn(StandIn):
    """The probe tests' stand-in server, serving ``streaming_app`` instead of the probe's toy app (uvicorn loads
    ``config.app`` when the server starts)."""

    def __init__(self, script: Script) -> None:
        super().__init__(Behaviour())
        self.server.config.app = streaming_app(script)


@pytest.fixture
def stream_standin() -> Iterator[Any]:
    started: list[StandIn] = []

    def make(script: Script) -> str:
        s = StreamingStandIn(script).start()
        started.append(s)
        return s.base_url

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def w4() -> Workload:
    return serve_workload(mini(), 4)


def test_a_failed_request_is_reported_and_the_others_measured(stream_standin, w4: Workload) -> None:
    script = Script(fail_status={json.dumps(list(w4.token_ids[2])): 500})
    base = stream_standin(script)
    bench = bench_serve(base, [w4], MAX_TOKENS, warmup=False)
    (r,) = bench.results
    assert bench.served_model == "toy"
    assert (r.completed, r.failed) == (3, 1)
    failed = r.requests[2]
    assert not failed.ok and failed.status == 500 and failed.url == f"{base}/v1/completions"
    assert r.first_error == failed.error
    assert failed.error is not None
    assert failed.error.startswith(f"POST {base}/v1/completions answered 500: ")
    assert "stand-in refuses this prompt" in failed.error
    assert r.texts == (" w0 w1 w2 w3 w4", " w0 w1 w2 w3 w4", None, " w0 w1 w2 w3 w4")
    assert r.token_counts == (5, 5, None, 5)
    assert r.output_tokens == 15 and r.output_tokens_from == "usage"
    assert (r.ttft.count, r.tpot.count, r.e2e.count) == (3, 3, 3)  # the failure is in no percentile
    for req in (r.requests[i] for i in (0, 1, 3)):
        assert req.ok and req.output_tokens == 5 and req.content_chunks == 5
        assert req.ttft is not None and 0 < req.ttft <= req.e2e
    assert r.requests_per_second == pytest.approx(3 / r.wall_seconds)
    # What was sent: the workload's token ids, greedy, EOS ignored, streamed with usage.
    assert sorted(b["prompt"] for b in script.bodies) == sorted(list(p) for p in w4.token_ids)
    for b in script.bodies:
        assert b["model"] == "toy" and b["max_tokens"] == MAX_TOKENS and b["temperature"] == 0
        assert b["ignore_eos"] is True and b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert bench.as_dict()["workloads"][0]["first_error"] == failed.error


def test_without_usage_tokens_are_counted_as_chunks_and_said_so(stream_standin, w4: Workload) -> None:
    script = Script(usage=False)
    bench = bench_serve(stream_standin(script), [w4], MAX_TOKENS, warmup=False)
    (r,) = bench.results
    assert r.failed == 0
    # Two tokens per chunk, 5 tokens: 3 chunks, and 3 is what can be counted without usage.
    assert [q.output_tokens for q in r.requests] == [3] * 4
    assert all(q.tokens_from == "chunks" and q.prompt_tokens is None for q in r.requests)
    assert r.output_tokens == 12 and r.output_tokens_from == "chunks"
    (note,) = r.notes
    assert note.startswith("4 of 4 successful requests got no usage chunk")
    assert r.texts == (" w0 w1 w2 w3 w4",) * 4
    for q in r.requests:
        assert q.ttft is not None and q.tpot == pytest.approx((q.e2e - q.ttft) / 2)
    assert r.as_dict()["output_tokens_from"] == "chunks"


def test_error_event_text_prompts_and_no_ignore_eos(stream_standin, w4: Workload) -> None:
    script = Script(fail_event={json.dumps(w4.texts[1])}, plain={json.dumps(w4.texts[2])})
    base = stream_standin(script)
    bench = bench_serve(base + "/v1", [w4], MAX_TOKENS, prompt_format="text", ignore_eos=False, warmup=False)
    (r,) = bench.results
    assert (r.completed, r.failed) == (2, 2)
    bad = r.requests[1]
    assert bad.status == 200 and bad.error is not None
    assert bad.error.startswith(f"POST {base}/v1/completions streamed an error event: ") and "engine down" in bad.error
    plain = r.requests[2]
    assert plain.status == 200 and plain.error is not None
    assert plain.error.startswith(f"POST {base}/v1/completions answered 200 but streamed no text (TTFT undefined)")
    assert '"text":" w0 w1 w2 w3 w4"' in plain.error
    assert sorted(b["prompt"] for b in script.bodies) == sorted(w4.texts)
    assert all("ignore_eos" not in b for b in script.bodies)


def test_llama_cpp_cached_tokens_are_read_from_timings(stream_standin, w4: Workload) -> None:
    """llama.cpp says how much of a prompt it found cached in ``timings.cache_n`` only; the bench read
    ``usage.prompt_tokens_details`` alone and reported nothing cached."""
    bench = bench_serve(stream_standin(Script(llama_cpp=True)), [w4], MAX_TOKENS)  # the warm-up sends 2 prompts
    assert bench.warmup is not None and [q.cached_tokens for q in bench.warmup.requests] == [0, 0]
    (r,) = bench.results
    assert r.failed == 0 and r.output_tokens_from == "usage"
    lengths = [len(p) for p in w4.token_ids]
    assert [q.cached_tokens for q in r.requests] == [lengths[0] - 1, lengths[1] - 1, 0, 0]
    assert [q.prompt_tokens for q in r.requests] == lengths and r.output_tokens == 4 * MAX_TOKENS
    assert r.cached_tokens == lengths[0] + lengths[1] - 2
    assert r.as_dict()["cached_tokens"] == r.cached_tokens
    assert [q["cached_tokens"] for q in r.as_dict()["requests"]] == [lengths[0] - 1, lengths[1] - 1, 0, 0]


def test_max_concurrency_2_never_has_more_than_2_in_flight(stream_standin, w4: Workload) -> None:
    """The stand-in holds every request until two are in flight, so the limit is reached, not just respected."""
    script = Script(gate=2, chunk_delay=0.002)
    bench = bench_serve(stream_standin(script), [w4], MAX_TOKENS, warmup=False, num_prompts=8, max_concurrency=2)
    (r,) = bench.results
    assert (r.completed, r.failed, len(script.bodies)) == (8, 0, 8)
    assert script.max_in_flight == 2 and script.in_flight == 0
    assert r.max_concurrent_requests == 2 and r.max_concurrency == 2
    assert 0 < r.mean_concurrent_requests <= 2
    assert all(q.queue >= 0 for q in r.requests)
    # Without a limit every request is sent at once (the gate waits for all four).
    script = Script(gate=4)
    (r,) = bench_serve(stream_standin(script), [w4], MAX_TOKENS, warmup=False).results
    assert script.max_in_flight == 4 and r.max_concurrent_requests == 4 and r.max_concurrency is None


def test_num_prompts_sends_exactly_that_many_cycling_through_the_prompts(stream_standin, w4: Workload) -> None:
    script = Script()
    bench = bench_serve(stream_standin(script), [w4], MAX_TOKENS, warmup=False, num_prompts=10)
    (r,) = bench.results
    assert len(script.bodies) == r.num_prompts == r.completed == 10 and r.workload_prompts == 4
    assert [q.index for q in r.requests] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    # What the server got: prompt k mod 4 for request k (the order of arrival may differ: all were sent at once).
    expected = [list(w4.token_ids[k % 4]) for k in range(10)]
    assert sorted(b["prompt"] for b in script.bodies) == sorted(expected)
    assert [q.prompt_tokens_sent for q in r.requests] == [len(p) for p in expected]
    script = Script()
    (r,) = bench_serve(stream_standin(script), [w4], MAX_TOKENS, warmup=False, num_prompts=3).results
    assert len(script.bodies) == 3 and [q.index for q in r.requests] == [0, 1, 2]
    assert prompt_indices(4) == [0, 1, 2, 3] and prompt_indices(3, 7) == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        prompt_indices(3, 0)


def test_poisson_arrivals_are_seeded_and_their_mean_gap_is_one_over_the_rate() -> None:
    """A check on the drawn schedule, not on wall time."""
    rate, n = 20.0, 20_000
    a = arrival_schedule(n, rate, seed=3)
    assert a == arrival_schedule(n, rate, seed=3) and a != arrival_schedule(n, rate, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    gaps = [y - x for x, y in itertools.pairwise(a)]
    mean = sum(gaps) / len(gaps)
    # The mean of 19999 exponential gaps has a relative standard error of 1/sqrt(19999) = 0.7%: 3% is > 4 sigma.
    assert mean == pytest.approx(1 / rate, rel=0.03)
    # Exponential, not merely the right mean: P(gap > mean) = 1/e, and the standard deviation equals the mean.
    assert sum(g > 1 / rate for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert sd == pytest.approx(mean, rel=0.05)
    assert arrival_schedule(5) == (0.0,) * 5 == arrival_schedule(5, math.inf, seed=9)  # inf: all at once
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="request_rate must be > 0"):
            arrival_schedule(3, bad)


def test_a_request_rate_sends_each_request_at_its_scheduled_time(stream_standin, w4: Workload) -> None:
    script = Script()
    bench = bench_serve(
        stream_standin(script), [w4], MAX_TOKENS, warmup=False, num_prompts=6, request_rate=200.0, seed=7
    )
    (r,) = bench.results
    assert r.arrivals == arrival_schedule(6, 200.0, 7) and len(script.bodies) == 6 and r.failed == 0
    for q, at in zip(r.requests, r.arrivals, strict=True):
        assert q.arrival >= at and q.start >= q.arrival  # never before its turn; no limit, so no queue
    d = r.as_dict()
    assert (d["request_rate"], d["seed"], d["num_prompts"]) == (200.0, 7, 6)
    assert d["scheduled_arrivals_s"] == list(r.arrivals)


def scripted(index: int, start: float, tokens: tuple[float, ...], end: float, ok: bool = True) -> RequestResult:
    """A request whose timestamps are given: the figures below are computed from them alone."""
    return RequestResult(
        index=index, url="http://x/v1/completions", ok=ok, status=200 if ok else 500, error=None if ok else "no",
        text="t" * len(tokens), output_tokens=len(tokens), tokens_from="usage", content_chunks=len(tokens),
        prompt_tokens_sent=10, prompt_tokens=10, cached_tokens=None, arrival=start, start=start,
        token_times=tokens, end=end,
    )  # fmt: skip


def test_ttft_tpot_itl_and_concurrency_from_scripted_timestamps() -> None:
    reqs = (
        scripted(0, 0.0, (0.5, 0.6, 0.8, 1.1), 1.2),  # ITL 0.1, 0.2, 0.3
        scripted(1, 1.0, (1.25, 1.65), 2.0),  # ITL 0.4
        scripted(2, 2.0, (3.0,), 4.0),  # one token: no ITL, no TPOT
        scripted(3, 0.2, (), 0.3, ok=False),  # failed: in no latency, but it was in flight
    )
    r = ServeBenchResult(
        "W3", "http://x/v1/completions", "toy", "token-ids", 8, True, 1, (4.0,), 0, reqs, None, workload_prompts=3
    )
    itl = [0.1, 0.2, 0.3, 0.4]  # pooled over requests, as vLLM's ITL
    assert [g for q in reqs for g in q.itl] == pytest.approx(itl)
    assert r.itl.count == 4 and r.itl.mean == pytest.approx(0.25) and r.itl.median == pytest.approx(0.25)
    assert r.itl.p99 == pytest.approx(float(np.percentile(itl, 99))) == pytest.approx(0.397)
    assert r.itl.std == pytest.approx(float(np.std(itl)))
    ttft = [0.5, 0.25, 1.0]
    assert r.ttft.count == 3 and r.ttft.mean == pytest.approx(np.mean(ttft)) and r.ttft.median == pytest.approx(0.5)
    tpot = [(1.2 - 0.5) / 3, (2.0 - 1.25) / 1]
    assert r.tpot.count == 2 and r.tpot.mean == pytest.approx(np.mean(tpot))
    assert r.e2e.p99 == pytest.approx(float(np.percentile([1.2, 1.0, 2.0], 99)))
    # In flight: [0, 1.2), [0.2, 0.3), [1, 2), [2, 4): two at once on [0.2, 0.3) and on [1, 1.2), and [1, 2)
    # ends as [2, 4) starts (departures first), so never three.
    assert r.max_concurrent_requests == 2
    assert r.wall_seconds == 4.0 and r.mean_concurrent_requests == pytest.approx((1.2 + 1.0 + 2.0 + 0.1) / 4.0)
    assert max_in_flight([(0, 1), (1, 2), (2, 3)]) == 1 and max_in_flight([(0, 2), (1, 3), (1.5, 1.6)]) == 3
    assert r.requests_per_second == pytest.approx(3 / 4.0) and r.output_tokens_per_second == pytest.approx(7 / 4.0)
    d = r.as_dict()
    assert d["mean_itl_ms"] == pytest.approx(250.0) and d["p99_itl_ms"] == pytest.approx(397.0)
    assert d["median_ttft_ms"] == pytest.approx(500.0) and d["mean_tpot_ms"] == pytest.approx(1e3 * np.mean(tpot))
    assert (d["completed"], d["failed"], d["total_output_tokens"], d["total_input_tokens"]) == (3, 1, 7, 30)
    assert d["request_throughput"] == r.requests_per_second and d["output_throughput"] == r.output_tokens_per_second
    assert d["max_concurrent_requests"] == 2 and d["duration"] == 4.0
    assert d["samples"] == {"ttft": 3, "tpot": 2, "itl": 4, "e2el": 3}
    assert d["requests"][0]["itl_s"] == pytest.approx([0.1, 0.2, 0.3])
    assert d["percentile_method"].startswith("numpy.percentile")
    empty = ServeBenchResult("W1", "u", "toy", "token-ids", 1, True, 1, (0.0,), 0, (reqs[3],), None).as_dict()
    assert empty["mean_itl_ms"] is None and empty["p99_ttft_ms"] is None and empty["samples"]["ttft"] == 0


def test_itl_of_a_stream_is_one_gap_per_text_chunk_after_the_first(stream_standin, w4: Workload) -> None:
    bench = bench_serve(stream_standin(Script(usage=False)), [w4], MAX_TOKENS, warmup=False)
    (r,) = bench.results
    for q in r.requests:  # two tokens per chunk: 3 chunks, 2 gaps, spanning first to last chunk
        assert q.content_chunks == len(q.token_times) == 3 and len(q.itl) == 2
        assert sum(q.itl) == pytest.approx(q.token_times[-1] - q.token_times[0])
        assert q.start < q.token_times[0] and q.token_times[-1] <= q.end
    assert r.itl.count == 8


def test_the_base_url_may_carry_v1() -> None:
    assert server_root("http://h:1") == server_root("http://h:1/") == server_root("http://h:1/v1/") == "http://h:1"
    assert server_root("http://h:1/proxy/v1") == "http://h:1/proxy"


# --------------------------------------------------------------------------------------------------------------
# The command

runner = CliRunner()


def test_cli_against_kvlab_server_prints_json(kvlab_server) -> None:  # noqa: F811
    res = runner.invoke(
        app,
        ["bench", "serve", "--base-url", kvlab_server.base_url, "--model", "mini", "--requests", "2,3",
         "--max-tokens", "3", "--json", "-"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # stdout is the JSON alone; the tables went to stderr
    assert "serve: W2" in res.stderr and "serve: W3" in res.stderr
    assert data["served_model"] == mini().name and data["base_url"] == kvlab_server.base_url
    assert data["warmup"]["requests"] == 2 and data["warmup"]["failed"] == 0
    assert [w["workload"] for w in data["workloads"]] == ["W2", "W3"]
    for w, n in zip(data["workloads"], (2, 3), strict=True):
        assert (w["completed"], w["failed"], w["total_output_tokens"], w["num_prompts"]) == (n, 0, 3 * n, n)
        assert w["output_tokens_from"] == "usage" and w["percentile_method"].startswith("numpy.percentile")
        assert w["median_ttft_ms"] <= w["p99_ttft_ms"] <= w["p99_e2el_ms"]
        assert (w["request_rate"], w["max_concurrency"]) == ("inf", None)
        assert w["samples"]["itl"] == sum(q["content_chunks"] - 1 for q in w["requests"])
        for q in w["requests"]:
            assert q["ok"] and q["output_tokens"] == 3 and 0 < q["ttft_s"] <= q["e2e_s"]
    texts, _ = offline_texts([list(p) for p in serve_workload(mini(), 3).token_ids], 3)
    assert [q["text"] for q in data["workloads"][1]["requests"]] == texts


def test_cli_exits_1_on_a_failed_request_and_2_when_no_model_is_named(stream_standin, w4, tmp_path) -> None:
    base = stream_standin(Script(fail_status={json.dumps(list(w4.token_ids[0])): 503}))
    out = tmp_path / "serve.json"
    res = runner.invoke(
        app, ["bench", "serve", "--base-url", base, "--requests", "4", "--max-tokens", "2", "--json", str(out)]
    )
    assert res.exit_code == 1, res.output
    assert f"POST {base}/v1/completions answered 503" in res.output
    w = json.loads(out.read_text())["workloads"][0]
    assert (w["completed"], w["failed"]) == (3, 1) and w["requests"][0]["status"] == 503
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    res = runner.invoke(app, ["bench", "serve", "--base-url", dead, "--requests", "2"])
    assert res.exit_code == 2
    assert f"GET {dead}/v1/models did not name a model" in res.output
    with pytest.raises(ServeBenchError, match="pass --served-model"):
        bench_serve(dead, [w4], 1)


def test_cli_vllm_flags_and_save_result(stream_standin, w4, tmp_path) -> None:
    script = Script(gate=2)
    base = stream_standin(script)
    args = ["bench", "serve", "--base-url", base, "--requests", "4", "--max-tokens", "3", "--no-warmup"]
    args += ["--num-prompts", "6", "--max-concurrency", "2", "--request-rate", "500", "--seed", "3"]
    res = runner.invoke(app, [*args, "--save-result", "--result-dir", str(tmp_path / "out"), "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # the JSON alone on stdout
    (w,) = data["workloads"]
    assert (w["workload"], w["num_prompts"], w["completed"], w["max_concurrency"]) == ("W4", 6, 6, 2)
    assert (w["request_rate"], w["seed"], w["max_concurrent_requests"]) == (500.0, 3, 2)
    assert w["scheduled_arrivals_s"] == list(arrival_schedule(6, 500.0, 3))
    assert len(script.bodies) == 6 and script.max_in_flight == 2
    for key in ("mean", "median", "std", "p99"):
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert isinstance(w[f"{key}_{metric}_ms"], float)
    # --save-result: vLLM's file-name pattern with kvlab as the label, the workload flat in vLLM's layout
    (saved,) = (tmp_path / "out").iterdir()
    assert saved.name == f"kvlab-500.0qps-concurrency2-toy-{data['date']}.json"
    flat = json.loads(saved.read_text())
    assert "workloads" not in flat and flat["kvlab"]["workload"] == "W4"
    for key in ("num_prompts", "completed", "max_concurrency", "request_rate", "mean_ttft_ms", "p99_itl_ms"):
        assert flat[key] == w[key], key
    assert flat["date"] == data["date"] and f"saved {saved}" in res.stderr.replace("\n", "")
    assert "6 requests cycling through W4's 4 prompts, Poisson at 500 req/s (seed 3), at most 2 in flight" in " ".join(
        res.stderr.split()
    )
    # --result-filename, and --num-prompts alone: W<num-prompts>, each prompt once
    name = tmp_path / "named.json"
    res = runner.invoke(
        app, ["bench", "serve", "--base-url", base, "--num-prompts", "3", "--max-tokens", "2", "--no-warmup",
              "--save-result", "--result-filename", str(name)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    flat = json.loads(name.read_text())
    assert (flat["kvlab"]["workload"], flat["num_prompts"], flat["request_rate"], flat["max_concurrency"]) == (
        "W3",
        3,
        "inf",
        None,
    )
    # --compare: vLLM 0.32's own file and kvlab's, each printed beside this run's workload
    recorded = Path(__file__).with_name("vllm_bench_serve_0.32.json")
    res = runner.invoke(
        app, ["bench", "serve", "--base-url", base, "--num-prompts", "3", "--max-tokens", "2", "--no-warmup",
              "--compare", str(recorded), "--compare", str(name)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert f"compare W3 with {recorded} (written by vllm bench serve (openai))" in said
    assert f"compare W3 with {name} (written by kvlab)" in said and "different traffic" in said
    bad = runner.invoke(app, ["bench", "serve", "--base-url", base, "--request-rate", "0"])
    assert bad.exit_code == 2 and "expected requests per second > 0" in bad.output
