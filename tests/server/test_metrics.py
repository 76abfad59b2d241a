"""/metrics as vLLM's dashboards read it (issue 13): parsed with prometheus_client's own parser, checked
after a known workload, label values escaped by the library and never chosen by a client; and the KV
capacity line the server logs at start."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from kvlab.server.metrics import (
    CACHE_HIT_SOURCES,
    FINISHED_REASONS,
    KVLAB_COPIES,
    PROMPT_SOURCES,
    VLLM_FINISHED_REASONS,
    VLLM_SERIES,
    VLLM_UNFILLED,
    FamilyShape,
    request_tokens_buckets,
)
from kvlab.server.serve import ServerConfig, build_app
from server.server_http import Http

pytest.importorskip("prometheus_client")

POLL_LIMIT = 30.0
PROMPTS = ["Metrics prompt one", "The second metrics prompt", "3rd"]
MAX_TOKENS = 5


def wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + POLL_LIMIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def complete(http: Http, prompt: str, **kw: Any) -> dict[str, Any]:
    body = {"model": "mini", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}
    status, resp = http.post("/v1/completions", body)
    assert status == 200, resp
    return resp


def families(http: Http) -> dict[str, Any]:
    return {f.name: f for f in http.metric_families()}


def test_counters_and_histograms_after_a_known_workload(make_server) -> None:
    srv, http = make_server()
    first = [complete(http, p) for p in PROMPTS]
    # One more that a stop token id ends at its first token.
    stopped = complete(http, PROMPTS[0], stop_token_ids=[first[0]["choices"][0]["token_ids"][0]])
    assert stopped["choices"][0]["finish_reason"] == "stop" and len(stopped["choices"][0]["token_ids"]) == 1
    m = http.metrics()
    prompt_lengths = [len(p.encode()) for p in [*PROMPTS, PROMPTS[0]]]  # the byte tokenizer: a token per byte
    assert m["prompt_tokens_total"] == sum(prompt_lengths)
    assert m["generation_tokens_total"] == len(PROMPTS) * MAX_TOKENS + 1
    assert m['request_success_total{finished_reason="length"}'] == len(PROMPTS)
    assert m['request_success_total{finished_reason="stop"}'] == 1
    assert (
        m['request_success_total{finished_reason="abort"}'] == m['request_success_total{finished_reason="error"}'] == 0
    )
    assert m["time_to_first_token_seconds_count"] == m["e2e_request_latency_seconds_count"] == 4
    # One observation per step after the first token: MAX_TOKENS - 1 per length-finished request.
    assert m["time_per_output_token_seconds_count"] == len(PROMPTS) * (MAX_TOKENS - 1)
    assert m["e2e_request_latency_seconds_sum"] >= m["time_to_first_token_seconds_sum"] > 0
    # The counters that mirror the engine's totals are those totals.
    stats = srv.loop.stats
    assert m["prefix_cache_queries_total"] == stats.prefix_cache_queries > 0
    assert m["prefix_cache_hits_total"] == stats.prefix_cache_hits > 0, "the repeated prompt hit the cache"
    assert m["num_preemptions_total"] == stats.num_preemptions
    assert m["engine_steps_total"] == stats.steps
    assert m["kv_cache_usage_perc"] == 0.0 and m["num_requests_running"] == m["num_requests_waiting"] == 0
    fam = families(http)
    assert fam["kvlab:prompt_tokens"].type == "counter" and fam["kvlab:prefix_cache_hits"].type == "counter"
    assert fam["kvlab:kv_cache_usage_perc"].type == "gauge"
    assert fam["kvlab:time_to_first_token_seconds"].type == "histogram"
    assert "kvlab:sanitizer_violations" not in fam, "not exported when the sanitizer is off"


def test_kv_cache_usage_is_a_fraction_and_an_abort_is_counted(server, http) -> None:
    """vLLM's kv_cache_usage_perc is in [0, 1] (kvlab's EngineStats says percent); a client that goes away
    is request_success_total{finished_reason="abort"}."""
    wait_until(lambda: http.metrics()["num_requests_pending"] == 0, "an idle server")
    aborted = http.metrics()['request_success_total{finished_reason="abort"}']
    body = {"model": "mini", "prompt": "A long answer:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    sock = http.open_stream(body)
    try:
        # The stream grows a block every block_size tokens: the scrape lies between the two engine readings.
        before = server.loop.stats.kv_cache_usage_perc / 100
        usage = http.metrics()["kv_cache_usage_perc"]
        after = server.loop.stats.kv_cache_usage_perc / 100
        assert 0 < usage <= 1 and before - 1e-9 <= usage <= after + 1e-9
    finally:
        sock.close()
    wait_until(lambda: http.metrics()["num_requests_pending"] == 0, "the aborted request to be released")
    assert http.metrics()['request_success_total{finished_reason="abort"}'] == aborted + 1


def test_kvlab_series_cow_evictions_and_sanitizer(make_server) -> None:
    """kvlab's own series: CoW copies (n=2 siblings diverging in a shared block), evictions (a small pool
    reused), and sanitizer violations (present only when the sanitizer is on; zero on a safe engine)."""
    srv, http = make_server(cache={"num_blocks": 48, "sanitize": True})
    complete(http, "fork me", n=2, temperature=1.0, seed=3)
    for i in range(12):
        complete(http, f"{i} " + "distinct prompt to fill the pool " * 3)
    m = http.metrics()
    stats = srv.loop.stats
    assert m["cow_copies_total"] == stats.cow_copies > 0
    assert m["evictions_total"] == stats.evictions > 0
    assert m["sanitizer_violations_total"] == 0 and srv.engine.violations == []
    assert m["failed_requests_total"] == 0
    assert m["num_free_blocks"] == stats.num_free_blocks == 48


def test_labels_are_escaped_by_the_library_and_never_chosen_by_clients(make_server) -> None:
    name = 'we"ird\\model\nname'
    _, http = make_server(served_model_name=name)
    assert http.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2})[0] == 200
    # Values a client controls: a wrong model, a salt, a stop string, an ignored field. None becomes a label.
    http.post("/v1/completions", {"model": 'x"} 1\nkvlab:fake 1', "prompt": "hi"})
    body = {"model": name, "prompt": "hi", "max_tokens": 2, "cache_salt": "tenant-z", "stop": ["zz"], "user": "u"}
    assert http.post("/v1/completions", body)[0] == 200
    assert http.get('/v1/x"}evil')[0] == 404  # a path no route has: its http_* handler is "none", not the path
    labels: dict[str, set[str]] = {}
    http_labels: dict[str, set[str]] = {}
    for family in http.metric_families():
        assert family.name.startswith(("kvlab:", "vllm:", "http_")), family.name
        for sample in family.samples:
            for key, value in sample.labels.items():
                (http_labels if family.name.startswith("http_") else labels).setdefault(key, set()).add(value)
    assert set(http_labels) <= {"handler", "method", "status", "le"}
    assert http_labels["handler"] == {"/v1/completions", "none"}
    assert http_labels["method"] == {"POST", "GET"} and http_labels["status"] == {"2xx", "4xx"}
    assert set(labels) <= {"model_name", "engine", "finished_reason", "source", "reason", "sleep_state", "le"}
    assert labels["model_name"] == {name}, "the parser read back the exact name: it was escaped"
    assert labels["engine"] == {"0"}
    assert labels["finished_reason"] == set(FINISHED_REASONS) | set(VLLM_FINISHED_REASONS)
    assert labels["source"] == set(PROMPT_SOURCES) | set(CACHE_HIT_SOURCES)
    assert labels["reason"] == {"capacity", "deferred"}
    assert labels["sleep_state"] == {"awake", "weights_offloaded", "discard_all"}


def test_startup_logs_the_kv_capacity_and_warns_when_one_request_cannot_fit(caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvlab.server.serve")
    app = build_app(ServerConfig(port=0))
    lines = [r for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    nbytes = app.state.engine_loop.engine.storage.nbytes()
    assert "256 blocks x 16 tokens = 4096 tokens in float32" in lines[0].getMessage()
    assert f"({nbytes} bytes)" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "KV cache" in r.getMessage()]
    assert not [r for r in caplog.records if "rounded to" in r.getMessage()]
    caplog.clear()
    build_app(ServerConfig(port=0, cache={"kv_cache_dtype": "fp8"}))  # the dtype the pool stores, a quarter the bytes
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert f"4096 tokens in float8_e4m3fn, 4.00 MiB ({nbytes // 4} bytes)" in line and nbytes == 16 << 20
    # A rounding cache says what it lets clients observe of each other; the model's own dtype says nothing.
    (rounds,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "rounded to float8_e4m3fn (the model computes in float32)" in rounds and "other clients' traffic" in rounds
    caplog.clear()
    build_app(ServerConfig(port=0, cache={"num_blocks": 16}, scheduler={"max_model_len": 512}))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cannot hold one request of max_model_len=512" in w for w in warnings), warnings


# --- vLLM's names (issue: vLLM on the same machine), held against a recording of vLLM 0.32's /metrics ---------
VLLM_RECORD = Path(__file__).with_name("vllm_metrics_0.32.json")


def _digest(families: list[Any], prefix: str) -> dict[str, dict[str, Any]]:
    """Type, label names, buckets and fixed-set label values of every ``prefix*`` family, read as
    scripts/peers/record_vllm_metrics.py reads vLLM's scrape (``FamilyShape``)."""
    out: dict[str, dict[str, Any]] = {}
    for fam in families:
        if fam.name.startswith(prefix):
            shape = FamilyShape.of(fam)
            out[fam.name] = {"type": fam.type, "labels": shape.labels, "buckets": shape.buckets,
                             "label_values": shape.label_values}  # fmt: skip
    return out


