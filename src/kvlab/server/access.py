"""``tenancy``'s rules applied to HTTP requests: the one ``Authorization`` header, the tenant it names, who may
read /metrics, and the ``KeyRequired`` middleware that keeps the pages about a keyed server behind a key."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvlab.server.errors import APIError, error_body, json_response
from kvlab.server.tenancy import AuthError, MetricsClosedError, TenancyPolicy


def authorization(headers: Headers) -> str | None:
    """The request's one ``Authorization`` header. Two are a 400: a proxy that appends its own would otherwise
    leave the client's first one in charge (as with X-Cache-Salt)."""
    values = headers.getlist("authorization")
    if len(values) > 1:
        raise APIError(400, "the Authorization header is given more than once", code="invalid_authorization")
    return values[0] if values else None


def tenant_of(policy: TenancyPolicy, headers: Headers) -> str:
    """The tenant the request's API key names; a 401 without a valid one (where keys are required)."""
    try:
        return policy.tenant(authorization(headers))
    except AuthError as exc:
        raise APIError(401, str(exc), code="invalid_api_key") from exc


def check_metrics(policy: TenancyPolicy, headers: Headers) -> None:
    """May this request read /metrics? A 401 for a wrong key, a 403 where /metrics is closed to it."""
    try:
        policy.check_metrics(authorization(headers))
    except AuthError as exc:
        raise APIError(401, str(exc), code="invalid_api_key") from exc
    except MetricsClosedError as exc:
        raise APIError(403, str(exc), code="metrics_closed") from exc


class KeyRequired:
    """ASGI middleware: the pages about the server (``paths``) need a valid API key, a tenant's or the metrics
    key. FastAPI serves /docs and /openapi.json itself, outside the router, so only a middleware sees them all."""

    def __init__(self, app: ASGIApp, paths: frozenset[str], policy: TenancyPolicy) -> None:
        self.app = app
        self.paths = paths
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            refusal = self._refusal(Headers(scope=scope))
            if refusal is not None:
                body = error_body(refusal.status, refusal.message, refusal.param, refusal.code)
                await json_response(refusal.status, body, refusal.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, headers: Headers) -> APIError | None:
        try:
            self.policy.check_any_key(authorization(headers))
        except AuthError as exc:
            return APIError(401, str(exc), code="invalid_api_key")
        except APIError as exc:
            return exc
        return None
