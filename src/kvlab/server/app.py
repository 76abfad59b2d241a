"""OpenAI-compatible routes over the engine loop, as a FastAPI app: /v1/completions, /v1/chat/completions,
/v1/models, vLLM's /tokenize, /detokenize and /version, /health, /metrics, and the OpenAPI schema at
/openapi.json (browsable at /docs). ``create_app`` is the entry point.

The routes are thin: a body becomes prompts, ``SamplingParams`` and a ``Job`` in ``mapping`` (pure, no HTTP);
the outputs reach the client, whole or as server-sent events, through ``streaming``, which also ends what is
still in flight when the server stops; ``access`` applies ``tenancy``'s rules to the request's headers.

Who may read what (``tenancy``): /health, anyone; /metrics, as ``TenancyPolicy.metrics_access`` decides (the
metrics key, or anyone where it reveals nothing beyond responses, or anyone by the operator's choice); /docs,
/openapi.json and /version, on a keyed server any valid key (``KeyRequired``). A request with two
``Authorization`` headers is a 400 on every route that reads it.

Bodies are pydantic models (``schemas``), validated strictly; no field is silently ignored (see ``schemas``
for the few accepted-and-logged ones). Every refusal gets an OpenAI-style error body ``{"error": {"message",
"type", "param", "code"}}`` with ``param`` naming the offending field, and never reaches the engine; so do
unknown routes and wrong methods (FastAPI's own ``{"detail": ...}`` and 422 bodies never reach a client).
``cache_salt`` (body) or ``X-Cache-Salt`` (header, set by a trusted proxy, so it wins) puts a request's
prefix-cache entries in a namespace of their own. A client that goes away has its request aborted, which
frees its KV blocks at once.

Bad and oversized input costs its sender, not everyone (the checks live in ``guards`` and ``mapping``):
a full server answers 429 (with ``Retry-After``) before reading the body; the body is read by hand, not by
FastAPI, so one over the size limit is refused as it streams in, and only then parsed and validated; a prompt
over the character limit is refused before it is tokenised, which happens on a worker thread, not the
engine's; a body that does not arrive within the read timeout gets a 408; JSON the parser cannot take (deep
nesting, 5,000-digit integers) and numbers no float can hold are 400s; client values are clipped before they
are echoed in a message. When the server stops, requests in flight get a grace period, then an
OpenAI-shaped 503 (a stream: an error event and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_fastapi_instrumentator import Instrumentator
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlab.engine.sampling import InvalidRequestError
from kvlab.server.access import KeyRequired, check_metrics, tenant_of
from kvlab.server.engine_loop import EngineDeadError, EngineLoop, QueueFullError, Slot, TenantBusyError
from kvlab.server.errors import CLIP_CHARS, APIError, error_body, from_validation, json_response
from kvlab.server.guards import (
    BrowserGuard,
    HostAllowList,
    HTTPLimits,
    body_limit,
    bytes_per_token_bound,
    discard_body,
    loads_json,
    read_body,
)
from kvlab.server.mapping import Job, RequestMapper, cache_salt, check_sequences, sampling_field
from kvlab.server.metrics import ServerMetrics
from kvlab.server.openai_format import Formatter
from kvlab.server.schemas import (
    REQUEST_MODELS,
    UNSUPPORTED_HINTS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    RequestBase,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvlab.server.streaming import (
    ENGINE_DOWN,
    SHUTTING_DOWN,
    EventStream,
    Shutdown,
    answer,
    collect,
    events,
    watch_disconnect,
)
from kvlab.server.tenancy import TenancyPolicy

log = logging.getLogger(__name__)

# Seconds a client told 429 (or 503 while the server stops) should wait before retrying.
RETRY_AFTER_S = 1
M = TypeVar("M", bound=RequestBase)


def _version() -> str:
    try:
        return importlib.metadata.version("kvlab")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _retry_later(status: int, message: str, code: str | None = None) -> APIError:
    return APIError(status, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


class OpenAIApp:
    """The routes; ``create_app`` wraps them in a FastAPI app."""

    def __init__(
        self,
        loop: EngineLoop,
        model_name: str,
        policy: TenancyPolicy | None = None,
        max_tokens_default: int = 16,
        limits: HTTPLimits | None = None,
    ) -> None:
        self.policy = policy or TenancyPolicy(block_size=loop.engine.cache_config.block_size)
        self.loop = loop
        self.model_name = model_name
        self.tokenizer = loop.engine.tokenizer
        self.created = int(time.time())
        self.max_model_len = loop.engine.scheduler_config.max_model_len
        self.limits = limits or HTTPLimits()
        # Size limits derived from max_model_len (see bytes_per_token_bound and body_limit): whatever exceeds
        # them could never be served, so it is refused before it costs tokenising or memory.
        self.max_prompt_chars = self.max_model_len * bytes_per_token_bound(self.tokenizer)
        self.max_body_bytes = body_limit(self.max_prompt_chars, self.max_model_len)
        self.mapper = RequestMapper(
            tokenizer=self.tokenizer,
            model_name=model_name,
            max_model_len=self.max_model_len,
            max_prompt_chars=self.max_prompt_chars,
            max_prompts=loop.max_pending,
            vocab_size=loop.engine.loaded.config.vocab_size,
            max_tokens_default=max_tokens_default,
        )
        self.metrics = ServerMetrics(loop, model_name)
        loop.observer = self.metrics.tracker
        self.formatter = Formatter(model_name, self.tokenizer, self.policy.reported_cached_tokens)
        self.shutdown = Shutdown()
        self._ignored_logged: set[str] = set()
        self.router = APIRouter()
        self._add_routes()

    def _add_routes(self) -> None:
        errors: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 503)}
        sse: dict[int | str, dict[str, Any]] = {
            200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events with stream"}
        }
        for method, path, endpoint, response, body in (
            ("GET", "/health", self.health, HealthResponse, None),
            ("GET", "/metrics", self.metrics_text, None, None),
            ("GET", "/version", self.version, VersionResponse, None),
            ("GET", "/v1/models", self.models, ModelList, None),
            ("POST", "/v1/completions", self.completions, CompletionResponse, CompletionRequest),
            ("POST", "/v1/chat/completions", self.chat_completions, ChatCompletionResponse, ChatCompletionRequest),
            ("POST", "/tokenize", self.tokenize, TokenizeResponse, TokenizeRequest),
            ("POST", "/detokenize", self.detokenize, DetokenizeResponse, DetokenizeRequest),
        ):
            extra = None
            if body is not None:
                # The body is read by hand (size limits first), so FastAPI is told its schema here.
                ref = {"$ref": f"#/components/schemas/{body.__name__}"}
                extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
            route = self._admitted(endpoint) if method == "POST" else endpoint
            responses: dict[int | str, dict[str, Any]] = {**errors, **(sse if path.endswith("completions") else {})}
            self.router.add_api_route(
                path,
                route,
                methods=[method],
                response_model=response,
                openapi_extra=extra,
                responses=responses,
                # Documentation only (every route builds its own Response): /metrics is Prometheus' text format.
                response_class=PlainTextResponse if path == "/metrics" else JSONResponse,
            )
        # Load balancers probe with HEAD: the same answer as GET /health, without a body.
        self.router.add_api_route("/health", self.health_head, methods=["HEAD"], include_in_schema=False)
        # vLLM's /ping (SageMaker's health check): /health's answer, to GET or POST, open as /health is.
        self.router.add_api_route("/ping", self.health, methods=["GET", "POST"], include_in_schema=False)

    def _admitted(self, endpoint: Callable[..., Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """A POST route, refused while the server stops; whatever place among ``max_pending`` it took
        (``_body``) is given back when it ends without having handed it to the engine loop."""

        async def admitted(request: Request) -> Response:
            if self.shutdown.draining:
                raise _retry_later(503, SHUTTING_DOWN)
            try:
                return await endpoint(request)
            finally:
                slot: Slot | None = getattr(request.state, "slot", None)
                if slot is not None:
                    slot.release()  # a no-op once submit() has handed it over

        return admitted

    def begin_shutdown(self, grace: float) -> None:
        """The server has stopped accepting (called on its event loop): requests in flight get ``grace``
        seconds to finish, then each still running ends with a 503 (a stream: an error event and [DONE])."""
        self.shutdown.begin(grace)

    # ---------------------------------------------------------------- simple routes
    async def health(self) -> Response:
        if not self.loop.alive:
            raise APIError(503, "the engine loop has stopped")
        return json_response(200, {"status": "ok"})

    async def health_head(self) -> Response:
        return Response(status_code=200 if self.loop.alive else 503)

    async def version(self) -> Response:
        return json_response(200, VersionResponse(version=_version()).model_dump())

    async def models(self, request: Request) -> Response:
        tenant_of(self.policy, request.headers)
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)
        return json_response(200, ModelList(data=[card]).model_dump(mode="json"))

    async def metrics_text(self, request: Request) -> Response:
        check_metrics(self.policy, request.headers)
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        tenant_of(self.policy, request.headers)
        text = self.mapper.tokenize_text(await self._body(request, TokenizeRequest))
        try:
            ids = await asyncio.to_thread(self.tokenizer.encode, text)  # off the event loop, like generation's
        except Exception as exc:
            log.warning("a prompt could not be tokenised: %s %.200r", type(exc).__name__, str(exc))
            raise APIError(400, "the prompt could not be tokenised; is it valid Unicode text?", "prompt") from None
        body = TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)
        return json_response(200, body.model_dump())

    async def detokenize(self, request: Request) -> Response:
        tenant_of(self.policy, request.headers)
        req = await self._body(request, DetokenizeRequest)
        self.mapper.check_tokens(req)
        try:
            text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
        except Exception as exc:  # a tokenizer whose own vocabulary is smaller than the model's embedding
            log.warning("tokens could not be decoded: %s %.200r", type(exc).__name__, str(exc))
            raise APIError(400, "these tokens could not be decoded", "tokens") from None
        return json_response(200, DetokenizeResponse(prompt=text).model_dump())

    # ---------------------------------------------------------------- generation
    async def completions(self, request: Request) -> Response:
        tenant_of(self.policy, request.headers)  # before the body: an unauthenticated request costs nothing more
        req = await self._body(request, CompletionRequest)
        return await self._serve(request, req.cache_salt, self.mapper.completion_job(req))

    async def chat_completions(self, request: Request) -> Response:
        tenant_of(self.policy, request.headers)
        req = await self._body(request, ChatCompletionRequest)
        return await self._serve(request, req.cache_salt, self.mapper.chat_job(req))

    async def _body(self, request: Request, schema: type[M]) -> M:
        """The body, read within the limits and validated by ``schema``. A place among max_pending is taken
        first, so a full server spends nothing on reading and parsing a body; _admitted gives it back if the
        request ends before reaching the engine loop."""
        try:
            request.state.slot = self.loop.reserve()
        except QueueFullError as exc:
            raise _retry_later(429, str(exc), "queue_full") from exc
        except EngineDeadError as exc:
            raise APIError(503, ENGINE_DOWN) from exc
        why = f"from max_model_len={self.max_model_len}"
        data = loads_json(await read_body(request, self.max_body_bytes, self.limits.read_timeout, why))
        try:
            req = schema.model_validate(data)
        except ValidationError as exc:
            raise from_validation(exc, UNSUPPORTED_HINTS) from None
        self.mapper.check_model(req)
        for name in req.ignored_fields():
            if name not in self._ignored_logged:  # once per field: a client sends it with every request
                self._ignored_logged.add(name)
                log.info("accepted and ignored the request field %r: it changes nothing in kvlab (logged once)", name)
        return req

    async def _serve(self, request: Request, body_salt: str | None, job: Job) -> Response:
        """Run ``job`` under the request's tenant and cache salt; answer whole, or as a stream."""
        tenant = tenant_of(self.policy, request.headers)
        salt = cache_salt(self.policy, tenant, request.headers.getlist("x-cache-salt"), body_salt)
        check_sequences(job, self.loop.max_request_seqs)
        if self.shutdown.expired:
            raise _retry_later(503, SHUTTING_DOWN)
        outputs: asyncio.Queue[Any] = asyncio.Queue()  # every prompt's outputs, told apart by request id
        rids = await self._submit_all(request, job, salt, tenant, outputs)
        self.shutdown.track(outputs)
        watcher = watch_disconnect(request, outputs)

        def close() -> None:
            self.shutdown.untrack(outputs)
            watcher.cancel()
            for rid in rids:
                self.loop.abort(rid)  # a no-op once finished

        public_id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if job.stream:
            return EventStream(events(self.formatter, outputs, rids, job, public_id, created), on_close=close)
        try:
            finals = await collect(outputs, rids)
        finally:
            close()
        body = answer(self.formatter, job, public_id, created, finals)
        return json_response(200, body.model_dump(mode="json"))

    async def _submit_all(
        self, request: Request, job: Job, salt: str | None, tenant: str, outputs: asyncio.Queue[Any]
    ) -> list[str]:
        """One engine request per prompt, all answering on ``outputs``. The first takes the place reserved
        before the body was read, each other one its own; if any is refused, those already queued are aborted."""
        rids: list[str] = []
        try:
            for i, prompt in enumerate(job.prompts):
                slot = getattr(request.state, "slot", None) if i == 0 else None
                # Tokenised by the loop on a worker thread, never on the engine's.
                rid, _ = await self.loop.submit(
                    prompt,
                    job.params,
                    salt,
                    slot=slot,
                    out=outputs,
                    tenant=tenant,
                    public_prefix_tokens=job.public_prefix_tokens,
                )
                rids.append(rid)
        except BaseException as exc:
            for rid in rids:
                self.loop.abort(rid)
            if isinstance(exc, QueueFullError):
                code = "tenant_limit" if isinstance(exc, TenantBusyError) else "queue_full"
                raise _retry_later(429, str(exc), code) from exc
            if isinstance(exc, InvalidRequestError):
                where = f"prompt[{len(rids)}]: " if len(job.prompts) > 1 else ""
                param = getattr(exc, "param", None) or sampling_field(exc)
                param = param or ("prompt" if "prompt" in str(exc) else None)
                raise APIError(400, where + str(exc), param) from exc
            if isinstance(exc, EngineDeadError):
                raise APIError(503, ENGINE_DOWN) from exc  # the cause is in the log, not for clients
            raise
        return rids


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema plus the request bodies, which the routes read by hand and FastAPI therefore never saw."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in REQUEST_MODELS:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


