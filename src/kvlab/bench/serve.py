"""``kvlab bench serve``: the shared-prefix workload of ``kvlab bench throughput`` against any OpenAI-compatible
server, measured from the client as ``vllm bench serve`` measures it.

What is sent. W<N> (``kvlab.bench.throughput.shared_prefix_prompts``) is the prompt set: N prompts sharing a
long prefix. A run sends ``num_prompts`` streaming ``POST /v1/completions`` requests (default N: each prompt
once); request k sends prompt k mod N, so more requests than prompts cycle through the set in order (each
prompt then meets its own earlier copies in the server's cache) and fewer take its first ones. Every request
is greedy (``temperature: 0``), ``max_tokens`` long, EOS ignored (``ignore_eos``, which vLLM, llama.cpp's server
and kvlab's accept), ``stream_options.include_usage`` so the last chunk carries the token count. The prompt is
the token-id list by default, so every server sees exactly the same tokens; ``prompt_format="text"`` sends the
decoded text for servers that refuse token lists.

When it is sent (vLLM's ``--request-rate`` and ``--max-concurrency``). ``request_rate`` infinite (the default)
sends every request at once; a finite rate makes the arrivals a Poisson process (``arrival_schedule``): the
first at 0, then exponential gaps of mean 1/rate drawn from ``random.Random(seed)``, so a seed gives the same
schedule on every run. (vLLM draws the gaps from numpy's global generator, starts with a gap instead of 0
and rescales the schedule so its last arrival falls at N/rate; kvlab keeps the draws as they are and reports
the schedule.) ``max_concurrency`` is a semaphore: a request whose turn came waits for a free slot, and its
client queue time (sent minus arrived) is reported apart, as vLLM's is.

Per request, on the client's clock (``time.perf_counter``), from when it was sent (after its slot):

- TTFT: until the first chunk that carries text;
- ITL: the gaps between consecutive chunks that carry text, each request's pooled over all requests (vLLM's
  inter-token latency; one token per chunk on every server measured here, and a chunk of several tokens
  counts as one gap, in vLLM too);
- E2E: until the stream ended (vLLM stops at the last chunk with choices; the difference is the usage chunk);
- TPOT: (E2E - TTFT) / (output tokens - 1), undefined for a single token;
- output tokens: ``usage.completion_tokens`` of the final chunk; a server that sends no usage gets its
  content chunks counted instead, which undercounts whenever a chunk carries more than one token (the result
  says which way every request was counted).

Per round: the duration from the first send to the last end (failed requests included), output tokens and
completed requests per second over it (vLLM's ``output_throughput`` and ``request_throughput``), the
concurrency reached (``max_concurrent_requests``: the most requests in flight at once, from sent to ended,
failed ones included, departures before arrivals at equal times as in vLLM; ``mean_concurrent_requests``: the
time average, every request's E2E summed over the duration), and the mean, median, standard deviation and
p99 of TTFT, TPOT, ITL, E2E and client queue time over the requests that succeeded, computed as vLLM computes
them (``numpy.mean``/``median``/``std``/``percentile``, whose linear interpolation makes the p99 of fewer than
100 values fall between the two slowest), reported in milliseconds under vLLM's result names
(``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``, ...), None where no request has the
value (vLLM reports 0 then).

A request fails alone: an HTTP status other than 200, an error event inside the stream, a stream without any
text, a broken connection or the ``timeout`` (a total per request) each end that request with its message,
which names the URL actually requested; the others go on and are measured.

With ``repeats``, every round follows the same schedule and the round with the shortest duration counts
(noise only ever adds time). Every round goes to the same server, so from the second round on its prefix
cache may already hold every prompt: the per-request ``cached_tokens`` (when the server reports them:
``usage.prompt_tokens_details`` or llama.cpp's ``timings.cache_n``, read by ``kvlab.openai_http``) show how much
each round reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvlab.bench.table import Column, ResultTable, result_table
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
# How the percentiles are computed, as the JSON says it: vLLM's bench serve calls numpy.percentile with its
# default method.
PERCENTILE_METHOD = "numpy.percentile, linear interpolation (as vllm bench serve)"


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


def arrival_schedule(n: int, request_rate: float = math.inf, seed: int = 0) -> tuple[float, ...]:
    """When each of ``n`` requests arrives, in seconds from the start of its round: all at 0 when
    ``request_rate`` is infinite (everything at once); else a Poisson process of ``request_rate`` requests per
    second: the first at 0, then exponential gaps of mean 1 / ``request_rate`` drawn from
    ``random.Random(seed)`` (the same seed, the same schedule)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not request_rate > 0:  # NaN too
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if math.isinf(request_rate):
        return (0.0,) * n
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for k in range(n):
        if k:
            t += rng.expovariate(request_rate)
        arrivals.append(t)
    return tuple(arrivals)


