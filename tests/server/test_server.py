"""The OpenAI-compatible server: correctness under concurrency, disconnects, errors, salts, metrics."""

from __future__ import annotations

import http.client as http_client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvlab import LLM, SamplingParams

POLL_LIMIT = 30.0  # safety bound on polling loops


def _wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + POLL_LIMIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _sse(raw: str) -> list[dict | str]:
    events = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_health_models_metrics(http) -> None:
    assert http.get("/health") == (200, '{"status": "ok"}')
    status, body = http.get("/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["mini"]
    m = http.metrics()
    for name in (
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "num_requests_running",
        "num_requests_waiting",
    ):
        assert name in m, f"kvlab:{name} missing from /metrics"


def test_openai_client_completes_and_streams(server) -> None:
    openai = pytest.importorskip("openai", reason="the openai package is not installed in this venv")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
    full = client.completions.create(model="mini", prompt="The passphrase is", max_tokens=8, temperature=0)
    streamed = client.completions.create(
        model="mini", prompt="The passphrase is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    chat = client.chat.completions.create(
        model="mini", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_stream_matches_non_stream(http) -> None:
    body = {"model": "mini", "prompt": "Stream me: the passphrase is", "max_tokens": 12, "temperature": 0}
    status, full = http.post("/v1/completions", body)
    assert status == 200 and full["choices"][0]["finish_reason"] == "length"
    status, raw = http.post("/v1/completions", {**body, "stream": True})
    assert status == 200
    events = _sse(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1, "a 12-token answer should arrive in several events"
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    chat = {"model": "mini", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    status, full = http.post("/v1/chat/completions", chat)
    assert status == 200 and full["object"] == "chat.completion"
    status, raw = http.post("/v1/chat/completions", {**chat, "stream": True})
    chunks = _sse(raw)[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]


def test_100_concurrent_clients_match_offline_generate(server, http) -> None:
    words = ["amber", "silver", "violet", "cobalt", "scarlet", "ivory", "jade", "onyx", "coral", "slate"]
    prompts = [
        f"Keep this secret. The passphrase of client {i} is {words[i % 10]} {words[i // 10]}" for i in range(100)
    ]
    params = SamplingParams(temperature=0, max_tokens=10)
    expected = [o.token_ids for o in LLM("mini").generate(prompts, params, use_tqdm=False)]
    assert len({tuple(e) for e in expected}) >= 30, "the prompts should give many distinct answers"

    def ask(p: str) -> list[int]:
        status, body = http.post("/v1/completions", {"model": "mini", "prompt": p, "max_tokens": 10, "temperature": 0})
        assert status == 200, body
        return body["choices"][0]["token_ids"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=100) as pool:
        got = list(pool.map(ask, prompts))
    elapsed = time.perf_counter() - t0
    print(f"\n100 concurrent clients: {100 / elapsed:.1f} requests/s ({elapsed:.2f}s)")
    mismatched = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert not mismatched, f"{len(mismatched)} clients got other tokens than offline generate: {mismatched[:10]}"
    _wait_until(lambda: http.metrics()["kv_cache_usage_perc"] == 0.0, "the pool to drain")


def test_disconnect_aborts_and_frees_blocks(server, http) -> None:
    _wait_until(lambda: http.metrics()["num_requests_pending"] == 0, "an idle server")
    steps_before = server.loop.stats.steps
    max_tokens = 480
    sock = http.open_stream(
        {
            "model": "mini",
            "prompt": "A long answer, please:",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
    )
    try:
        assert http.metrics()["kv_cache_usage_perc"] > 0, "a running request holds blocks"
    finally:
        sock.close()
    _wait_until(lambda: http.metrics()["num_requests_pending"] == 0, "the aborted request to be released")
    m = http.metrics()
    assert m["kv_cache_usage_perc"] == 0.0 and m["num_requests_running"] == 0
    # Ran to completion it would have taken max_tokens steps: fewer means it was aborted.
    assert server.loop.stats.steps - steps_before < max_tokens - 50
    assert http.post("/v1/completions", {"model": "mini", "prompt": "still here?", "max_tokens": 2})[0] == 200


def test_non_stream_disconnect_is_aborted(server, http) -> None:
    import socket

    steps_before = server.loop.stats.steps
    host, port = server.base_url.removeprefix("http://").split(":")
    data = json.dumps({"model": "mini", "prompt": "x", "max_tokens": 480, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        # HTTP/1.1 requires Host: h11 answers 400 without it.
        # Content-Type too: a /v1 POST that is not application/json is refused (a cross-site form post).
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data)
        _wait_until(lambda: http.metrics()["num_requests_running"] > 0, "the request to start")
    _wait_until(lambda: http.metrics()["num_requests_pending"] == 0, "the aborted request to be released")
    assert http.metrics()["kv_cache_usage_perc"] == 0.0
    assert server.loop.stats.steps - steps_before < 430


LONG = "x" * 600  # the mini model's byte tokenizer: 600 tokens > max_model_len 512
BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "mini", "prompt": ', {}, 400),
    ("not an object", "/v1/completions", [1, 2], {}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, {}, 404),
    ("missing model", "/v1/completions", {"prompt": "hi"}, {}, 400),
    ("max_tokens string", "/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": "5"}, {}, 400),
    ("max_tokens bool", "/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": True}, {}, 400),
    ("prompt number", "/v1/completions", {"model": "mini", "prompt": 5}, {}, 400),
    ("temperature string", "/v1/completions", {"model": "mini", "prompt": "hi", "temperature": "hot"}, {}, 400),
    ("negative temperature", "/v1/completions", {"model": "mini", "prompt": "hi", "temperature": -1}, {}, 400),
    ("negative max_tokens", "/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": -3}, {}, 400),
    ("NaN temperature", "/v1/completions", b'{"model": "mini", "prompt": "hi", "temperature": NaN}', {}, 400),
    ("huge seed", "/v1/completions", {"model": "mini", "prompt": "hi", "seed": 2**80}, {}, 400),
    ("zero max_tokens", "/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": 0}, {}, 400),
    ("prompt too long", "/v1/completions", {"model": "mini", "prompt": LONG}, {}, 400),
    ("empty prompt", "/v1/completions", {"model": "mini", "prompt": ""}, {}, 400),
    ("token id out of vocab", "/v1/completions", {"model": "mini", "prompt": [1, 99999]}, {}, 400),
    ("messages missing", "/v1/chat/completions", {"model": "mini"}, {}, 400),
    (
        "message content number",
        "/v1/chat/completions",
        {"model": "mini", "messages": [{"role": "user", "content": 1}]},
        {},
        400,
    ),
    ("salt number", "/v1/completions", {"model": "mini", "prompt": "hi", "cache_salt": 7}, {}, 400),
    ("salt empty", "/v1/completions", {"model": "mini", "prompt": "hi", "cache_salt": ""}, {}, 400),
    ("salt too long", "/v1/completions", {"model": "mini", "prompt": "hi", "cache_salt": "s" * 300}, {}, 400),
    ("salt non-ASCII", "/v1/completions", {"model": "mini", "prompt": "hi", "cache_salt": "租户"}, {}, 400),
    ("header salt too long", "/v1/completions", {"model": "mini", "prompt": "hi"}, {"X-Cache-Salt": "h" * 300}, 400),
    ("stream not bool", "/v1/completions", {"model": "mini", "prompt": "hi", "stream": "yes"}, {}, 400),
    ("unknown route", "/v1/embeddings", {"model": "mini", "input": "hi"}, {}, 404),
    ("body too large", "/v1/completions", b" " * (4 * 1024 * 1024 + 1), {}, 413),
]


@pytest.mark.parametrize(("what", "path", "body", "headers", "status"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_rejected_and_server_keeps_serving(http, what, path, body, headers, status) -> None:
    got, err = http.post(path, body, headers)
    assert got == status, f"{what}: {err}"
    assert isinstance(err, dict) and set(err["error"]) >= {"message", "type", "param", "code"}, err
    assert err["error"]["message"], "the error must say what is wrong"
    ok, body_ok = http.post("/v1/completions", {"model": "mini", "prompt": "ok?", "max_tokens": 2})
    assert ok == 200, body_ok
    assert http.metrics()["num_requests_pending"] == 0, "a rejected request must not stay in flight"


def test_route_errors_have_the_openai_shape(http) -> None:
    """Starlette's own 404 and 405 (and ReDoc, which is off; /docs and /openapi.json are on) answer like every
    other error."""
    for method, path, status in [
        ("GET", "/v1/completions", 405),
        ("DELETE", "/health", 405),
        ("DELETE", "/docs", 405),
        ("GET", "/nowhere", 404),
        ("GET", "/redoc", 404),
    ]:
        req = urllib.request.Request(http.base_url + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=60)
        err = json.loads(info.value.read())
        assert info.value.code == status and info.value.headers["Content-Type"] == "application/json", (path, err)
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        assert path in err["error"]["message"]
        if status == 405:
            assert method not in info.value.headers["Allow"]


def test_keep_alive_connection_serves_several_requests(http) -> None:
    host, port = http.base_url.removeprefix("http://").split(":")
    conn = http_client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "mini", "prompt": "keep me alive", "max_tokens": 3, "temperature": 0}
    answers, sockets = [], []
    try:
        for method, path, payload in [
            ("POST", "/v1/completions", body),
            ("POST", "/v1/completions", {**body, "stream": True}),
            ("GET", "/health", None),
        ]:
            data = json.dumps(payload).encode() if payload else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            answers.append(resp.read().decode())
            assert resp.status == 200, answers[-1]
            sockets.append(conn.sock)  # http.client drops its socket when the server says it will close
    finally:
        conn.close()
    assert sockets[0] is not None and all(s is sockets[0] for s in sockets), "the connection was not reused"
    events = _sse(answers[1])
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == json.loads(answers[0])["choices"][0]["text"]


def test_full_queue_answers_429(make_server) -> None:
    _, http = make_server(max_pending=2)
    body = {"model": "mini", "prompt": "hold the line", "max_tokens": 480, "ignore_eos": True}
    socks = [http.open_stream(body), http.open_stream(body)]
    try:
        status, err = http.post("/v1/completions", {"model": "mini", "prompt": "one more", "max_tokens": 2})
        assert status == 429, err
        assert err["error"]["type"] == "rate_limit_error"
    finally:
        for s in socks:
            s.close()
    _wait_until(lambda: http.metrics()["num_requests_pending"] == 0, "the streams to be aborted")
    assert http.post("/v1/completions", {"model": "mini", "prompt": "one more", "max_tokens": 2})[0] == 200


def test_same_salt_hits_different_salt_misses(make_server) -> None:
    _, http = make_server(trust_salt_header=True)
    # A first character no other test's prompt starts with: with token-granular matching, any shared first
    # byte in the unsalted namespace (which the other tests of this module share) would be a 1-token hit.
    prompt = "\u2603 Tenant data, 64 bytes long at least: the quarterly numbers are in. "

    def hits(salt: str | None = None, header: str | None = None, body_salt: str | None = None) -> float:
        before = http.metrics()["prefix_cache_hits_total"]
        body = {"model": "mini", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        if body_salt or salt:
            body["cache_salt"] = body_salt or salt
        status, resp = http.post("/v1/completions", body, {"X-Cache-Salt": header} if header else None)
        assert status == 200, resp
        return http.metrics()["prefix_cache_hits_total"] - before

    assert hits("tenant-a") == 0, "a fresh prompt cannot hit"
    assert hits("tenant-a") > 0, "the same salt must share the prefix cache"
    assert hits("tenant-b") == 0, "another salt must not see tenant-a's cache"
    assert hits(None) == 0, "no salt is a namespace of its own"
    # The header (set by a trusted proxy) wins over the body.
    assert hits(header="tenant-a", body_salt="tenant-c") > 0
    assert hits(header="tenant-d", body_salt="tenant-a") == 0


def test_listening_socket_is_tcp_so_responses_are_not_delayed() -> None:
    """Regression: create_server's proto=0 made asyncio skip TCP_NODELAY, and every keep-alive response
    waited ~40 ms for the client's delayed ACK."""
    import socket

    from kvlab.server.serve import listen

    sock = listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_seed_gives_one_reproducible_sampling_stream_and_none_a_stream_per_request(make_server) -> None:
    """vllm serve's --seed: requests without a seed of their own draw from one stream, the same after a
    restart; without it (kvlab's default) the engine has no shared stream, so no request's draws move
    another tenant's."""
    body = {"model": "mini", "prompt": "Sampled without a seed", "max_tokens": 8, "temperature": 1.0}
    texts = []
    for _ in range(2):
        srv, http = make_server(seed=3)
        assert srv.loop.engine.generator is not None
        status, resp = http.post("/v1/completions", body)
        assert status == 200, resp
        texts.append(resp["choices"][0]["text"])
        srv.stop()
    assert texts[0] == texts[1]
    srv, _ = make_server()
    assert srv.loop.engine.generator is None