# The paths vLLM's server leaves out of its http_* series (probes and metadata, not traffic).
UNINSTRUMENTED = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")


def create_app(
    loop: EngineLoop, model_name: str, policy: TenancyPolicy | None = None, limits: HTTPLimits | None = None
) -> FastAPI:
    """The ASGI app; its lifespan starts and stops ``loop`` (reachable as ``app.state.engine_loop``).
    ``app.state.http_limits`` and ``app.state.begin_shutdown(grace)`` are for the HTTP server around it."""
    limits = limits or HTTPLimits()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            # uvicorn has let in-flight requests finish, or cancelled them (each aborts its engine request).
            await asyncio.to_thread(loop.stop)

    app = FastAPI(
        title="kvlab",
        version=_version(),
        description="An OpenAI-compatible server over kvlab's engine (vLLM's extensions where it has them).",
        lifespan=lifespan,
        redoc_url=None,
    )
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    app.state.engine_loop = loop
    api = OpenAIApp(loop, model_name, policy, limits=limits)
    app.include_router(api.router)
    app.state.http_limits = limits
    app.state.begin_shutdown = api.begin_shutdown
    app.state.openai = api  # its derived limits (max_prompt_chars, max_body_bytes), for tests and tools
    if api.policy.api_keys:  # without keys, anyone may use the server: its description is no secret
        about = {app.docs_url, app.openapi_url, app.swagger_ui_oauth2_redirect_url, "/version"}
        app.add_middleware(KeyRequired, paths=frozenset(p for p in about if p), policy=api.policy)
    # vLLM's http_* series (prometheus-fastapi-instrumentator's defaults, vLLM's excluded handlers) in the
    # registry /metrics exposes, so behind the same access policy as the vllm: series.
    Instrumentator(excluded_handlers=list(UNINSTRUMENTED), registry=api.metrics.registry).add().instrument(app)
    hosts = HostAllowList(limits.bind_host, limits.allowed_hosts)
    app.add_middleware(BrowserGuard, hosts=hosts)  # the outermost: a foreign Host is refused before all else
    _add_error_handlers(app, limits)
    return app


