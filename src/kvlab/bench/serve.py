"""``kvlab bench serve``: the shared-prefix workload of ``kvlab bench throughput`` against any OpenAI-compatible
server, measured from the client as ``vllm bench serve`` measures it.

W<N> (``kvlab.bench.throughput.shared_prefix_prompts``) is sent as N concurrent streaming ``POST
/v1/completions`` requests, all at once: greedy (``temperature: 0``), ``max_tokens`` each, EOS ignored
(``ignore_eos``, which vLLM, llama.cpp's server and kvlab's accept), ``stream_options.include_usage`` so the
last chunk carries the token count. The prompt is the token-id list by default, so every server sees exactly
the same tokens; ``prompt_format="text"`` sends the decoded text for servers that refuse token lists.

Per request, on the client's clock (``time.perf_counter``), from just before the request is sent:

- TTFT: until the first chunk that carries text;
- E2E: until the stream ended;
- TPOT: (E2E - TTFT) / (output tokens - 1), undefined for a single token;
- output tokens: ``usage.completion_tokens`` of the final chunk; a server that sends no usage gets its
  content chunks counted instead, which undercounts whenever a chunk carries more than one token (the result
  says which way every request was counted).

Per round: wall time from the first send to the last end (failed requests included), output tokens per
second and completed requests per second over it, and TTFT/TPOT/E2E p50 and p99 over the requests that
succeeded. Percentiles are nearest-rank (``kvlab.bench.sweep.percentile``: the smallest observed value with
at least q% of the values at or below it, so p99 of fewer than 100 requests is the slowest one); vLLM's
``bench serve`` interpolates linearly instead, so its p99 of a small workload is a little lower.

A request fails alone: an HTTP status other than 200, an error event inside the stream, a stream without any
text, a broken connection or the ``timeout`` (a total per request) each end that request with its message,
which names the URL actually requested; the others go on and are measured.

With ``repeats``, the round with the best wall time counts (noise only ever adds time). Every round goes to
the same server, so from the second round on its prefix cache may already hold every prompt: the
per-request ``cached_tokens`` (when the server reports them: ``usage.prompt_tokens_details`` or llama.cpp's
``timings.cache_n``, read by ``kvlab.openai_http``) show how much each round reused.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvlab.bench.sweep import percentile
from kvlab.openai_http import (
    ModelDiscoveryError,
    answered,
    auth_headers,
    cached_tokens_of,
    discover_model,
    error_event,
    excerpt,
    server_root,
    usage_int,
)

if TYPE_CHECKING:
    import httpx

    from kvlab.model.loader import LoadedModel

PromptFormat = Literal["token-ids", "text"]
PROMPT_FORMATS: tuple[str, ...] = ("token-ids", "text")
PERCENTILE_METHOD = "nearest-rank"


class ServeBenchError(RuntimeError):
    """The benchmark cannot start (the server names no model, say); the message names the URL asked."""


@dataclass(frozen=True)
class Workload:
    """W<N>: its prompts as token ids, and as text for servers that take only text."""

    name: str
    token_ids: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]

    def prompts(self, prompt_format: PromptFormat) -> list[list[int] | str]:
        if prompt_format == "text":
            return list(self.texts)
        return [list(p) for p in self.token_ids]


def decode_prompt(loaded: LoadedModel, ids: Sequence[int]) -> str:
    """The text of a prompt, special tokens (chat markers) kept so the server tokenises the same prompt back."""
    from kvlab.tokenizer import HFTokenizer

    tok = loaded.tokenizer
    if isinstance(tok, HFTokenizer):
        return tok.decode(ids, skip_special_tokens=False)
    return tok.decode(ids)


def serve_workload(loaded: LoadedModel, n: int) -> Workload:
    """W<n> of ``kvlab bench throughput``, the same prompts token for token."""
    from kvlab.bench.throughput import shared_prefix_prompts

    prompts = shared_prefix_prompts(loaded, n)
    return Workload(f"W{n}", tuple(tuple(p) for p in prompts), tuple(decode_prompt(loaded, p) for p in prompts))


@dataclass(frozen=True)
class RequestResult:
    """One streamed request. Times are seconds on the client's clock, counted from the start of its round."""

    index: int  # position of the prompt in the workload
    url: str  # the URL actually requested
    ok: bool
    status: int | None  # HTTP status of the answer (None: no answer)
    error: str | None  # why it failed: status and body excerpt, an error event, a broken connection, a timeout
    text: str  # the streamed text, every choice's text concatenated in arrival order
    output_tokens: int  # usage.completion_tokens, or the content chunks when the server sent no usage
    tokens_from: Literal["usage", "chunks"]
    content_chunks: int  # chunks that carried text
    prompt_tokens_sent: int  # tokens of the workload's prompt (the token-id list, or what the text came from)
    prompt_tokens: int | None  # usage.prompt_tokens, as the server counted them
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, or llama.cpp's timings.cache_n
    start: float
    first_token: float | None  # when the first chunk carrying text arrived
    end: float

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "url": self.url,
            "ok": self.ok,
            "status": self.status,
            "error": self.error,
            "text": self.text,
            "output_tokens": self.output_tokens,
            "output_tokens_from": self.tokens_from,
            "content_chunks": self.content_chunks,
            "prompt_tokens_sent": self.prompt_tokens_sent,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "start_s": self.start,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
        }


