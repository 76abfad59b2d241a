"""``/metrics`` through ``prometheus_client``: vLLM's names and semantics under a ``kvlab:`` prefix, so a
dashboard built for vLLM reads kvlab by changing the prefix, plus kvlab's own series.

Two sources:

- The engine's own totals and gauges (``EngineStats``, snapshotted by the engine loop after every step) are
  exposed by a collector that reads the snapshot at scrape time: a counter that mirrors an engine total is
  that total, never a sum of deltas that could drift from it.
- What only the stream of outputs shows (prompt and generation tokens, finished requests by reason, the
  latency histograms) is counted by ``RequestTracker``, which the engine loop calls on its own thread for
  every output it delivers and every request it aborts.

Each app has its own ``CollectorRegistry`` (two servers in one process never share series). Every series is
labelled ``model_name`` (the served name, chosen by the operator); ``finished_reason`` takes the engine's
fixed values only. No value a client controls ever becomes a label.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvlab.engine.request import RequestOutput

if TYPE_CHECKING:
    from kvlab.server.engine_loop import EngineLoop

log = logging.getLogger(__name__)

PREFIX = "kvlab:"
# The reasons a sequence can finish with (the engine's finish_reason, and "abort" when the loop aborts it);
# anything else is counted as "other", so a label value can never come from anywhere but this list.
FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms line up with a vLLM dashboard's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineCollector(Collector):
    """The engine loop's stats snapshot, read at scrape time."""

    def __init__(self, loop: EngineLoop, model_name: str) -> None:
        self.loop = loop
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.loop.stats
        gauges = [
            # vLLM's: a fraction in [0, 1]; EngineStats says percent.
            ("kv_cache_usage_perc", "KV-cache usage (fraction of the block pool, 0-1)", s.kv_cache_usage_perc / 100),
            ("num_requests_running", "Requests in the running batch", s.num_requests_running),
            ("num_requests_waiting", "Requests waiting to be scheduled", s.num_requests_waiting),
            ("num_requests_pending", "Requests accepted by the server and not finished (kvlab)", self.loop.num_pending),
            ("num_free_blocks", "Free KV blocks, cached-but-evictable ones included (kvlab)", s.num_free_blocks),
            ("num_evictable_blocks", "Free KV blocks still holding a findable prefix (kvlab)", s.num_evictable_blocks),
        ]  # fmt: skip
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted (their blocks freed, recomputed later)", s.num_preemptions),
            ("cow_copies", "Copy-on-write block copies (kvlab)", s.cow_copies),
            ("evictions", "Cached blocks evicted from the prefix cache to be reused (kvlab)", s.evictions),
            ("failed_requests", "Sequences ended by a fault inside a step (kvlab)", s.num_failed_requests),
            ("engine_steps", "Engine steps run (kvlab)", s.steps),
        ]  # fmt: skip
        violations = self.loop.num_violations
        if violations is not None:  # only with the sanitizer on: absent means "not checked", not "none found"
            counters.append(
                ("sanitizer_violations", "Foreign K/V reads caught by the KV sanitizer (kvlab)", violations)
            )
        for name, help_, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, help_, labels=["model_name"])
            g.add_metric([self.model_name], float(value))
            yield g
        for name, help_, value in counters:
            c = CounterMetricFamily(PREFIX + name, help_, labels=["model_name"])
            c.add_metric([self.model_name], float(value))
            yield c


@dataclass
class _Live:
    """What the tracker knows of one request in flight."""

    arrival: float  # the engine's monotonic clock
    tokens: dict[int, int] = field(default_factory=dict)  # sequence index -> tokens counted
    finished: set[int] = field(default_factory=set)  # sequence indices counted as finished
    last_token: float | None = None  # when its previous tokens were delivered


class RequestTracker:
    """Token counts, finish reasons and latencies from the outputs the engine loop delivers. Called on the
    engine loop's thread only; prometheus_client's metrics take their own locks for the scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self._live: dict[str, _Live] = {}

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        live = self._live.setdefault(out.request_id, _Live(out.metrics.arrival_time))
        new = 0
        for c in out.outputs:
            new += len(c.token_ids) - live.tokens.get(c.index, 0)
            live.tokens[c.index] = len(c.token_ids)
            if c.finish_reason is not None and c.index not in live.finished:
                live.finished.add(c.index)
                self.m.success(c.finish_reason)
        if new > 0:
            self.m.generation_tokens.inc(new)
            if live.last_token is None:
                # The first token: the prompt has been processed (vLLM counts prompt tokens then, once per request).
                self.m.prompt_tokens.inc(len(out.prompt_token_ids))
                first = out.metrics.first_token_time
                self.m.ttft.observe(max(0.0, (first if first is not None else now) - live.arrival))
            else:
                # One step gave each sequence one token: the time since the last step that gave it any.
                self.m.tpot.observe(max(0.0, now - live.last_token))
            live.last_token = now
        if out.finished:
            self.m.e2e.observe(max(0.0, now - live.arrival))
            del self._live[out.request_id]

    def on_abort(self, request_id: str, n: int) -> None:
        """The loop aborted a request (its client went away): its unfinished sequences count as "abort"."""
        live = self._live.pop(request_id, None)
        finished = live.finished if live is not None else set()
        for _ in range(n - len(finished)):
            self.m.success("abort")

    def reset(self) -> None:
        """The loop stopped: nothing in flight will report again."""
        self._live.clear()


class ServerMetrics:
    """One app's registry: the engine collector plus the tracker's counters and histograms."""

    def __init__(self, loop: EngineLoop, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", labels, registry=reg).labels(
            model_name
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", labels, registry=reg).labels(
            model_name
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Finished sequences, by finish reason",
            [*labels, "finished_reason"],
            registry=reg,
        )
        for reason in FINISHED_REASONS:  # every series present from the start, at 0
            self._success.labels(model_name, reason)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token", labels, registry=reg, buckets=TTFT_BUCKETS
        ).labels(model_name)
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "Time between two tokens of a request (per step)", labels,
            registry=reg, buckets=TPOT_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to last token", labels, registry=reg, buckets=E2E_BUCKETS
        ).labels(model_name)
        reg.register(EngineCollector(loop, model_name))
        self.tracker = RequestTracker(self)

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason if reason in FINISHED_REASONS else "other").inc()

    def exposition(self) -> bytes:
        """The text format (``prometheus_client`` writes it: names, escaping, ``_total`` and ``_bucket``)."""
        return generate_latest(self.registry)
