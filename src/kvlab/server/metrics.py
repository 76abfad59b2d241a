"""``/metrics`` through ``prometheus_client``: vLLM's own series under vLLM's exact names, types, labels and
buckets (``vllm:...``, as recorded from vLLM 0.32 in ``tests/server/vllm_metrics_0.32.json``), so a dashboard
built for vLLM reads kvlab unchanged, plus kvlab's own series under ``kvlab:``.

Which vLLM series kvlab fills and which it cannot (and why) is listed in ``VLLM_SERIES`` and
``VLLM_UNFILLED``; ``tests/server/test_metrics.py`` holds both against the recording.

The ``kvlab:`` copies of vLLM's series that kvlab exported before (``kvlab:prompt_tokens``,
``kvlab:time_to_first_token_seconds``, ``kvlab:time_per_output_token_seconds``, ...: ``KVLAB_COPIES``) stay,
frozen, for the dashboards, scrapers and probes that already read them (``kvlab probe`` looks for
``kvlab:prefix_cache_hits_total`` first); they carry the same observations as their ``vllm:`` twins (one
call feeds both) and only the ``model_name`` label. New vLLM-compatible series appear under ``vllm:`` only.

Two sources:

- The engine's own totals and gauges (``EngineStats``, snapshotted by the engine loop after every step) are
  exposed by a collector that reads the snapshot at scrape time: a counter that mirrors an engine total is
  that total, never a sum of deltas that could drift from it.
- What only the stream of outputs shows (prompt and generation tokens, finished sequences by reason, the
  per-request histograms) is counted by ``RequestTracker``, which the engine loop calls on its own thread for
  every output it delivers and every request it aborts. As in vLLM, where a request of ``n > 1`` runs as n
  child requests, every sequence counts on its own (tokens, finish, latencies, preemptions); the prompt's
  counts are the exception: kvlab computes the prompt once for all n sequences and counts it once.

Each app has its own ``CollectorRegistry`` (two servers in one process never share series); no
``*_created`` series (``disable_created_metrics``: vLLM's scrape has one creation-time gauge per counter and
histogram, prometheus_client's default, which no dashboard reads). Every series is labelled
``model_name`` (the served name, chosen by the operator), vLLM's also ``engine="0"``; the other labels
(``finished_reason``, ``source``, ...) take fixed values only. No value a client controls ever becomes a label.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvlab.engine.request import RequestOutput
from kvlab.server.tenancy import ANONYMOUS

if TYPE_CHECKING:
    from kvlab.engine.stats import EngineStats
    from kvlab.server.engine_loop import EngineLoop

log = logging.getLogger(__name__)

# prometheus_client adds a *_created gauge per counter and histogram unless told not to (vLLM leaves them on);
# a process-wide switch: kvlab's server process exposes no other registry.
disable_created_metrics()

PREFIX = "kvlab:"
VLLM = "vllm:"
ENGINE = "0"  # vLLM's engine label (its data-parallel engine index): kvlab runs one engine
# The reasons a sequence can finish with (the engine's finish_reason, and "abort" when the loop aborts it);
# anything else is counted as "other", so a label value can never come from anywhere but this list.
FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM's FinishReason values: the vllm: series show every one from the start (kvlab never ends a sequence
# for repetition, so that one stays at 0).
VLLM_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # PromptTokenStats.ALL_SOURCES
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")  # CacheHitSource
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
WAITING_REASONS = ("capacity", "deferred")

# vLLM's buckets (vllm/v1/metrics/buckets.py), so histograms line up with a vLLM dashboard's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
TPOT_BUCKETS = ITL_BUCKETS  # kvlab:time_per_output_token_seconds, vLLM's former name of the inter-token latency
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = E2E_BUCKETS  # e2e, queue, inference, prefill and decode times
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (build_1_2_5_buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


# vLLM's speculative-decoding counters (its SpecDecodingProm), in its scrape only where speculation is on, hence
# not in the default recording: name -> help.
SPEC_SERIES: dict[str, str] = {
    "spec_decode_num_drafts": "Number of spec decoding drafts.",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
}
# The vLLM series kvlab fills, with their type (the test holds these against the recording of vLLM 0.32).
VLLM_SERIES: dict[str, str] = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "num_requests_waiting_by_reason": "gauge",
    "engine_sleep_state": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "prompt_tokens_by_source": "counter",
    "prompt_tokens_cached": "counter",
    "prompt_tokens_cached_by_source": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram",
    "request_params_max_tokens": "histogram",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_num_preemptions": "histogram",
    "request_prefill_kv_computed_tokens": "histogram",
}
# The series of vLLM's default scrape that kvlab leaves out, and why: a series is exported only where kvlab
# has the quantity it counts.
VLLM_UNFILLED: dict[str, str] = {
    "iteration_tokens_total": "tokens per engine step: the engine loop hands the server outputs and a stats "
    "snapshot, not the step's scheduled token count",
    "admission_rejections": "its reasons are vLLM's queue limits (max_num_queued_reqs/tokens); kvlab refuses "
    "for other reasons (pending slots, a tenant's sequences), answered 429/503 and not counted in vLLM's terms",
    "cache_config_info": "an info gauge whose label names are vLLM's CacheConfig fields, most of which kvlab "
    "does not have (gpu_memory_utilization, swap_space, ...)",
    "external_prefix_cache_queries": "no KV connector: kvlab has no external KV cache",
    "external_prefix_cache_hits": "no KV connector: kvlab has no external KV cache",
    "mm_cache_queries": "no multimodal inputs",
    "mm_cache_hits": "no multimodal inputs",
    "num_requests_kv_fetch_by_stage": "no KV connector: nothing is fetched",
    "corrupted_requests": "vLLM counts it only with VLLM_COMPUTE_NANS_IN_LOGITS; kvlab fails such a request "
    "(finish_reason error), counted in kvlab:failed_requests",
    "lora_requests_info": "no LoRA adapters",
    "estimated_flops_per_gpu": "vLLM's model-FLOPs estimate (its MFU metrics) per GPU: kvlab has no GPU and no "
    "FLOPs model of its steps",
    "estimated_read_bytes_per_gpu": "vLLM's estimate of memory traffic per GPU (MFU metrics): no GPU, no model",
    "estimated_write_bytes_per_gpu": "vLLM's estimate of memory traffic per GPU (MFU metrics): no GPU, no model",
}
# The kvlab: series that are copies of vLLM's (kept for what already reads them; see the module docstring).
KVLAB_COPIES: dict[str, str] = {
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "request_success": "request_success",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "time_per_output_token_seconds": "inter_token_latency_seconds",  # vLLM's name until 0.11
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
}


class EngineCollector(Collector):
    """The engine loop's stats snapshot, read at scrape time."""

    def __init__(self, loop: EngineLoop, model_name: str) -> None:
        self.loop = loop
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.loop.stats
        usage = s.kv_cache_usage_perc / 100  # vLLM's: a fraction in [0, 1]; EngineStats says percent
        # name, help, value, also under vllm: (None: kvlab's own)
        gauges: list[tuple[str, str, float, str | None]] = [
            ("kv_cache_usage_perc", "KV-cache usage (fraction of the block pool, 0-1)", usage,
             "KV-cache usage. 1 means 100 percent usage."),
            ("num_requests_running", "Requests in the running batch", s.num_requests_running,
             "Number of requests in model execution batches."),
            ("num_requests_waiting", "Requests waiting to be scheduled", s.num_requests_waiting,
             "Number of requests waiting to be processed."),
            ("num_requests_pending", "Requests accepted by the server and not finished (kvlab)", self.loop.num_pending,
             None),
            ("num_free_blocks", "Free KV blocks, cached-but-evictable ones included (kvlab)", s.num_free_blocks, None),
            ("num_evictable_blocks", "Free KV blocks still holding a findable prefix (kvlab)", s.num_evictable_blocks,
             None),
        ]  # fmt: skip
        counters: list[tuple[str, str, float, str | None]] = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries,
             "Prefix cache queries, in terms of number of queried tokens."),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits,
             "Prefix cache hits, in terms of number of cached tokens."),
            ("num_preemptions", "Requests preempted (their blocks freed, recomputed later)", s.num_preemptions,
             "Cumulative number of preemption from the engine."),
            ("cow_copies", "Copy-on-write block copies (kvlab)", s.cow_copies, None),
            ("evictions", "Cached blocks evicted from the prefix cache to be reused (kvlab)", s.evictions, None),
            ("failed_requests", "Sequences ended by a fault inside a step (kvlab)", s.num_failed_requests, None),
            ("engine_steps", "Engine steps run (kvlab)", s.steps, None),
        ]  # fmt: skip
        violations = self.loop.num_violations
        if violations is not None:  # only with the sanitizer on: absent means "not checked", not "none found"
            counters.append(
                ("sanitizer_violations", "Foreign K/V reads caught by the KV sanitizer (kvlab)", violations, None)
            )
        vllm_labels = [self.model_name, ENGINE]
        for name, help_, value, vllm_help in gauges:
            g = GaugeMetricFamily(PREFIX + name, help_, labels=["model_name"])
            g.add_metric([self.model_name], float(value))
            yield g
            if vllm_help is not None:
                g = GaugeMetricFamily(VLLM + name, vllm_help, labels=["model_name", "engine"])
                g.add_metric(vllm_labels, float(value))
                yield g
        for name, help_, value, vllm_help in counters:
            c = CounterMetricFamily(PREFIX + name, help_, labels=["model_name"])
            c.add_metric([self.model_name], float(value))
            yield c
            if vllm_help is not None:
                c = CounterMetricFamily(VLLM + name, vllm_help, labels=["model_name", "engine"])
                c.add_metric(vllm_labels, float(value))
                yield c
        yield from self._speculative(s, vllm_labels)
        # Every waiting request waits for capacity (a seat or blocks); vLLM's "deferred" ones wait for what
        # kvlab does not have (a grammar to compile, KV from a remote store).
        g = GaugeMetricFamily(
            VLLM + "num_requests_waiting_by_reason", "Number of requests waiting, by reason.",
            labels=["model_name", "engine", "reason"],
        )  # fmt: skip
        for reason, value in zip(WAITING_REASONS, (s.num_requests_waiting, 0), strict=True):
            g.add_metric([*vllm_labels, reason], float(value))
        yield g
        g = GaugeMetricFamily(
            VLLM + "engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping",
            labels=["model_name", "engine", "sleep_state"],
        )  # fmt: skip
        for state in SLEEP_STATES:  # kvlab's engine has no sleep mode: always awake, weights in place
            g.add_metric([*vllm_labels, state], 1.0 if state == "awake" else 0.0)
        yield g
        # vLLM counts the scheduler's prefix-cache hits as tier "device": kvlab's pool is its only tier.
        c = CounterMetricFamily(
            VLLM + "prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them (kvlab: its one KV pool, 'device').",
            labels=["model_name", "engine", "source"],
        )
        for source in CACHE_HIT_SOURCES:
            c.add_metric([*vllm_labels, source], float(s.prefix_cache_hits if source == "device" else 0))
        yield c

    @staticmethod
    def _speculative(s: EngineStats, vllm_labels: list[str]) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, exported as vLLM does: only where speculation is on."""
        per_pos = s.spec_decode_num_accepted_tokens_per_pos
        if not per_pos:
            return
        for name, value in (
            ("spec_decode_num_drafts", s.spec_decode_num_drafts),
            ("spec_decode_num_draft_tokens", s.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", s.spec_decode_num_accepted_tokens),
        ):
            c = CounterMetricFamily(VLLM + name, SPEC_SERIES[name], labels=["model_name", "engine"])
            c.add_metric(vllm_labels, float(value))
            yield c
        name = "spec_decode_num_accepted_tokens_per_pos"
        c = CounterMetricFamily(VLLM + name, SPEC_SERIES[name], labels=["model_name", "engine", "position"])
        for pos, value in enumerate(per_pos):
            c.add_metric([*vllm_labels, str(pos)], float(value))
        yield c


class _Both:
    """One observation fed to every series it names (a kvlab: copy and its vllm: twin): equal by construction."""

    def __init__(self, *children: Any) -> None:
        self.children = children

    def inc(self, amount: float = 1.0) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


@dataclass
class _Seq:
    """One sequence of a request in flight."""

    tokens: int = 0  # tokens counted
    first_token: float | None = None  # when its first token came (the engine's clock)
    last_token: float | None = None  # when its latest tokens were delivered
    finished: bool = False


@dataclass
class _Live:
    """What the tracker knows of one request in flight."""

    arrival: float  # the engine's monotonic clock
    seqs: dict[int, _Seq] = field(default_factory=dict)  # by sequence index
    prompt_counted: bool = False


class RequestTracker:
    """Token counts, finish reasons and latencies from the outputs the engine loop delivers. Called on the
    engine loop's thread only; prometheus_client's metrics take their own locks for the scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self._live: dict[str, _Live] = {}

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        m = self.m
        live = self._live.setdefault(out.request_id, _Live(out.metrics.arrival_time))
        new_total = 0
        for c in out.outputs:
            seq = live.seqs.setdefault(c.index, _Seq())
            new = len(c.token_ids) - seq.tokens
            if new > 0:
                new_total += new
                if seq.first_token is None:
                    first = out.metrics.first_token_time
                    seq.first_token = first if first is not None else now
                    m.ttft.observe(max(0.0, seq.first_token - live.arrival))
                elif seq.last_token is not None:
                    # One step gave the sequence its next tokens: the time since the last step that gave it any.
                    m.itl.observe(max(0.0, now - seq.last_token))
                seq.tokens = len(c.token_ids)
                seq.last_token = now
            if new_total and not live.prompt_counted:
                # The prompt has been processed (vLLM counts prompt tokens at the first token, once a request).
                live.prompt_counted = True
                self._count_prompt(out)
            if c.finish_reason is not None and not seq.finished:
                seq.finished = True
                m.success(c.finish_reason)
                self._finished_sequence(out, c.index, seq, live, now)
        if new_total > 0:
            m.generation_tokens.inc(new_total)
        if out.finished:
            m.request_max_num_generation_tokens.observe(max((s.tokens for s in live.seqs.values()), default=0))
            m.request_params_n.observe(len(out.outputs))
            del self._live[out.request_id]

    def _count_prompt(self, out: RequestOutput) -> None:
        m = self.m
        prompt = len(out.prompt_token_ids)
        cached = min(max(out.num_cached_tokens, 0), prompt)
        m.prompt_tokens.inc(prompt)
        m.prompt_by_source["local_compute"].inc(prompt - cached)
        m.prompt_by_source["local_cache_hit"].inc(cached)
        m.prompt_tokens_cached.inc(cached)
        tenant, public = self._prompt_facts(out.request_id)
        if cached:
            public = min(public, cached)
            m.hits_by_tenant.labels(m.model_name, tenant, "public").inc(public)
            m.hits_by_tenant.labels(m.model_name, tenant, "private").inc(cached - public)
        m.request_prompt_tokens.observe(prompt)
        m.request_prefill_kv_computed_tokens.observe(prompt - cached)

    def _finished_sequence(self, out: RequestOutput, index: int, seq: _Seq, live: _Live, now: float) -> None:
        """vLLM's per-request histograms (FinishedRequestStats), for one finished sequence."""
        m = self.m
        m.e2e.observe(max(0.0, now - live.arrival))
        scheduled = out.metrics.first_scheduled_time
        scheduled = live.arrival if scheduled is None else scheduled
        first = seq.first_token if seq.first_token is not None else now
        last = seq.last_token if seq.last_token is not None else now
        m.request_queue_time.observe(max(0.0, scheduled - live.arrival))
        m.request_prefill_time.observe(max(0.0, first - scheduled))
        m.request_decode_time.observe(max(0.0, last - first))
        m.request_inference_time.observe(max(0.0, last - scheduled))
        m.request_time_per_output_token.observe(max(0.0, last - first) / (seq.tokens - 1) if seq.tokens > 1 else 0.0)
        m.request_generation_tokens.observe(seq.tokens)
        params, preemptions = self._sequence_facts(out.request_id, index)
        m.request_num_preemptions.observe(preemptions)
        if params is not None and params.max_tokens:
            m.request_params_max_tokens.observe(params.max_tokens)

    def _sequences(self, request_id: str) -> Sequence[Any]:
        """The request's sequences, read from the engine (the loop calls the tracker on its own thread, before it
        releases the request); none when the engine no longer knows it."""
        try:
            return self.m.loop.engine.sequences(request_id)
        except (AttributeError, KeyError):
            return ()

    def _sequence_facts(self, request_id: str, index: int) -> tuple[Any, int]:
        """The sequence's SamplingParams and preemption count."""
        req = next((r for r in self._sequences(request_id) if r.index == index), None)
        return (None, 0) if req is None else (req.params, int(req.num_preemptions))

    def _prompt_facts(self, request_id: str) -> tuple[str, int]:
        """The request's tenant (a label) and the cached prompt tokens that lay in public blocks."""
        head = next(iter(self._sequences(request_id)), None)
        return ("unknown", 0) if head is None else (str(head.tenant or ANONYMOUS), int(head.num_public_cached_tokens))

    def on_abort(self, request_id: str, n: int) -> None:
        """The loop aborted a request (its client went away): its unfinished sequences count as "abort"."""
        live = self._live.pop(request_id, None)
        finished = sum(s.finished for s in live.seqs.values()) if live is not None else 0
        for _ in range(n - finished):
            self.m.success("abort")

    def reset(self) -> None:
        """The loop stopped: nothing in flight will report again."""
        self._live.clear()


