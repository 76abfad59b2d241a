"""``server.access`` without a server: each refusal's status, message and code, and the ``KeyRequired``
middleware called as ASGI. Written for the mutants of issue 40 the HTTP tests let live (docs/mutation-survivors.md):
which pages need a key, and the words a client reads when it has none, are the access rule itself."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.datastructures import Headers

from kvlab.server.access import KeyRequired, authorization, check_metrics, tenant_of
from kvlab.server.errors import APIError
from kvlab.server.tenancy import TenancyPolicy

KEYED = TenancyPolicy(api_keys={"ka": "a", "kb": "b"}, metrics_api_key="km")


def headers(*values: str) -> Headers:
    return Headers(raw=[(b"authorization", v.encode()) for v in values])


def refusal(call: Any) -> tuple[int, str, str | None, str | None]:
    with pytest.raises(APIError) as err:
        call()
    return err.value.status, err.value.message, err.value.param, err.value.code


def test_the_one_authorization_header() -> None:
    assert authorization(headers()) is None
    assert authorization(headers("Bearer ka")) == "Bearer ka"
    assert refusal(lambda: authorization(headers("Bearer ka", "Bearer kb"))) == (
        400, "the Authorization header is given more than once", None, "invalid_authorization",
    )  # fmt: skip


def test_the_tenant_is_the_key_s() -> None:
    assert tenant_of(KEYED, headers("Bearer kb")) == "b"
    assert refusal(lambda: tenant_of(KEYED, headers("Bearer nope"))) == (
        401, "the API key is not valid", None, "invalid_api_key",
    )  # fmt: skip
    assert refusal(lambda: tenant_of(KEYED, headers()))[::3] == (401, "invalid_api_key")
    assert refusal(lambda: tenant_of(KEYED, headers("Bearer ka", "Bearer ka")))[0] == 400


def test_metrics_refusals_are_401_for_a_key_and_403_for_a_closed_page() -> None:
    check_metrics(KEYED, headers("Bearer km"))
    assert refusal(lambda: check_metrics(KEYED, headers("Bearer ka"))) == (
        401, "the metrics API key is not valid", None, "invalid_api_key",
    )  # fmt: skip
    closed = TenancyPolicy(api_keys={"ka": "a"})
    status, message, param, code = refusal(lambda: check_metrics(closed, headers("Bearer ka")))
    assert (status, param, code) == (403, None, "metrics_closed") and message.startswith("/metrics is closed")
    assert refusal(lambda: check_metrics(KEYED, headers("Bearer km", "Bearer km")))[0] == 400


class App:
    """The inner ASGI app: records that it was reached and answers 200."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(policy: TenancyPolicy, path: str, *auth: str, kind: str = "http") -> tuple[int, Any, int]:
    inner = App()
    middleware = KeyRequired(inner, frozenset({"/docs", "/version"}), policy)
    sent: list[dict[str, Any]] = []
    raw = [(b"authorization", a.encode()) for a in auth]
    scope = {"type": kind, "path": path, "headers": raw, "method": "GET", "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    status = sent[0]["status"] if sent else 0
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, (json.loads(body) if body and body != b"ok" else body), inner.calls


def test_the_listed_pages_need_any_valid_key() -> None:
    for key in ("Bearer ka", "Bearer kb", "Bearer km"):
        assert call(KEYED, "/docs", key) == (200, b"ok", 1)
    status, body, reached = call(KEYED, "/version", "Bearer wrong")
    assert (status, reached) == (401, 0)
    assert body == {
        "error": {
            "message": "the API key is not valid", "type": "authentication_error", "param": None,
            "code": "invalid_api_key",
        }
    }  # fmt: skip
    status, body, reached = call(KEYED, "/docs")
    assert (status, reached, body["error"]["code"]) == (401, 0, "invalid_api_key")
    status, body, reached = call(KEYED, "/docs", "Bearer ka", "Bearer ka")
    assert (status, reached) == (400, 0)
    assert body["error"] == {
        "message": "the Authorization header is given more than once", "type": "invalid_request_error",
        "param": None, "code": "invalid_authorization",
    }  # fmt: skip


def test_other_pages_and_other_scopes_pass_through() -> None:
    assert call(KEYED, "/v1/models") == (200, b"ok", 1)  # the route checks its own key
    assert call(KEYED, "/docs", kind="websocket")[2] == 1
    assert call(TenancyPolicy(), "/docs") == (200, b"ok", 1)  # no keys: nothing to show
