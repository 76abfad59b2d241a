"""/metrics tells no client more than its own responses unless the operator says so (issue "No request may
buy the engine", item 3); /docs, /openapi.json and /version need a key on keyed servers; /health never does."""

from __future__ import annotations

import itertools
import json
import logging
import re

import httpx
import pytest

from server.server_http import Http

KEYS = {"key-a": "a", "key-b": "b"}
METRICS = "the-metrics-key"
ABOUT = ("/docs", "/openapi.json", "/version", "/docs/oauth2-redirect")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_of(text: str) -> dict[str, str | None]:
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_metrics_without_a_key_is_open_only_where_it_reveals_nothing_more(make_server) -> None:
    _, http = make_server(metrics_api_key=None)  # the defaults: block reports, per-tenant sharing, no keys
    status, text = http.get("/metrics")
    assert status == 403, text
    err = error_of(text)
    assert err["type"] == "permission_error" and err["code"] == "metrics_closed"
    assert "--metrics-api-key" in err["message"] and "--public-metrics" in err["message"]
    assert "cached tokens" in err["message"], "it says what the counter would reveal"
    for kw in ({"report_cached_tokens": "exact"}, {"prefix_sharing": "off"}):
        _, open_ = make_server(metrics_api_key=None, **kw)
        status, text = open_.get("/metrics")
        assert status == 200 and "kvlab:prefix_cache_hits_total" in text, kw
    _, keyed = make_server(metrics_api_key=None, api_keys=KEYS, report_cached_tokens="exact")
    status, text = keyed.get("/metrics", bearer("key-a"))
    assert status == 403 and "API key" in error_of(text)["message"], "other tenants' traffic: closed"


def test_the_metrics_key_opens_metrics_and_nothing_else(make_server) -> None:
    _, http = make_server(api_keys=KEYS, metrics_api_key=METRICS)
    for headers in (None, bearer("wrong"), bearer("key-a"), {"Authorization": f"Basic {METRICS}"}):
        status, text = http.get("/metrics", headers)
        assert status == 401, (headers, text)
        err = error_of(text)
        assert err["type"] == "authentication_error" and METRICS not in err["message"]
    status, text = http.get("/metrics", bearer(METRICS))
    assert status == 200 and "kvlab:prefix_cache_hits_total" in text
    assert http.get("/v1/models", bearer(METRICS))[0] == 401
    body = {"model": "mini", "prompt": "hi", "max_tokens": 1}
    assert http.post("/v1/completions", body, bearer(METRICS))[0] == 401
    assert http.post("/v1/completions", body, bearer("key-a"))[0] == 200


def test_docs_openapi_and_version_need_a_key_on_keyed_servers(make_server) -> None:
    _, http = make_server(api_keys=KEYS, metrics_api_key=METRICS)
    for path in ABOUT:
        status, text = http.get(path)
        assert status == 401 and error_of(text)["code"] == "invalid_api_key", (path, text)
        assert http.get(path, bearer("wrong"))[0] == 401, path
        assert http.get(path, bearer("key-b"))[0] == 200, path
        assert http.get(path, bearer(METRICS))[0] == 200, path
    assert json.loads(http.get("/openapi.json", bearer("key-a"))[1])["paths"]
    assert http.get("/health") == (200, '{"status": "ok"}'), "load balancers need no key"
    _, keyless = make_server()
    for path in ABOUT:
        assert keyless.get(path)[0] == 200, path


def test_public_metrics_is_open_and_says_what_it_reveals(make_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvlab.server.serve")
    _, http = make_server(report_cached_tokens="off", public_metrics=True)
    assert http.get("/metrics")[0] == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("--public-metrics" in w and "cached tokens" in w for w in warnings), warnings
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tenancy:")]
    assert lines and "/metrics is open to anyone (--public-metrics): it reveals" in lines[-1]
    caplog.clear()
    make_server(report_cached_tokens="exact", public_metrics=True)  # reveals nothing more: nothing to warn of
    assert not [r for r in caplog.records if r.levelno == logging.WARNING and "public-metrics" in r.getMessage()]


# ------------------------------------------------------------------ the issue's reproducer
SECRET_PROMPT = "123456 Memo for the ops team only, never share: the vault combination for building C is "[:78]


def reproducer(base_url: str, alphabet: str) -> tuple[int, str | None]:
    """The issue's attack, as it was posted, with a smaller alphabet: (the status of its first GET /metrics,
    the secret's first two characters if it recovered them)."""
    c = httpx.Client(base_url=base_url)
    pre = SECRET_PROMPT
    c.post("/v1/completions", json={"model": "mini", "prompt": pre + "kbajcafh -- summarise.", "max_tokens": 2})
    first = c.get("/metrics").status_code
    if first != 200:
        return first, None

    def hits() -> float:
        found = re.search(r"^kvlab:prefix_cache_hits_total\{.*\} (\S+)$", c.get("/metrics").text, re.M)
        assert found is not None
        return float(found[1])

    for g in map("".join, itertools.product(alphabet, repeat=2)):
        h0 = hits()
        c.post("/v1/completions", json={"model": "mini", "prompt": pre + g + "qwxzyqwxzyqwxzyqwxzy", "max_tokens": 1})
        if hits() - h0 >= 80:
            return first, g
    return first, None


@pytest.mark.parametrize("public", [False, True])
def test_the_issues_reproducer(make_server, public: bool) -> None:
    """Regression: with cached_tokens off, the hit counter's delta around one's own request gave the secret
    away. Closed by default (403); the operator's --public-metrics reopens it, and then it works (the control)."""
    _, http = make_server(report_cached_tokens="off", metrics_api_key=None, public_metrics=public)
    assert reproducer(http.base_url, "abjk") == ((200, "kb") if public else (403, None))


def test_test_servers_scrape_with_their_metrics_key(http: Http) -> None:
    """The suite's servers (conftest) hold a metrics key, as an operator's scraper would: /metrics is closed to
    every other request, and Http.metrics() reads it."""
    assert http.metrics_key and http.get("/metrics")[0] == 401
    assert "prefix_cache_hits_total" in http.metrics()
