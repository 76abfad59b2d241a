"""/metrics as vLLM's dashboards read it (issue 13): parsed with prometheus_client's own parser, checked
after a known workload, label values escaped by the library and never chosen by a client; and the KV
capacity line the server logs at start."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from conftest import Http
from kvlab.server.metrics import FINISHED_REASONS
from kvlab.server.serve import ServerConfig, build_app

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
        usage = http.metrics()["kv_cache_usage_perc"]
        engine_percent = server.loop.stats.kv_cache_usage_perc
        assert 0 < usage <= 1 and usage == pytest.approx(engine_percent / 100)
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
    labels: dict[str, set[str]] = {}
    for family in http.metric_families():
        assert family.name.startswith("kvlab:"), family.name
        for sample in family.samples:
            for key, value in sample.labels.items():
                labels.setdefault(key, set()).add(value)
    assert set(labels) <= {"model_name", "finished_reason", "le"}
    assert labels["model_name"] == {name}, "the parser read back the exact name: it was escaped"
    assert labels["finished_reason"] == set(FINISHED_REASONS)


def test_startup_logs_the_kv_capacity_and_warns_when_one_request_cannot_fit(caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvlab.server.serve")
    app = build_app(ServerConfig(port=0))
    lines = [r for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    nbytes = app.state.engine_loop.engine.storage.nbytes()
    assert (
        "256 blocks x 16 tokens = 4096 tokens" in lines[0].getMessage() and f"({nbytes} bytes)" in lines[0].getMessage()
    )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "KV cache" in r.getMessage()]
    caplog.clear()
    build_app(ServerConfig(port=0, cache={"num_blocks": 16}, scheduler={"max_model_len": 512}))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cannot hold one request of max_model_len=512" in w for w in warnings), warnings