def test_every_recorded_vllm_series_is_filled_or_listed_with_a_reason() -> None:
    recorded = {n.removeprefix("vllm:") for n in json.loads(VLLM_RECORD.read_text())["series"]}
    assert set(VLLM_SERIES) <= recorded, f"claimed but not vLLM 0.32's: {sorted(set(VLLM_SERIES) - recorded)}"
    assert recorded - set(VLLM_SERIES) <= set(VLLM_UNFILLED), sorted(recorded - set(VLLM_SERIES) - set(VLLM_UNFILLED))
    assert not set(VLLM_SERIES) & set(VLLM_UNFILLED)
    assert all(why.strip() for why in VLLM_UNFILLED.values()), "each with its reason"
    assert set(KVLAB_COPIES.values()) <= set(VLLM_SERIES)


def test_vllm_series_have_vllms_names_types_labels_and_buckets(make_server) -> None:
    record = json.loads(VLLM_RECORD.read_text())
    assert "vllm:prompt_tokens_created" in record["created_series"]  # vLLM keeps prometheus_client's; kvlab does not
    srv, http = make_server()
    for p in PROMPTS:
        complete(http, p)
    complete(http, PROMPTS[0], n=2, temperature=1.0, seed=1)
    families = http.metric_families()
    assert not [s.name for f in families for s in f.samples if s.name.endswith("_created")]
    ours = _digest(families, "vllm:")
    assert set(ours) == {"vllm:" + n for n in VLLM_SERIES}
    max_model_len = srv.engine.scheduler_config.max_model_len
    # vLLM's token-count buckets are 1-2-5 up to max_model_len: the recording's, for the recording's length.
    assert request_tokens_buckets(record["max_model_len"]) == record["series"]["vllm:request_prompt_tokens"]["buckets"]
    for name, got in ours.items():
        want = record["series"][name]
        assert got["type"] == want["type"], name
        assert got["labels"] == want["labels"], name
        if want["type"] == "histogram":
            if want["buckets"] == request_tokens_buckets(record["max_model_len"]):
                assert got["buckets"] == request_tokens_buckets(max_model_len), name
            else:
                assert got["buckets"] == want["buckets"], name
        assert got["label_values"] == want.get("label_values", {}), name