class ServerMetrics:
    """One app's registry: the engine collector plus the tracker's counters and histograms."""

    def __init__(self, loop: EngineLoop, model_name: str, max_model_len: int | None = None) -> None:
        self.registry = reg = CollectorRegistry()
        self.loop = loop
        self.model_name = model_name
        if max_model_len is None:
            max_model_len = int(loop.engine.scheduler_config.max_model_len)
        token_buckets = request_tokens_buckets(max_model_len)
        ours, theirs = ["model_name"], ["model_name", "engine"]

        def counter(name: str, help_: str, vllm_help: str, copy: bool = True) -> _Both:
            children = [Counter(VLLM + name, vllm_help, theirs, registry=reg).labels(model_name, ENGINE)]
            if copy:
                children.append(Counter(PREFIX + name, help_, ours, registry=reg).labels(model_name))
            return _Both(*children)

        def histogram(name: str, vllm_help: str, buckets: Sequence[float], copy: str | None = None) -> _Both:
            children = [
                Histogram(VLLM + name, vllm_help, theirs, registry=reg, buckets=buckets).labels(model_name, ENGINE)
            ]
            if copy is not None:
                children.append(
                    Histogram(PREFIX + copy, vllm_help, ours, registry=reg, buckets=buckets).labels(model_name)
                )
            return _Both(*children)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated", "Number of generation tokens processed."
        )
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "", "Number of cached prompt tokens (local + external).", copy=False
        )
        by_source = Counter(VLLM + "prompt_tokens_by_source", "Number of prompt tokens by source.",
                            [*theirs, "source"], registry=reg)  # fmt: skip
        self.prompt_by_source = {s: by_source.labels(model_name, ENGINE, s) for s in PROMPT_SOURCES}
        self._success = Counter(
            PREFIX + "request_success", "Finished sequences, by finish reason", [*ours, "finished_reason"], registry=reg
        )
        self._vllm_success = Counter(
            VLLM + "request_success", "Count of successfully processed requests.", [*theirs, "finished_reason"],
            registry=reg,
        )  # fmt: skip
        # Per tenant: how much of its prompts it found in public blocks (shared with every tenant by design) and in
        # its own private ones. Tenant names are the operator's (API keys); /metrics is gated (tenancy).
        self.hits_by_tenant = Counter(
            PREFIX + "prefix_cache_hits_by_tenant",
            "Prompt tokens found in the prefix cache, by tenant and by the blocks' namespace (public: shared across "
            "tenants; private: the tenant's own)",
            [*ours, "tenant", "blocks"],
            registry=reg,
        )
        for reason in FINISHED_REASONS:  # every series present from the start, at 0
            self._success.labels(model_name, reason)
        for reason in VLLM_FINISHED_REASONS:
            self._vllm_success.labels(model_name, ENGINE, reason)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS, copy="time_to_first_token_seconds")  # fmt: skip
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS, copy="time_per_output_token_seconds")  # fmt: skip
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             E2E_BUCKETS, copy="e2e_request_latency_seconds")  # fmt: skip
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )  # fmt: skip
        phases = {
            "queue": "Histogram of time spent in WAITING phase for request.",
            "inference": "Histogram of time spent in RUNNING phase for request.",
            "prefill": "Histogram of time spent in PREFILL phase for request.",
            "decode": "Histogram of time spent in DECODE phase for request.",
        }
        self.request_queue_time, self.request_inference_time, self.request_prefill_time, self.request_decode_time = (
            histogram(f"request_{p}_time_seconds", help_, REQUEST_LATENCY_BUCKETS) for p, help_ in phases.items()
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )  # fmt: skip
        self.request_params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.request_num_preemptions = histogram(
            "request_num_preemptions", "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )  # fmt: skip
        self.request_prefill_kv_computed_tokens = histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        reg.register(EngineCollector(loop, model_name))
        self.tracker = RequestTracker(self)

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason if reason in FINISHED_REASONS else "other").inc()
        self._vllm_success.labels(self.model_name, ENGINE, reason if reason in VLLM_FINISHED_REASONS else "other").inc()

    def exposition(self) -> bytes:
        """The text format (``prometheus_client`` writes it: names, escaping, ``_total`` and ``_bucket``)."""
        return generate_latest(self.registry)


@dataclass(frozen=True)
class FamilyShape:
    """What a dashboard depends on in one metric family: its label names, histogram buckets and the values of
    its fixed-set labels (all but ``model_name`` and ``engine``). The recording of vLLM's /metrics
    (scripts/peers/record_vllm_metrics.py) and the test that holds kvlab's series to it read families alike."""

    labels: list[str]
    buckets: list[float]
    label_values: dict[str, list[str]]

    @classmethod
    def of(cls, family: Metric) -> FamilyShape:
        labels: set[str] = set()
        values: dict[str, set[str]] = {}
        buckets: list[float] = []
        for s in family.samples:
            for k, v in s.labels.items():
                if k == "le":
                    if s.name.endswith("_bucket") and v != "+Inf" and float(v) not in buckets:
                        buckets.append(float(v))
                    continue
                labels.add(k)
                values.setdefault(k, set()).add(v)
        fixed = {k: sorted(v) for k, v in values.items() if k not in ("model_name", "engine")}
        return cls(sorted(labels), buckets, fixed)