@dataclass(frozen=True)
class Percentiles:
    """p50 and p99 (nearest-rank) of one latency over the requests that have it; None when none has."""

    p50: float | None
    p99: float | None
    count: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Percentiles:
        vals = [v for v in values if v is not None]
        if not vals:
            return cls(None, None, 0)
        return cls(percentile(vals, 50), percentile(vals, 99), len(vals))

    def as_dict(self) -> dict[str, Any]:
        return {"p50": self.p50, "p99": self.p99, "count": self.count}


@dataclass(frozen=True)
class ServeRound:
    """One round: every prompt of the workload sent at once."""

    requests: tuple[RequestResult, ...]

    @property
    def wall(self) -> float:
        """From the first send to the last end, failed requests included."""
        if not self.requests:
            return 0.0
        return max(r.end for r in self.requests) - min(r.start for r in self.requests)

    @property
    def succeeded(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.requests if r.ok)

    @property
    def failed(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.requests if not r.ok)


@dataclass(frozen=True)
class ServeBenchResult:
    """One workload against one server: the best of ``repeats`` rounds, every figure derived from it."""

    workload: str
    url: str  # the completions URL
    served_model: str
    prompt_format: PromptFormat
    max_tokens: int
    ignore_eos: bool
    repeats: int
    round_walls: tuple[float, ...]  # wall seconds of every round, in order
    best_round: int  # index into round_walls of the round reported
    requests: tuple[RequestResult, ...]  # of the round reported, in prompt order
    # None with one round; else whether every round gave every prompt the same text (when all succeeded)
    outputs_identical_across_repeats: bool | None

    @property
    def measured(self) -> ServeRound:
        return ServeRound(self.requests)

    @property
    def wall_seconds(self) -> float:
        return self.measured.wall

    @property
    def completed(self) -> int:
        return len(self.measured.succeeded)

    @property
    def failed(self) -> int:
        return len(self.measured.failed)

    @property
    def first_error(self) -> str | None:
        """The error of the failed request that ended first (its message names the URL and status)."""
        failed = sorted(self.measured.failed, key=lambda r: r.end)
        return failed[0].error if failed else None

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.measured.succeeded)

    @property
    def output_tokens_from(self) -> Literal["usage", "chunks", "mixed", "none"]:
        sources = {r.tokens_from for r in self.measured.succeeded}
        if not sources:
            return "none"
        return "mixed" if len(sources) > 1 else next(iter(sources))

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.completed / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def ttft(self) -> Percentiles:
        return Percentiles.of([r.ttft for r in self.measured.succeeded])

    @property
    def tpot(self) -> Percentiles:
        return Percentiles.of([r.tpot for r in self.measured.succeeded])

    @property
    def e2e(self) -> Percentiles:
        return Percentiles.of([r.e2e for r in self.measured.succeeded])

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server says it served from its cache, summed; None when it reports none."""
        vals = [r.cached_tokens for r in self.measured.succeeded if r.cached_tokens is not None]
        return sum(vals) if vals else None

    @property
    def texts(self) -> tuple[str | None, ...]:
        """Each prompt's streamed text (None where the request failed), in prompt order."""
        return tuple(r.text if r.ok else None for r in self.requests)

    @property
    def token_counts(self) -> tuple[int | None, ...]:
        return tuple(r.output_tokens if r.ok else None for r in self.requests)

    @property
    def prompt_token_mismatches(self) -> int:
        """Successful requests whose prompt the server counted at another length than the workload's: the
        server saw another prompt (text that does not round-trip through the tokenizer, a BOS added)."""
        return sum(
            r.prompt_tokens is not None and r.prompt_tokens != r.prompt_tokens_sent for r in self.measured.succeeded
        )

    @property
    def notes(self) -> tuple[str, ...]:
        """What makes the figures mean less than they seem, said in words."""
        notes = []
        if self.output_tokens_from in ("chunks", "mixed"):
            n = sum(r.tokens_from == "chunks" for r in self.measured.succeeded)
            notes.append(
                f"{n} of {self.completed} successful requests got no usage chunk from the server: their output "
                "tokens are counted as content chunks, which undercounts when a chunk carries several tokens"
            )
        if mismatches := self.prompt_token_mismatches:
            ok = self.measured.succeeded
            sent = sum(r.prompt_tokens_sent for r in ok)
            counted = sum(r.prompt_tokens or 0 for r in ok)
            notes.append(
                f"the server counted other prompt lengths than the workload's in {mismatches} of {len(ok)} "
                f"requests ({counted} tokens vs {sent}): it did not see the workload's prompts"
                + (
                    " (their text does not round-trip through the server's tokenizer)"
                    if self.prompt_format == "text"
                    else ""
                )
            )
        return tuple(notes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "url": self.url,
            "served_model": self.served_model,
            "prompt_format": self.prompt_format,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "num_requests": len(self.requests),
            "completed": self.completed,
            "failed": self.failed,
            "first_error": self.first_error,
            "repeats": self.repeats,
            "round_wall_seconds": list(self.round_walls),
            "best_round": self.best_round,
            "wall_seconds": self.wall_seconds,
            "output_tokens": self.output_tokens,
            "output_tokens_from": self.output_tokens_from,
            "notes": list(self.notes),
            "prompt_token_mismatches": self.prompt_token_mismatches,
            "output_tokens_per_second": self.output_tokens_per_second,
            "requests_per_second": self.requests_per_second,
            "percentile_method": PERCENTILE_METHOD,
            "ttft_s": self.ttft.as_dict(),
            "tpot_s": self.tpot.as_dict(),
            "e2e_s": self.e2e.as_dict(),
            "prompt_tokens_sent": sum(r.prompt_tokens_sent for r in self.requests),
            "cached_tokens": self.cached_tokens,
            "outputs_identical_across_repeats": self.outputs_identical_across_repeats,
            "requests": [r.as_dict() for r in self.requests],
        }


