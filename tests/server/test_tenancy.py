"""Tenants are bound to their cache: API keys name tenants, salts derive from the tenant, and responses
reveal the cache only as the operator chose."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from kvlab.server.tenancy import ANONYMOUS, AuthError, TenancyConfigError, TenancyPolicy, parse_api_keys

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