def prompt_indices(workload_size: int, num_prompts: int | None = None) -> list[int]:
    """Which of the workload's prompts each request sends: request k sends prompt k mod ``workload_size``
    (``num_prompts`` None: each prompt once, in order)."""
    if workload_size < 1:
        raise ValueError(f"a workload needs at least one prompt, got {workload_size}")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    return [k % workload_size for k in range(workload_size if num_prompts is None else num_prompts)]


def max_in_flight(intervals: Sequence[tuple[float, float]]) -> int:
    """The most ``(start, end)`` intervals open at once, each half-open (an end and a start at the same time do
    not overlap: departures first, as vLLM's sweep counts them)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, delta in events:
        now += delta
        most = max(most, now)
    return most


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

    index: int  # which of the workload's prompts it sent (request k sends prompt k mod N)
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
    arrival: float  # when its turn came by the schedule (before it waited for a --max-concurrency slot)
    start: float  # when it was sent
    token_times: tuple[float, ...]  # when each chunk carrying text arrived, in order
    end: float

    @property
    def first_token(self) -> float | None:
        """When the first chunk carrying text arrived."""
        return self.token_times[0] if self.token_times else None

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

    @property
    def itl(self) -> tuple[float, ...]:
        """The gaps between consecutive chunks that carried text (vLLM's inter-token latencies)."""
        return tuple(b - a for a, b in itertools.pairwise(self.token_times))

    @property
    def queue(self) -> float:
        """Client queue time: from its turn to its send (the wait for a --max-concurrency slot)."""
        return self.start - self.arrival

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
            "arrival_s": self.arrival,
            "start_s": self.start,
            "queue_s": self.queue,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
            "itl_s": list(self.itl),
        }


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, standard deviation and p99 of one latency in seconds, as vLLM's bench serve computes them
    (numpy; ``numpy.percentile``'s linear interpolation); all None when no value was measured."""

    mean: float | None
    median: float | None
    std: float | None
    p99: float | None
    count: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> LatencyStats:
        import numpy as np

        vals = np.array([v for v in values if v is not None], dtype=float)
        if not len(vals):
            return cls(None, None, None, None, 0)
        return cls(
            float(np.mean(vals)), float(np.median(vals)), float(np.std(vals)), float(np.percentile(vals, 99)), len(vals)
        )

    def as_vllm(self, metric: str) -> dict[str, float | None]:
        """In milliseconds, under vLLM's result names: ``mean_{metric}_ms``, ``median_``, ``std_``, ``p99_``."""

        def ms(x: float | None) -> float | None:
            return None if x is None else 1e3 * x

        return {
            f"mean_{metric}_ms": ms(self.mean),
            f"median_{metric}_ms": ms(self.median),
            f"std_{metric}_ms": ms(self.std),
            f"p99_{metric}_ms": ms(self.p99),
        }


@dataclass(frozen=True)
class ServeRound:
    """One round: every request of the run, each sent at its turn by the schedule."""

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

    @property
    def max_concurrent(self) -> int:
        """The most requests in flight at once, from sent to ended (failed ones too: they were in flight)."""
        return max_in_flight([(r.start, r.end) for r in self.requests])

    @property
    def mean_concurrent(self) -> float:
        """Requests in flight, averaged over the round's wall time: every request's E2E summed over it."""
        return sum(r.e2e for r in self.requests) / self.wall if self.wall > 0 else 0.0


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
    requests: tuple[RequestResult, ...]  # of the round reported, in the order they were scheduled
    # None with one round; else whether every round gave every request the same text (when all succeeded)
    outputs_identical_across_repeats: bool | None
    workload_prompts: int = 0  # N of W<N>: the prompt set the requests cycle through
    request_rate: float = math.inf  # requests per second (Poisson); inf: all at once
    seed: int = 0  # of the Poisson schedule
    max_concurrency: int | None = None  # the client's limit on requests in flight (None: none)
    arrivals: tuple[float, ...] = ()  # the schedule every round followed, seconds from its start

    @property
    def measured(self) -> ServeRound:
        return ServeRound(self.requests)

    @property
    def num_prompts(self) -> int:
        """Requests sent per round."""
        return len(self.requests)

    @property
    def wall_seconds(self) -> float:
        """The round's duration (vLLM's ``duration``): first send to last end."""
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
    def input_tokens(self) -> int:
        """Prompt tokens of the successful requests, as the server counted them where it said (vLLM's
        ``total_input_tokens``), else as sent."""
        ok = self.measured.succeeded
        return sum(r.prompt_tokens_sent if r.prompt_tokens is None else r.prompt_tokens for r in ok)

    @property
    def output_tokens_from(self) -> Literal["usage", "chunks", "mixed", "none"]:
        sources = {r.tokens_from for r in self.measured.succeeded}
        if not sources:
            return "none"
        return "mixed" if len(sources) > 1 else next(iter(sources))

    @property
    def output_tokens_per_second(self) -> float:
        """vLLM's ``output_throughput``."""
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def requests_per_second(self) -> float:
        """vLLM's ``request_throughput``: completed requests per second."""
        return self.completed / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def total_tokens_per_second(self) -> float:
        """vLLM's ``total_token_throughput``: prompt and output tokens per second."""
        return (self.input_tokens + self.output_tokens) / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def max_concurrent_requests(self) -> int:
        return self.measured.max_concurrent

    @property
    def mean_concurrent_requests(self) -> float:
        return self.measured.mean_concurrent

    @property
    def ttft(self) -> LatencyStats:
        return LatencyStats.of([r.ttft for r in self.measured.succeeded])

    @property
    def tpot(self) -> LatencyStats:
        return LatencyStats.of([r.tpot for r in self.measured.succeeded])

    @property
    def itl(self) -> LatencyStats:
        """Over every gap between text chunks of every successful request, pooled (vLLM's ITL)."""
        return LatencyStats.of([gap for r in self.measured.succeeded for gap in r.itl])

    @property
    def e2e(self) -> LatencyStats:
        return LatencyStats.of([r.e2e for r in self.measured.succeeded])

    @property
    def queue(self) -> LatencyStats:
        """Client queue time (waiting for a --max-concurrency slot) of the successful requests."""
        return LatencyStats.of([r.queue for r in self.measured.succeeded])

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server says it served from its cache, summed; None when it reports none."""
        vals = [r.cached_tokens for r in self.measured.succeeded if r.cached_tokens is not None]
        return sum(vals) if vals else None

    @property
    def texts(self) -> tuple[str | None, ...]:
        """Each request's streamed text (None where the request failed), in the order they were scheduled."""
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
        """vLLM's result names where vLLM has the figure (``duration``, ``completed``, ``request_throughput``,
        ``mean_ttft_ms``, ``max_concurrent_requests``, ...), kvlab's own beside them."""
        return {
            "workload": self.workload,
            "workload_prompts": self.workload_prompts,
            "url": self.url,
            "served_model": self.served_model,
            "prompt_format": self.prompt_format,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "num_prompts": self.num_prompts,
            "request_rate": self.request_rate if math.isfinite(self.request_rate) else "inf",
            "seed": self.seed,
            "max_concurrency": self.max_concurrency,
            "repeats": self.repeats,
            "round_wall_seconds": list(self.round_walls),
            "best_round": self.best_round,
            "duration": self.wall_seconds,
            "completed": self.completed,
            "failed": self.failed,
            "first_error": self.first_error,
            "total_input_tokens": self.input_tokens,
            "total_output_tokens": self.output_tokens,
            "output_tokens_from": self.output_tokens_from,
            "request_throughput": self.requests_per_second,
            "output_throughput": self.output_tokens_per_second,
            "total_token_throughput": self.total_tokens_per_second,
            "max_concurrent_requests": self.max_concurrent_requests,
            "mean_concurrent_requests": self.mean_concurrent_requests,
            "percentile_method": PERCENTILE_METHOD,
            **self.ttft.as_vllm("ttft"),
            **self.tpot.as_vllm("tpot"),
            **self.itl.as_vllm("itl"),
            **self.e2e.as_vllm("e2el"),
            **self.queue.as_vllm("client_queue_time"),
            "samples": {
                "ttft": self.ttft.count,
                "tpot": self.tpot.count,
                "itl": self.itl.count,
                "e2el": self.e2e.count,
            },
            "notes": list(self.notes),
            "prompt_token_mismatches": self.prompt_token_mismatches,
            "prompt_tokens_sent": sum(r.prompt_tokens_sent for r in self.requests),
            "cached_tokens": self.cached_tokens,
            "outputs_identical_across_repeats": self.outputs_identical_across_repeats,
            "scheduled_arrivals_s": list(self.arrivals),
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


def traffic(r: ServeBenchResult) -> str:
    """How the requests were sent, in words."""
    arrivals = "all at once" if math.isinf(r.request_rate) else f"Poisson at {r.request_rate:g} req/s (seed {r.seed})"
    limit = f"at most {r.max_concurrency} in flight" if r.max_concurrency is not None else "no concurrency limit"
    n, k = r.workload_prompts, r.num_prompts
    if k > n:
        drawn = f"{k} requests cycling through {r.workload}'s {n} prompts"
    elif k < n:
        drawn = f"{k} requests: the first {k} of {r.workload}'s {n} prompts"
    else:
        drawn = f"{k} requests: {r.workload}'s prompts, each once"
    return f"{drawn}, {arrivals}, {limit}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _stats(s: LatencyStats) -> str:
    return f"{_ms(s.mean)} / {_ms(s.median)} / {_ms(s.p99)}"


def serve_table(r: ServeBenchResult) -> ResultTable:
    """One workload's figures as a metric / value table, how it was sent above it and its notes under it."""
    rows: list[tuple[str, str]] = [
        ("requests ok / failed", f"{r.completed} / {r.failed}"),
        ("duration s (first send to last end)", f"{r.wall_seconds:.3f}"),
        (f"output tokens (from {r.output_tokens_from})", str(r.output_tokens)),
        ("output tok/s", f"{r.output_tokens_per_second:.1f}"),
        ("requests/s", f"{r.requests_per_second:.2f}"),
        ("in flight: max / time-averaged", f"{r.max_concurrent_requests} / {r.mean_concurrent_requests:.2f}"),
        ("TTFT mean / median / p99 ms", _stats(r.ttft)),
        ("TPOT mean / median / p99 ms", _stats(r.tpot)),
        ("ITL mean / median / p99 ms", _stats(r.itl)),
        ("E2E mean / median / p99 ms", _stats(r.e2e)),
    ]
    if r.max_concurrency is not None:
        rows.append(("client queue mean / median / p99 ms", _stats(r.queue)))
    rows.append(("cached prompt tokens", "-" if r.cached_tokens is None else f"{r.cached_tokens}"))
    if r.repeats > 1:
        rows.append(("round walls s", ", ".join(f"{w:.3f}" for w in r.round_walls)))
        rows.append(("same texts every round", str(r.outputs_identical_across_repeats)))
    return result_table(
        f"serve: {r.workload}",
        (Column("metric"), Column("value", "right")),
        rows,
        notes=[f"[yellow]note:[/yellow] {note}" for note in r.notes],
        heading=f"[bold]serve {r.workload}[/bold]: {traffic(r)}, streamed to {r.url} ({r.served_model}), "
        f"{r.max_tokens} greedy tokens/request{'' if r.ignore_eos else ' (EOS not ignored)'}, prompts as "
        f"{r.prompt_format}, best of {r.repeats}",
    )


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


def bench_workload(
    sender: RoundSender,
    workload: Workload,
    prompt_format: PromptFormat = "token-ids",
    repeats: int = 1,
    *,
    num_prompts: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
) -> ServeBenchResult:
    """``repeats`` rounds of ``num_prompts`` requests (default: each of the workload's prompts once) drawn from
    the workload's prompts in turn, arriving at ``request_rate`` per second (Poisson, seeded; inf: all at once);
    the round with the best wall time is reported."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    indices = prompt_indices(len(workload.token_ids), num_prompts)
    arrivals = arrival_schedule(len(indices), request_rate, seed)
    every = workload.prompts(prompt_format)
    prompts = [every[i] for i in indices]
    counts = [len(workload.token_ids[i]) for i in indices]
    rounds = [sender.run_round(prompts, counts, arrivals, indices) for _ in range(repeats)]
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
        workload_prompts=len(workload.token_ids),
        request_rate=request_rate,
        seed=seed,
        max_concurrency=sender.max_concurrency,
        arrivals=arrivals,
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
    num_prompts: int | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
) -> ServeBench:
    """Every workload in turn against the server at ``base_url`` (with or without ``/v1``): ``num_prompts``
    requests each (default: each of its prompts once, the prompts cycled when there are more requests than
    prompts), arriving at ``request_rate`` per second (a Poisson process seeded with ``seed``; inf: all at once),
    at most ``max_concurrency`` in flight. The served model defaults to the first id of ``GET /v1/models``. The
    warm-up sends the first workload's first two prompts at once (within ``max_concurrency``), unmeasured; its
    failures are reported, not raised (the measured rounds show them again)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (None: no limit), got {max_concurrency}")
    arrival_schedule(0, request_rate)  # refuses a rate that is not > 0 before anything is sent
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    try:
        model = served_model or discover_model(base_url, api_key, timeout=min(timeout, 30.0), instead="--served-model")
    except ModelDiscoveryError as exc:
        raise ServeBenchError(str(exc)) from exc
    sender = RoundSender(
        base_url, model, max_tokens, ignore_eos, timeout, api_key=api_key, max_concurrency=max_concurrency
    )
    warm = None
    if warmup and workloads:
        first = workloads[0]
        warm = sender.run_round(first.prompts(prompt_format)[:2], [len(p) for p in first.token_ids[:2]])
    results = tuple(
        bench_workload(sender, w, prompt_format, repeats, num_prompts=num_prompts, request_rate=request_rate, seed=seed)
        for w in workloads
    )
    return ServeBench(server_root(base_url), model, warm, results)


def result_filename(served_model: str, request_rate: float, max_concurrency: int | None, date: str) -> str:
    """``--save-result``'s file name when none is given, vLLM's pattern with kvlab as its label:
    ``kvlab-{rate}qps[-concurrency{N}]-{model's last path part}-{date}.json`` (``date`` as vLLM writes it,
    ``%Y%m%d-%H%M%S``)."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"kvlab-{float(request_rate)}qps{concurrency}-{served_model.split('/')[-1]}-{date}.json"
