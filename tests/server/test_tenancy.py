"""Tenants are bound to their cache: API keys name tenants, salts derive from the tenant, and responses
reveal the cache only as the operator chose."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.server.tenancy import (
    ANONYMOUS,
    AuthError,
    MetricsClosedError,
    TenancyConfigError,
    TenancyPolicy,
    parse_api_keys,
)

# 64+ bytes so that four full blocks of 16 are cached; a first character no other test module uses.
PROMPT = "\u2602 Tenant A's system prompt: the launch code is 7741, never reveal it to anyone. "
KEYS = {"key-a": "a", "key-a2": "a", "key-b": "b"}


def _ask(http, key: str | None = None, salt: str | None = None, prompt: str = PROMPT) -> tuple[int, dict]:
    body = {"model": "mini", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    return http.post("/v1/completions", body, {"Authorization": f"Bearer {key}"} if key else None)


def _cached(http, **kw) -> int:
    status, body = _ask(http, **kw)
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_per_tenant_sharing_never_crosses_tenants(make_server) -> None:
    _, http = make_server(api_keys=KEYS, report_cached_tokens="exact")
    assert _cached(http, key="key-a") == 0
    assert _cached(http, key="key-a") > 0, "a tenant shares its own prefix"
    assert _cached(http, key="key-a2") > 0, "two keys of one tenant share"
    assert _cached(http, key="key-b") == 0, "another tenant never sees tenant a's entries"
    # A client salt only narrows inside the tenant: no salt spells another tenant's namespace.
    assert _cached(http, key="key-b", salt=json.dumps(["a", None])) == 0
    assert _cached(http, key="key-b", salt="a") == 0
    assert _cached(http, key="key-a", salt="narrow") == 0
    assert _cached(http, key="key-a", salt="narrow") > 0


def test_keys_are_required_and_checked(make_server) -> None:
    _, http = make_server(api_keys=KEYS)
    for key in (None, "wrong"):
        status, body = _ask(http, key=key)
        assert status == 401, body
        assert body["error"]["code"] == "invalid_api_key"
        assert "key-a" not in json.dumps(body)
    status, _ = http.get("/v1/models")
    assert status == 401
    assert http.get("/health")[0] == 200
    req = urllib.request.Request(http.base_url + "/v1/models", headers={"Authorization": "Bearer key-b"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


def test_global_sharing_crosses_keys_and_off_shares_nothing(make_server) -> None:
    _, glob = make_server(api_keys=KEYS, prefix_sharing="global", report_cached_tokens="exact")
    assert _cached(glob, key="key-a") == 0
    assert _cached(glob, key="key-b") > 0  # the operator chose to share with everyone
    srv, off = make_server(prefix_sharing="off", report_cached_tokens="exact")
    assert _cached(off) == 0 and _cached(off) == 0
    assert srv.engine.stats().prefix_cache_hits == 0


@pytest.mark.parametrize("mode", ["exact", "block", "off"])
def test_cached_tokens_are_reported_as_configured(make_server, mode: str) -> None:
    srv, http = make_server(report_cached_tokens=mode)
    bs = srv.engine.cache_config.block_size
    prompt = f"{mode} " + "T" * (3 * bs)  # 3 full blocks + a few tokens (byte tokenizer: a token per byte)
    _ask(http, prompt=prompt)
    status, body = _ask(http, prompt=prompt)
    assert status == 200
    exact = len(prompt) - 1  # everything but the recomputed last token
    if mode == "off":
        assert "prompt_tokens_details" not in body["usage"]
    else:
        want = exact if mode == "exact" else exact // bs * bs
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == want


def test_x_cache_salt_needs_trust_and_may_appear_once(make_server) -> None:
    _, http = make_server()
    body = {"model": "mini", "prompt": "hello", "max_tokens": 1}
    status, resp = http.post("/v1/completions", body, {"X-Cache-Salt": "t1"})
    assert status == 400 and "trust-salt-header" in resp["error"]["message"]
    _, trusting = make_server(trust_salt_header=True)
    # urllib folds repeated headers; send two on a raw request.
    raw = _two_salt_headers(trusting.base_url, json.dumps(body).encode())
    assert raw.startswith(b"HTTP/1.1 400"), raw[:100]
    assert b"more than once" in raw
    assert trusting.post("/v1/completions", body, {"X-Cache-Salt": "t1"})[0] == 200


def _two_salt_headers(base_url: str, data: bytes) -> bytes:
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"X-Cache-Salt: proxy-tenant\r\nX-Cache-Salt: client-choice\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + data
        )
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def test_policy_unit() -> None:
    p = TenancyPolicy(api_keys={"k1": "t1"})
    assert p.tenant("Bearer k1") == "t1"
    for bad in (None, "", "Bearer", "Basic k1", "Bearer k2"):
        with pytest.raises(AuthError):
            p.tenant(bad)
    assert TenancyPolicy().tenant(None) == ANONYMOUS
    assert p.cache_salt("t1", None) != p.cache_salt("t2", None)
    assert p.cache_salt("t1", "x") != p.cache_salt("t1", None)
    assert TenancyPolicy(prefix_sharing="global").cache_salt("t1", "x") == "x"
    assert TenancyPolicy(block_size=16).reported_cached_tokens(47) == 32
    assert TenancyPolicy(report_cached_tokens="exact").reported_cached_tokens(47) == 47
    assert TenancyPolicy(report_cached_tokens="off").reported_cached_tokens(47) is None
    with pytest.raises(TenancyConfigError, match="prefix_sharing"):
        TenancyPolicy(prefix_sharing="some")
    with pytest.raises(TenancyConfigError, match="report_cached_tokens"):
        TenancyPolicy(report_cached_tokens="tokens")
    assert "ALL clients" in TenancyPolicy(prefix_sharing="global").describe()
    assert "every client is one tenant" in TenancyPolicy().describe()


def test_parse_api_keys(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# key tenant\nk3 team-x\nk4\n")
    assert parse_api_keys(["k1:alice", "k2"], f) == {"k1": "alice", "k2": "tenant-2", "k3": "team-x", "k4": "tenant-4"}
    with pytest.raises(TenancyConfigError, match="twice"):
        parse_api_keys(["k1", "k1:x"])


@pytest.mark.parametrize(("entries", "error"), [([""], "API key #1 is empty"), (["k1", ":team"], "API key #2 is empty"),
                                               (["k1", "my key:x"], "API key #2 is not one word")])  # fmt: skip
def test_an_empty_or_spaced_key_is_named_by_position_not_by_a_tenant_or_the_key(entries, error) -> None:
    with pytest.raises(TenancyConfigError) as info:
        parse_api_keys(entries)
    assert str(info.value).startswith(error) and "tenant-" not in str(info.value) and "my key" not in str(info.value)


def test_an_automatic_tenant_name_given_explicitly_is_refused(tmp_path: Path) -> None:
    """Regression: "k1" became tenant-1, the name "k2:tenant-1" gives explicitly: two keys, one cache."""
    with pytest.raises(TenancyConfigError, match=r"API key #1 has no tenant.*'tenant-1'.*KEY:TENANT"):
        parse_api_keys(["k1", "k2:tenant-1"])
    f = tmp_path / "keys"
    f.write_text("k3 tenant-2\n")
    with pytest.raises(TenancyConfigError, match="API key #2"):
        parse_api_keys(["k1:a", "k2"], f)  # the file's names count as explicit too
    # Two explicit keys of one tenant are the operator's choice, whatever its name.
    assert parse_api_keys(["k1:tenant-1", "k2:tenant-1"]) == {"k1": "tenant-1", "k2": "tenant-1"}


def test_serve_refuses_tenancy_collisions_before_loading_a_model(monkeypatch) -> None:
    import kvlab.cli.common as common

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded before the tenancy settings were checked")

    monkeypatch.setattr(common, "load_or_exit", refuse)
    monkeypatch.setattr("kvlab.cli.serve.load_or_exit", refuse)
    runner = CliRunner()
    res = runner.invoke(app, ["serve", "mini", "--port", "0", "--api-key", "k1", "--api-key", "k2:tenant-1"])
    assert res.exit_code == 2 and "'tenant-1'" in res.output and "KEY:TENANT" in res.output, res.output
    res = runner.invoke(app, ["serve", "mini", "--port", "0", "--api-key", "k1:a", "--metrics-api-key", "k1"])
    assert res.exit_code == 2 and "metrics API key is also the API key of tenant 'a'" in res.output, res.output
    assert "k1" not in res.output.replace("--api-key", ""), "the key itself is never echoed"
    res = runner.invoke(app, ["serve", "mini", "--port", "0", "--metrics-api-key", "m", "--public-metrics"])
    assert res.exit_code == 2 and "--public-metrics" in res.output, res.output
    help_text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"}).output
    assert "--metrics-api-key" in help_text and "--public-metrics" in help_text


def test_the_metrics_key_is_a_key_of_its_own() -> None:
    with pytest.raises(TenancyConfigError, match="also the API key of tenant 'a'"):
        TenancyPolicy(api_keys={"k1": "a"}, metrics_api_key="k1")
    for bad in ("", "two words"):
        with pytest.raises(TenancyConfigError, match="metrics API key"):
            TenancyPolicy(metrics_api_key=bad)
    with pytest.raises(TenancyConfigError, match="cannot go with --metrics-api-key"):
        TenancyPolicy(metrics_api_key="m", public_metrics=True)
    p = TenancyPolicy(api_keys={"k1": "a"}, metrics_api_key="m")
    p.check_metrics("Bearer m")
    for bad in (None, "Bearer k1", "Bearer x", "Basic m"):  # a tenant's key never opens /metrics
        with pytest.raises(AuthError):
            p.check_metrics(bad)
    with pytest.raises(AuthError):
        p.tenant("Bearer m")  # and the metrics key is nobody's tenant
    p.check_any_key("Bearer m")  # /docs, /openapi.json, /version: any valid key
    p.check_any_key("Bearer k1")
    with pytest.raises(AuthError):
        p.check_any_key("Bearer x")
    TenancyPolicy().check_any_key(None)  # no tenant keys: open


@pytest.mark.parametrize(
    ("kw", "mode"),
    [
        ({}, "closed"),  # block reports hide what the hit counter shows
        ({"report_cached_tokens": "off"}, "closed"),
        ({"prefix_sharing": "global"}, "closed"),
        ({"report_cached_tokens": "exact"}, "open"),
        ({"prefix_sharing": "off"}, "open"),
        ({"report_cached_tokens": "exact", "api_keys": {"k1": "a"}}, "closed"),  # other tenants' traffic
        ({"prefix_sharing": "off", "api_keys": {"k1": "a"}}, "closed"),
        ({"public_metrics": True}, "public"),
        ({"public_metrics": True, "report_cached_tokens": "exact"}, "public"),
        ({"metrics_api_key": "m"}, "key"),
        ({"metrics_api_key": "m", "report_cached_tokens": "exact"}, "key"),
    ],
)
def test_metrics_rule(kw: dict, mode: str) -> None:
    """/metrics without a key is open only where it tells no client more than its own responses."""
    p = TenancyPolicy(**kw)
    access = p.metrics_access()
    assert access.mode == mode
    assert access.reason in p.describe(), "the startup line says what /metrics shows to whom"
    if mode == "closed":
        assert "--metrics-api-key" in access.reason and "--public-metrics" in access.reason
        with pytest.raises(MetricsClosedError, match="--metrics-api-key"):
            p.check_metrics("Bearer anything")
    if mode in ("open", "public"):
        p.check_metrics(None)
    if mode == "open":
        assert access.reveals is None
    if mode == "closed" or (mode == "public" and access.reveals):
        assert access.reveals and access.reveals in access.reason


def _raw(base_url: str, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    """One request on a raw socket (urllib folds repeated headers), the whole answer back."""
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers)
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{head}Connection: close\r\n\r\n".encode())
        sock.sendall(body)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def test_two_authorization_headers_are_refused_on_every_route_that_reads_it(make_server) -> None:
    """Regression: the first of two Authorization headers won; a proxy appending its own would leave the
    client's in charge. Both headers here are valid keys of the route, so only their number is refused."""
    srv, http = make_server(api_keys=KEYS)
    metrics_key = srv.cfg.metrics_api_key
    completion = json.dumps({"model": "mini", "prompt": "hi", "max_tokens": 1}).encode()
    chat = json.dumps({"model": "mini", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).encode()
    tenant = [("Authorization", "Bearer key-a"), ("Authorization", "Bearer key-b")]
    for method, path, headers, body in [
        ("POST", "/v1/completions", tenant, completion),
        ("POST", "/v1/chat/completions", tenant, chat),
        ("GET", "/v1/models", tenant, b""),
        ("POST", "/tokenize", tenant, json.dumps({"prompt": "x"}).encode()),
        ("GET", "/metrics", [("Authorization", f"Bearer {metrics_key}")] * 2, b""),
        ("GET", "/docs", tenant, b""),
        ("GET", "/openapi.json", tenant, b""),
        ("GET", "/version", tenant, b""),
    ]:
        raw = _raw(http.base_url, method, path, headers, body)
        assert raw.startswith(b"HTTP/1.1 400"), (path, raw[:300])
        assert b"Authorization header is given more than once" in raw, (path, raw[-300:])
        # One of them alone is accepted.
        assert _raw(http.base_url, method, path, headers[:1], body).startswith(b"HTTP/1.1 200"), path


def test_a_keyed_server_evicts_fairly_unless_told_otherwise() -> None:
    from kvlab.server.serve import ServerConfig, build_engine

    assert build_engine(ServerConfig()).cache_config.eviction == "lru"  # one tenant: the same order anyway
    assert build_engine(ServerConfig(api_keys={"k": "t"})).cache_config.eviction == "fair"
    chosen = ServerConfig(api_keys={"k": "t"}, cache={"eviction": "lru"})
    assert build_engine(chosen).cache_config.eviction == "lru"


def _usage_cached(client, **create) -> int:
    """The cached prompt tokens of one request, summed over its prompts and samples (the usage is per request)."""
    if "messages" in create:
        out = client.chat.completions.create(model="mini", max_tokens=2, temperature=0, **create)
    else:
        out = client.completions.create(model="mini", max_tokens=2, temperature=0, **create)
    return out.usage.prompt_tokens_details.cached_tokens


def test_every_prompt_of_a_batch_and_every_sample_carries_the_tenants_salt(make_server) -> None:
    """Each of a request's prompts (and each of its n samples, and a chat) is keyed by the tenant: the same
    list sent by another key finds nothing of it, while the sender finds all of it again. (A salt given to the
    first prompt only passed every other test: the rest went to the shared namespace.)"""
    import openai

    srv, _ = make_server(api_keys=KEYS, report_cached_tokens="exact")
    a, b = (
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key=k, timeout=60, max_retries=0) for k in ("key-a", "key-b")
    )
    batch = [f"{i} \u2603 prompt of tenant a's batch, long enough to fill whole blocks of the cache." for i in range(4)]
    assert _usage_cached(a, prompt=batch) == 0
    assert _usage_cached(b, prompt=batch) == 0, "another tenant found a prompt of the batch"
    every = sum(len(p.encode()) - 1 for p in batch)  # all but each prompt's last token (byte tokenizer)
    assert _usage_cached(a, prompt=batch) == every, "the sender finds each prompt of its own batch again"
    sampled = "\u2603 one prompt, four samples, tenant a only: " + "s" * 40
    assert _usage_cached(a, prompt=sampled, n=4) == 0
    assert _usage_cached(b, prompt=sampled, n=4) == 0, "another tenant found a sampled prompt"
    chat = [{"role": "user", "content": "\u2603 tenant a's private chat turn, long enough for blocks: " + "c" * 40}]
    assert _usage_cached(a, messages=chat) == 0
    assert _usage_cached(b, messages=chat) == 0, "another tenant found a chat turn"
    assert _usage_cached(a, messages=chat) > 0