def test_vllm_series_count_what_vllm_counts(make_server) -> None:
    """The vllm: series after a known workload: each sequence counted as vLLM counts its child requests, the
    prompt once, the kvlab: copies equal to their twins."""
    srv, http = make_server()
    for p in PROMPTS:
        complete(http, p)
    complete(http, PROMPTS[0])  # the repeated prompt hits the cache
    complete(http, "fork", n=2, temperature=1.0, seed=5, max_tokens=3)

    def vllm_metrics() -> dict[str, float]:
        out = {}
        for fam in http.metric_families():
            for s in fam.samples:
                if s.name.startswith("vllm:"):
                    assert s.labels["engine"] == "0"
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("model_name",
                                      "engine"))  # fmt: skip
                    out[s.name.removeprefix("vllm:") + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    v, k = vllm_metrics(), http.metrics()
    prompts = [len(p.encode()) for p in [*PROMPTS, PROMPTS[0], "fork"]]
    sequences = len(PROMPTS) + 1 + 2
    generated = (len(PROMPTS) + 1) * MAX_TOKENS + 2 * 3
    assert v["prompt_tokens_total"] == k["prompt_tokens_total"] == sum(prompts)
    cached = v['prompt_tokens_by_source_total{source="local_cache_hit"}']
    assert cached == v["prompt_tokens_cached_total"] > 0
    assert v['prompt_tokens_by_source_total{source="local_compute"}'] == sum(prompts) - cached
    assert v['prompt_tokens_by_source_total{source="external_kv_transfer"}'] == 0
    assert v['prompt_tokens_cached_by_source_total{source="device"}'] == v["prefix_cache_hits_total"]
    assert v["generation_tokens_total"] == k["generation_tokens_total"] == generated
    assert v['request_success_total{finished_reason="length"}'] == sequences
    assert v['request_success_total{finished_reason="repetition"}'] == 0
    assert v["prefix_cache_hits_total"] == k["prefix_cache_hits_total"] == srv.loop.stats.prefix_cache_hits
    # Per sequence, as vLLM's child requests: TTFT, e2e, the phases, tokens, preemptions.
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
              "request_time_per_output_token_seconds", "request_generation_tokens", "request_num_preemptions",
              "request_params_max_tokens"):  # fmt: skip
        assert v[f"{h}_count"] == sequences, h
    assert v["request_generation_tokens_sum"] == generated
    assert v["request_params_max_tokens_sum"] == (len(PROMPTS) + 1) * MAX_TOKENS + 2 * 3
    assert v["request_num_preemptions_sum"] == 0
    assert v["inter_token_latency_seconds_count"] == k["time_per_output_token_seconds_count"] == generated - sequences
    assert v["inter_token_latency_seconds_sum"] == k["time_per_output_token_seconds_sum"]
    assert v["time_to_first_token_seconds_sum"] == k["time_to_first_token_seconds_sum"]
    # Per request: the prompt (computed once for n sequences), n and the longest sequence.
    assert v["request_prompt_tokens_count"] == v["request_params_n_count"] == len(PROMPTS) + 2
    assert v["request_prompt_tokens_sum"] == sum(prompts)
    assert v["request_prefill_kv_computed_tokens_sum"] == sum(prompts) - cached
    assert v["request_params_n_sum"] == len(PROMPTS) + 1 + 2
    assert v["request_max_num_generation_tokens_sum"] == (len(PROMPTS) + 1) * MAX_TOKENS + 3
    assert v['engine_sleep_state{sleep_state="awake"}'] == 1
    assert v['engine_sleep_state{sleep_state="discard_all"}'] == 0
    assert v['num_requests_waiting_by_reason{reason="capacity"}'] == v["num_requests_waiting"] == 0
    assert v["kv_cache_usage_perc"] == k["kv_cache_usage_perc"] == 0.0


