"""The streaming client of ``kvlab bench serve``: every request of a round a streaming ``POST /v1/completions``
sent at its turn by the schedule, at most ``max_concurrency`` in flight, each read chunk by chunk on the client's
clock into a ``serve_results.RequestResult``.

A request fails alone: an HTTP status other than 200, an error event inside the stream, a stream without any
text, a broken connection or the ``timeout`` (a total per request) each end that request with its message,
which names the URL actually requested; the others go on and are measured.

"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlab.bench.serve_results import RequestResult, ServeRound
from kvlab.openai_http import answered, auth_headers, cached_tokens_of, error_event, excerpt, server_root, usage_int

if TYPE_CHECKING:
    import httpx


def request_body(model: str, prompt: list[int] | str, max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


@dataclass
class _Stream:
    """What one request has seen so far (mutable while it streams; frozen into a RequestResult at the end)."""

    text: str = ""
    chunks: int = 0
    token_times: list[float] = field(default_factory=list)  # when each chunk carrying text arrived
    # The last "usage" and "timings" (llama.cpp's, with cache_n) any event carried: what the readers read.
    report: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    end: float | None = None  # when the last event was read (before the connection is released)
    other: str | None = None  # the first line that is not a server-sent event (a server ignoring "stream")


def _read_event(payload: str, state: _Stream, url: str) -> bool:
    """Fold one ``data:`` payload into ``state``; False when the stream is over (``[DONE]`` or an error)."""
    if payload == "[DONE]":
        return False
    try:
        data = json.loads(payload)
    except ValueError:
        state.error = f"POST {url} streamed an event that is not JSON: {excerpt(payload)!r}"
        return False
    if not isinstance(data, dict):
        state.error = f"POST {url} streamed JSON that is not an object: {excerpt(payload)}"
        return False
    if (error := error_event(data)) is not None:  # an error event inside a 200 stream (kvlab, vLLM)
        state.error = f"POST {url} streamed an error event: {error}"
        return False
    text = "".join(str(c.get("text") or "") for c in data.get("choices") or [] if isinstance(c, dict))
    if text:
        state.token_times.append(time.perf_counter())
        state.text += text
        state.chunks += 1
    state.report.update((k, data[k]) for k in ("usage", "timings") if isinstance(data.get(k), dict))
    return True


async def _one_request(
    client: httpx.AsyncClient,
    url: str,
    index: int,
    body: dict[str, Any],
    prompt_tokens_sent: int,
    t0: float,
    arrived: float,
    timeout: float,
) -> RequestResult:
    state = _Stream()
    status: int | None = None
    start = time.perf_counter()

    async def stream() -> None:
        nonlocal status, url
        async with client.stream("POST", url, json=body) as resp:
            status, url = resp.status_code, str(resp.request.url)
            if status != 200:
                state.error = answered("POST", url, status, (await resp.aread()).decode("utf-8", errors="replace"))
                return
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    if not _read_event(line[5:].strip(), state, url):
                        break
                elif line.strip() and state.other is None and not line.startswith((":", "event:", "id:", "retry:")):
                    state.other = excerpt(line.strip())
            state.end = time.perf_counter()

    try:
        async with asyncio.timeout(timeout):
            await stream()
    except TimeoutError:
        state.error = f"POST {url}: no complete answer within {timeout:g} s"
    except Exception as exc:  # httpx's errors, and anything else: it fails this request, never the round
        state.error = f"POST {url}: {type(exc).__name__}: {exc}"
    end = state.end if state.end is not None else time.perf_counter()
    if state.error is None and not state.token_times:
        seen = f"; it sent {state.other!r}" if state.other else ""
        state.error = f"POST {url} answered {status} but streamed no text (TTFT undefined){seen}"
    completion_tokens = usage_int(state.report, "completion_tokens")
    return RequestResult(
        index=index,
        url=url,
        ok=state.error is None,
        status=status,
        error=state.error,
        text=state.text,
        output_tokens=state.chunks if completion_tokens is None else completion_tokens,
        tokens_from="chunks" if completion_tokens is None else "usage",
        content_chunks=state.chunks,
        prompt_tokens_sent=prompt_tokens_sent,
        prompt_tokens=usage_int(state.report, "prompt_tokens"),
        cached_tokens=cached_tokens_of(state.report),
        arrival=arrived - t0,
        start=start - t0,
        token_times=tuple(t - t0 for t in state.token_times),
        end=end - t0,
    )


async def _round(
    url: str,
    bodies: Sequence[dict[str, Any]],
    prompt_tokens: Sequence[int],
    indices: Sequence[int],
    arrivals: Sequence[float],
    max_concurrency: int | None,
    timeout: float,
    api_key: str | None,
) -> ServeRound:
    import httpx

    n = len(bodies)
    # One connection per request that may be in flight, so none waits for another's connection (httpx's default
    # pool stops at 100). Redirects are failures, never followed.
    pool = max(1, min(n, max_concurrency or n))
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    slots: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    )
    async with httpx.AsyncClient(
        headers=auth_headers(api_key), timeout=httpx.Timeout(timeout), limits=limits, follow_redirects=False
    ) as client:
        t0 = time.perf_counter()

        async def send(k: int) -> RequestResult:
            # Its turn by the schedule, on the clock every result is read on (a sleep may wake a hair early).
            while (wait := t0 + arrivals[k] - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            arrived = time.perf_counter()
            async with slots:
                return await _one_request(client, url, indices[k], bodies[k], prompt_tokens[k], t0, arrived, timeout)

        results = await asyncio.gather(*(send(k) for k in range(n)))
    return ServeRound(tuple(results))


@dataclass(frozen=True)
class RoundSender:
    """How every request of a run is sent (streaming completions, each at its turn, at most ``max_concurrency``
    in flight): where, for which model, with which options."""

    base_url: str  # the server's root, or its /v1 URL
    model: str
    max_tokens: int = 32
    ignore_eos: bool = True
    timeout: float = 600.0  # seconds per request, in total
    api_key: str | None = None
    max_concurrency: int | None = None  # requests in flight at most (None: no limit)

    @property
    def url(self) -> str:
        return server_root(self.base_url) + "/v1/completions"

    def run_round(
        self,
        prompts: Sequence[list[int] | str],
        prompt_tokens: Sequence[int],
        arrivals: Sequence[float] | None = None,
        indices: Sequence[int] | None = None,
    ) -> ServeRound:
        """Send every prompt as a streaming completion at its arrival time (seconds from the round's start;
        default: all at once); wait for all of them, failed or not. ``prompt_tokens``: each prompt's length in
        the workload's tokens (reported beside the server's count); ``indices``: each prompt's position in its
        workload (default: its position here)."""
        n = len(prompts)
        bodies = [request_body(self.model, p, self.max_tokens, self.ignore_eos) for p in prompts]
        times = [0.0] * n if arrivals is None else list(arrivals)
        where = list(range(n)) if indices is None else list(indices)
        if not len(prompt_tokens) == len(times) == len(where) == n:
            raise ValueError("prompts, prompt_tokens, arrivals and indices must have one entry per request")
        return asyncio.run(
            _round(self.url, bodies, prompt_tokens, where, times, self.max_concurrency, self.timeout, self.api_key)
        )
