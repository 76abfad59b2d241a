"""What ``kvlab bench serve`` measured, and how it reads it: one record per streamed request, the
statistics of a round as vLLM's bench serve computes them, the result of a workload and its table.

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

"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvlab.bench.table import Column, ResultTable, result_table

PromptFormat = Literal["token-ids", "text"]
PROMPT_FORMATS: tuple[str, ...] = ("token-ids", "text")
# How the percentiles are computed, as the JSON says it: vLLM's bench serve calls numpy.percentile with its
# default method.
PERCENTILE_METHOD = "numpy.percentile, linear interpolation (as vllm bench serve)"


def max_in_flight(intervals: Sequence[tuple[float, float]]) -> int:
    """The most ``(start, end)`` intervals open at once, each half-open (an end and a start at the same time do
    not overlap: departures first, as vLLM's sweep counts them)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, delta in events:
        now += delta
        most = max(most, now)
    return most


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