def test_http_series_count_requests_by_handler_method_and_status_as_vllms_dashboards_read_them(make_server) -> None:
    """vLLM's http_* series (prometheus-fastapi-instrumentator's defaults): requests by route template, method
    and status class, their durations and sizes; probes and /metrics left out as vLLM leaves them; behind the
    metrics key like every other series."""
    _, http = make_server(api_keys={"sk-a": "alice"}, metrics_api_key="sk-ops")
    http.metrics_key = "sk-ops"
    auth = {"Authorization": "Bearer sk-a"}
    for prompt in PROMPTS[:2]:
        status, _ = http.post("/v1/completions", {"model": "mini", "prompt": prompt, "max_tokens": 2}, auth)
        assert status == 200
    assert http.post("/v1/completions", {"model": "mini", "prompt": "x", "max_tokens": -1}, auth)[0] == 400
    assert http.post("/v1/completions", {"model": "mini", "prompt": "x"})[0] == 401  # no key
    assert http.get("/health")[0] == http.get("/ping")[0] == 200
    fam = families(http)
    counts = {
        (s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
        for s in fam["http_requests"].samples
        if s.name == "http_requests_total"
    }
    assert counts[("/v1/completions", "POST", "2xx")] == 2
    assert counts[("/v1/completions", "POST", "4xx")] == 2
    assert not {h for h, _, _ in counts} & {"/health", "/ping", "/metrics"}
    duration = {s.labels.get("handler"): s.value for s in fam["http_request_duration_seconds"].samples
                if s.name.endswith("_count")}  # fmt: skip
    assert duration["/v1/completions"] == 4
    assert fam["http_request_duration_seconds"].type == "histogram"
    assert fam["http_request_size_bytes"].type == fam["http_response_size_bytes"].type == "summary"
    # A tenant's key does not open them: they are in the same registry as the vllm: series.
    assert http.get("/metrics", auth)[0] == 401