def _add_error_handlers(app: FastAPI, limits: HTTPLimits) -> None:
    async def unread_body_headers(request: Request, exc: APIError) -> dict[str, str]:
        """For a 413 found as the body streamed in, drop the unread rest before answering (see
        DRAIN_MAX_BYTES). One refused by its declared length already closes the connection: not waited for."""
        if exc.status != 413 or "Connection" in exc.headers or getattr(request.state, "body_complete", False):
            return {}
        drained = await discard_body(request.receive, request.headers, limits.read_timeout)
        return {} if drained else {"Connection": "close"}

    # Starlette types every handler as taking Exception; each is registered for one class below, so the
    # asserts only narrow to what it is always given.
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        headers = {**exc.headers, **await unread_body_headers(request, exc)}
        return json_response(exc.status, error_body(exc.status, exc.message, exc.param, exc.code), headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        # Starlette's own: unknown route (404), wrong method (405, with its Allow header).
        message = f"{exc.detail}: {request.method} {request.url.path[:CLIP_CHARS]}"
        return json_response(exc.status_code, error_body(exc.status_code, message), exc.headers)

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        # Unreachable while the routes take no typed parameters; here so FastAPI's 422 can never leak.
        return json_response(400, error_body(400, "invalid request: the body does not match the schema"))

    async def internal_error(_: Request, exc: Exception) -> Response:
        # Starlette logs the traceback after this answer; the client learns nothing of the internals.
        return json_response(500, error_body(500, "internal server error; see the server log"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