@dataclass(frozen=True)
class ServeBench:
    """Every workload of one run, and the warm-up round before them (None without one)."""

    base_url: str
    served_model: str
    warmup: ServeRound | None
    results: tuple[ServeBenchResult, ...]

    @property
    def failed(self) -> int:
        return sum(r.failed for r in self.results)

    def as_dict(self) -> dict[str, Any]:
        warm = None
        if self.warmup is not None:
            failed = self.warmup.failed
            warm = {
                "requests": len(self.warmup.requests),
                "failed": len(failed),
                "first_error": failed[0].error if failed else None,
                "wall_seconds": self.warmup.wall,
            }
        return {
            "base_url": self.base_url,
            "served_model": self.served_model,
            "warmup": warm,
            "workloads": [r.as_dict() for r in self.results],
        }


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
    first_token: float | None = None
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
        if state.first_token is None:
            state.first_token = time.perf_counter()
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
    if state.error is None and state.first_token is None:
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
        start=start - t0,
        first_token=None if state.first_token is None else state.first_token - t0,
        end=end - t0,
    )


async def _round(
    url: str,
    bodies: Sequence[dict[str, Any]],
    prompt_tokens: Sequence[int],
    timeout: float,
    api_key: str | None,
) -> ServeRound:
    import httpx

    n = len(bodies)
    # One connection per request in flight: the pool holds as many as there are requests, so none waits for
    # another's connection (httpx's default pool stops at 100). Redirects are failures, never followed.
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        headers=auth_headers(api_key), timeout=httpx.Timeout(timeout), limits=limits, follow_redirects=False
    ) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(_one_request(client, url, i, b, prompt_tokens[i], t0, timeout) for i, b in enumerate(bodies))
        )
    return ServeRound(tuple(results))


@dataclass(frozen=True)
class RoundSender:
    """How every request of a run is sent (a round of streaming completions at once): where, for which model,
    with which options."""

    base_url: str  # the server's root, or its /v1 URL
    model: str
    max_tokens: int = 32
    ignore_eos: bool = True
    timeout: float = 600.0  # seconds per request, in total
    api_key: str | None = None

    @property
    def url(self) -> str:
        return server_root(self.base_url) + "/v1/completions"

    def run_round(self, prompts: Sequence[list[int] | str], prompt_tokens: Sequence[int]) -> ServeRound:
        """Send every prompt at once as a streaming completion; wait for all of them, failed or not.
        ``prompt_tokens``: each prompt's length in the workload's tokens (reported beside the server's count)."""
        bodies = [request_body(self.model, p, self.max_tokens, self.ignore_eos) for p in prompts]
        return asyncio.run(_round(self.url, bodies, prompt_tokens, self.timeout, self.api_key))


def bench_workload(
    sender: RoundSender, workload: Workload, prompt_format: PromptFormat = "token-ids", repeats: int = 1
) -> ServeBenchResult:
    """``repeats`` rounds of one workload; the one with the best wall time is reported."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    prompts = workload.prompts(prompt_format)
    counts = [len(p) for p in workload.token_ids]
    rounds = [sender.run_round(prompts, counts) for _ in range(repeats)]
    walls = tuple(r.wall for r in rounds)
    best = min(range(len(rounds)), key=lambda i: walls[i])
    identical: bool | None = None
    if repeats > 1:
        texts = [tuple(r.text if r.ok else None for r in rnd.requests) for rnd in rounds]
        identical = all(t == texts[0] for t in texts) and None not in texts[0]
    return ServeBenchResult(
        workload=workload.name,
        url=sender.url,
        served_model=sender.model,
        prompt_format=prompt_format,
        max_tokens=sender.max_tokens,
        ignore_eos=sender.ignore_eos,
        repeats=repeats,
        round_walls=walls,
        best_round=best,
        requests=rounds[best].requests,
        outputs_identical_across_repeats=identical,
    )


def bench_serve(
    base_url: str,
    workloads: Sequence[Workload],
    max_tokens: int = 32,
    *,
    served_model: str | None = None,
    prompt_format: PromptFormat = "token-ids",
    ignore_eos: bool = True,
    timeout: float = 600.0,
    repeats: int = 1,
    warmup: bool = True,
    api_key: str | None = None,
) -> ServeBench:
    """Every workload in turn against the server at ``base_url`` (with or without ``/v1``). The served model
    defaults to the first id of ``GET /v1/models``. The warm-up sends the first workload's first two prompts
    once, unmeasured; its failures are reported, not raised (the measured rounds show them again)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    try:
        model = served_model or discover_model(base_url, api_key, timeout=min(timeout, 30.0), instead="--served-model")
    except ModelDiscoveryError as exc:
        raise ServeBenchError(str(exc)) from exc
    sender = RoundSender(base_url, model, max_tokens, ignore_eos, timeout, api_key)
    warm = None
    if warmup and workloads:
        first = workloads[0]
        warm = sender.run_round(first.prompts(prompt_format)[:2], [len(p) for p in first.token_ids[:2]])
    results = tuple(bench_workload(sender, w, prompt_format, repeats) for w in workloads)
    return ServeBench(server_root(base_url), model, warm, results)
