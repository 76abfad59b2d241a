"""OpenAI-compatible routes over the engine loop, as a FastAPI app: /v1/completions, /v1/chat/completions,
/v1/models, vLLM's /tokenize, /detokenize and /version, /health, /metrics, and the OpenAPI schema at
/openapi.json (browsable at /docs).

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

Bad and oversized input costs its sender, not everyone (the checks live in ``guards``):
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
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling import InvalidRequestError, SamplingParams
from kvlab.server.engine_loop import EngineDeadError, EngineLoop, QueueFullError, Slot, TenantBusyError
from kvlab.server.errors import CLIP_CHARS, APIError, clip, error_body, from_validation, json_response
from kvlab.server.guards import (
    DRAIN_MAX_BYTES,
    READ_TIMEOUT_S,
    SHUTDOWN_GRACE_S,
    BrowserGuard,
    HostAllowList,
    HTTPLimits,
    body_limit,
    bytes_per_token_bound,
    check_text,
    discard_body,
    loads_json,
    read_body,
    split_host,
    validate_salt,
)
from kvlab.server.metrics import ServerMetrics
from kvlab.server.openai_format import Formatter, StreamFormatter
from kvlab.server.schemas import (
    CHAT_ROLES,
    REQUEST_MODELS,
    UNSUPPORTED_HINTS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerateBase,
    HealthResponse,
    ModelCard,
    ModelList,
    RequestBase,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvlab.server.tenancy import AuthError, MetricsClosedError, TenancyPolicy

# Re-exported: the hardening's names, where tests and tools have always found them.
__all__ = [
    "CHAT_ROLES",
    "DRAIN_MAX_BYTES",
    "READ_TIMEOUT_S",
    "SHUTDOWN_GRACE_S",
    "APIError",
    "HTTPLimits",
    "HostAllowList",
    "OpenAIApp",
    "body_limit",
    "bytes_per_token_bound",
    "clip",
    "create_app",
    "split_host",
]

log = logging.getLogger(__name__)

# Seconds a client told 429 (or 503 while the server stops) should wait before retrying.
RETRY_AFTER_S = 1
_ENGINE_DOWN = "the engine is not running; see the server log"
_SHUTTING_DOWN = "the server is shutting down; retry later"
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")
M = TypeVar("M", bound=RequestBase)


class _ShuttingDown(Exception):
    """Put on a request's output queue when the shutdown grace period ends."""


_SHUTDOWN = _ShuttingDown()


class _EventStream(StreamingResponse):
    """Server-sent events whose ``on_close`` runs however the response ends: all sent, client gone, server
    stopping, or cancelled before the first event (when the generator's own ``finally`` would never run)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _event(data: BaseModel | dict[str, Any]) -> str:
    obj = data.model_dump(mode="json") if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _version() -> str:
    try:
        return importlib.metadata.version("kvlab")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@dataclass(frozen=True)
class _Job:
    """One generation request as the engine will run it: one engine request per prompt."""

    chat: bool
    prompts: Sequence[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None  # completions: logprobs; chat: top_logprobs (None: not asked for)


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
        self.max_tokens_default = max_tokens_default  # completions (OpenAI's 16); chat fills the context
        self.tokenizer = loop.engine.tokenizer
        self.vocab_size = loop.engine.loaded.config.vocab_size
        self.created = int(time.time())
        self.max_model_len = loop.engine.scheduler_config.max_model_len
        self.limits = limits or HTTPLimits()
        # Size limits derived from max_model_len (see bytes_per_token_bound and body_limit): whatever exceeds
        # them could never be served, so it is refused before it costs tokenising or memory.
        self.max_prompt_chars = self.max_model_len * bytes_per_token_bound(self.tokenizer)
        self.max_body_bytes = body_limit(self.max_prompt_chars, self.max_model_len)
        self.metrics = ServerMetrics(loop, model_name)
        loop.observer = self.metrics.tracker
        self.formatter = Formatter(model_name, self.tokenizer, self.policy.reported_cached_tokens)
        self._ignored_logged: set[str] = set()
        self._draining = False  # the server stopped accepting: new requests get a 503
        self._expired = False  # the grace period is over: requests still in flight end with a 503
        self._inflight: set[asyncio.Queue[Any]] = set()  # the output queues of requests being answered
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

    def _admitted(self, endpoint: Callable[..., Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """A POST route, refused while the server stops; whatever place among ``max_pending`` it took
        (``_body``) is given back when it ends without having handed it to the engine loop."""

        async def admitted(request: Request) -> Response:
            if self._draining:
                raise APIError(503, _SHUTTING_DOWN, headers={"Retry-After": str(RETRY_AFTER_S)})
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
        self._draining = True
        asyncio.get_running_loop().call_later(grace, self._end_inflight)

    def _end_inflight(self) -> None:
        self._expired = True
        if self._inflight:
            log.warning("ending %d request(s) still running after the shutdown grace period", len(self._inflight))
        for outputs in list(self._inflight):
            outputs.put_nowait(_SHUTDOWN)

    # ---------------------------------------------------------------- simple routes
    async def health(self) -> Response:
        if not self.loop.alive:
            raise APIError(503, "the engine loop has stopped")
        return json_response(200, {"status": "ok"})

    async def version(self) -> Response:
        return json_response(200, VersionResponse(version=_version()).model_dump())

    async def models(self, request: Request) -> Response:
        self._tenant(request)
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)
        return json_response(200, ModelList(data=[card]).model_dump(mode="json"))

    async def metrics_text(self, request: Request) -> Response:
        try:
            self.policy.check_metrics(authorization(request.headers))
        except AuthError as exc:
            raise APIError(401, str(exc), code="invalid_api_key") from exc
        except MetricsClosedError as exc:
            raise APIError(403, str(exc), code="metrics_closed") from exc
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        self._tenant(request)
        req = await self._body(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        text = req.prompt if req.prompt is not None else self._render(req.messages or [])
        self._check_prompt(text)
        try:
            ids = await asyncio.to_thread(self.tokenizer.encode, text)  # off the event loop, like generation's
        except Exception as exc:
            log.warning("a prompt could not be tokenised: %s %.200r", type(exc).__name__, str(exc))
            raise APIError(400, "the prompt could not be tokenised; is it valid Unicode text?", "prompt") from None
        body = TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)
        return json_response(200, body.model_dump())

    async def detokenize(self, request: Request) -> Response:
        self._tenant(request)
        req = await self._body(request, DetokenizeRequest)
        bad = next((i for i, t in enumerate(req.tokens) if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"tokens[{bad}] = {req.tokens[bad]} is outside the vocabulary [0, {self.vocab_size})", "tokens"
            )
        try:
            text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
        except Exception as exc:  # a tokenizer whose own vocabulary is smaller than the model's embedding
            log.warning("tokens could not be decoded: %s %.200r", type(exc).__name__, str(exc))
            raise APIError(400, "these tokens could not be decoded", "tokens") from None
        return json_response(200, DetokenizeResponse(prompt=text).model_dump())

    # ---------------------------------------------------------------- reading a request
    async def _body(self, request: Request, schema: type[M]) -> M:
        """The body, read within the limits and validated by ``schema``. A place among max_pending is taken
        first, so a full server spends nothing on reading and parsing a body; _admitted gives it back if the
        request ends before reaching the engine loop."""
        try:
            request.state.slot = self.loop.reserve()
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except EngineDeadError as exc:
            raise APIError(503, _ENGINE_DOWN) from exc
        why = f"from max_model_len={self.max_model_len}"
        data = loads_json(await read_body(request, self.max_body_bytes, self.limits.read_timeout, why))
        try:
            req = schema.model_validate(data)
        except ValidationError as exc:
            raise from_validation(exc, UNSUPPORTED_HINTS) from None
        model = getattr(req, "model", None)
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {clip(model)} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )
        for name in req.ignored_fields():
            if name not in self._ignored_logged:  # once per field: a client sends it with every request
                self._ignored_logged.add(name)
                log.info("accepted and ignored the request field %r: it changes nothing in kvlab (logged once)", name)
        return req

    def _check_prompt(self, prompt: str | list[int], param: str = "prompt") -> None:
        """Refuse by size what cannot fit max_model_len tokens, before anything tokenises it."""
        if isinstance(prompt, list):
            if len(prompt) > self.max_model_len:
                raise APIError(
                    400, f"the prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len}", param
                )
            return
        if len(prompt) > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} characters; at most {self.max_prompt_chars} can fit "
                f"max_model_len={self.max_model_len} tokens",
                param,
            )
        check_text(prompt, "the prompt", param)

    def _render(self, messages: Sequence[ChatMessage]) -> str:
        """The chat template's prompt for ``messages``, after the checks that need no template."""
        if len(messages) > self.max_model_len:  # every message costs the chat template at least one token
            raise APIError(
                400, f"{len(messages)} messages cannot fit max_model_len={self.max_model_len} tokens", "messages"
            )
        texts = [m.text() for m in messages]
        for i, text in enumerate(texts):
            check_text(text, f"messages[{i}].content", "messages")
        size = sum(len(t) for t in texts)
        if size > self.max_prompt_chars:  # before the template renders it
            raise APIError(
                400,
                f"the messages have {size} characters; at most {self.max_prompt_chars} can fit "
                f"max_model_len={self.max_model_len} tokens",
                "messages",
            )
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": t} for m, t in zip(messages, texts, strict=True)]
                )
            )
        except ValueError as exc:  # no chat template, or the template's own raise_exception
            raise APIError(400, f"the chat template refused these messages: {exc}", "messages") from None
        except Exception as exc:
            log.warning("the chat template failed: %s %.200r", type(exc).__name__, str(exc))
            raise APIError(400, "the model's chat template could not render these messages", "messages") from None

    def _params(
        self, req: GenerateBase, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        # The prompts' rule for every client text: a stop string with a lone surrogate is a client bug (decoded
        # text never has one, so it could never match), refused the same way rather than silently inert.
        for i, stop in enumerate(stops):
            check_text(stop, f"stop[{i}]", "stop")
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=req.min_p,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed,
                stop=tuple(stops),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=req.bias(),
            )
        except InvalidRequestError as exc:
            found = _SAMPLING_FIELD.search(str(exc))
            raise APIError(400, str(exc), found.group(1) if found else None) from exc

    def _tenant(self, request: Request) -> str:
        try:
            return self.policy.tenant(authorization(request.headers))
        except AuthError as exc:
            raise APIError(401, str(exc), code="invalid_api_key") from exc

    def _salt(self, request: Request, body_salt: str | None, tenant: str) -> str | None:
        """The engine's salt: derived from the tenant; a client salt only narrows sharing inside it."""
        headers = request.headers.getlist("x-cache-salt")
        if len(headers) > 1:
            # A proxy that appends its own header would otherwise leave the client's first one in charge.
            raise APIError(400, "the X-Cache-Salt header is given more than once", "cache_salt")
        client_salt = None
        if headers:
            if not self.policy.trust_salt_header:
                raise APIError(
                    400,
                    "this server does not accept X-Cache-Salt (it is for a trusted proxy: --trust-salt-header); "
                    "send 'cache_salt' in the body",
                    "cache_salt",
                )
            client_salt = validate_salt(headers[0], "the X-Cache-Salt header")
        elif body_salt is not None:
            client_salt = validate_salt(body_salt, "'cache_salt'")
        return self.policy.cache_salt(tenant, client_salt)

    # ---------------------------------------------------------------- generation
    async def completions(self, request: Request) -> Response:
        self._tenant(request)  # before the body is read: an unauthenticated request costs nothing more
        req = await self._body(request, CompletionRequest)
        prompts = req.prompts()
        if len(prompts) > self.loop.max_pending:
            raise APIError(400, f"{len(prompts)} prompts; this server queues at most {self.loop.max_pending}", "prompt")
        for p in prompts:
            self._check_prompt(p, "prompt")
        max_tokens = self.max_tokens_default if req.max_tokens is None else req.max_tokens
        # echo with logprobs: the prompt's own log-probabilities come first (OpenAI's legacy "scoring" use).
        params = self._params(req, max_tokens, req.logprobs, req.logprobs if req.echo else None)
        job = _Job(False, prompts, params, req.stream, self._include_usage(req), req.echo, req.logprobs)
        return await self._serve(request, req, job)

    async def chat_completions(self, request: Request) -> Response:
        self._tenant(request)
        req = await self._body(request, ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        prompt = self._render(req.messages)
        self._check_prompt(prompt, "messages")
        # No max_tokens: up to the context limit, as vLLM's chat does (the engine stops at max_model_len).
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        job = _Job(True, [prompt], self._params(req, max_tokens, top), req.stream, self._include_usage(req), False, top)
        return await self._serve(request, req, job)

    @staticmethod
    def _include_usage(req: GenerateBase) -> bool:
        if req.stream_options is not None and not req.stream:
            # OpenAI refuses it too: the options would be silently without effect.
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        return req.stream_options is not None and req.stream_options.include_usage

    async def _serve(self, request: Request, req: GenerateBase, job: _Job) -> Response:
        tenant = self._tenant(request)
        salt = self._salt(request, req.cache_salt, tenant)
        sequences = len(job.prompts) * job.params.n
        if sequences > self.loop.max_request_seqs:
            # A 2 KB body of 256 prompts x n=64 would otherwise queue 16,384 sequences.
            raise APIError(
                400,
                f"{len(job.prompts)} prompt(s) x n={job.params.n} = {sequences} sequences; this server takes at "
                f"most {self.loop.max_request_seqs} in one request (kvlab serve --max-request-seqs)",
                "n",
            )
        if self._expired:
            raise APIError(503, _SHUTTING_DOWN, headers={"Retry-After": str(RETRY_AFTER_S)})
        outputs: asyncio.Queue[Any] = asyncio.Queue()  # every prompt's outputs, told apart by request id
        rids = await self._submit_all(request, job, salt, tenant, outputs)
        self._inflight.add(outputs)
        if self._expired:  # the grace period ended while this one was being queued
            outputs.put_nowait(_SHUTDOWN)
        end = self._watch(request, rids, outputs)

        def close() -> None:
            self._inflight.discard(outputs)
            end()

        public_id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if job.stream:
            return _EventStream(self._events(outputs, rids, job, public_id, created), on_close=close)
        try:
            finals = await self._collect(outputs, rids)
        finally:
            close()
        if job.chat:
            body: BaseModel = self.formatter.chat(public_id, created, finals[0], job.logprobs)
        else:
            body = self.formatter.completion(
                public_id, created, finals, job.prompts, job.echo, job.logprobs is not None
            )
        return json_response(200, body.model_dump(mode="json"))

    async def _submit_all(
        self, request: Request, job: _Job, salt: str | None, tenant: str, outputs: asyncio.Queue[Any]
    ) -> list[str]:
        """One engine request per prompt, all answering on ``outputs``. The first takes the place reserved
        before the body was read, each other one its own; if any is refused, those already queued are aborted."""
        rids: list[str] = []
        try:
            for i, prompt in enumerate(job.prompts):
                slot = getattr(request.state, "slot", None) if i == 0 else None
                # Tokenised by the loop on a worker thread, never on the engine's.
                rid, _ = await self.loop.submit(prompt, job.params, salt, slot=slot, out=outputs, tenant=tenant)
                rids.append(rid)
        except BaseException as exc:
            for rid in rids:
                self.loop.abort(rid)
            if isinstance(exc, QueueFullError):
                code = "tenant_limit" if isinstance(exc, TenantBusyError) else "queue_full"
                raise APIError(429, str(exc), code=code, headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
            if isinstance(exc, InvalidRequestError):
                where = f"prompt[{len(rids)}]: " if len(job.prompts) > 1 else ""
                found = _SAMPLING_FIELD.search(str(exc))
                param = found.group(1) if found else "prompt" if "prompt" in str(exc) else None
                raise APIError(400, where + str(exc), param) from exc
            if isinstance(exc, EngineDeadError):
                raise APIError(503, _ENGINE_DOWN) from exc  # the cause is in the log, not for clients
            raise
        return rids

    def _watch(self, request: Request, rids: list[str], outputs: asyncio.Queue[Any]) -> Callable[[], None]:
        """Listen for the client going away, which wakes the reader of ``outputs`` with None. Returns the
        function that ends the request: stop listening, abort its engine requests (a no-op once finished)."""

        async def watch() -> None:
            # The body has been read: the next ASGI message is the disconnect (or the end of the response).
            while (await request.receive())["type"] != "http.disconnect":
                pass
            outputs.put_nowait(None)

        task = asyncio.ensure_future(watch())

        def close() -> None:
            task.cancel()
            for rid in rids:
                self.loop.abort(rid)

        return close

    @staticmethod
    async def _next(outputs: asyncio.Queue[Any]) -> RequestOutput | None:
        """The next output, or None once the client has gone away."""
        item = await outputs.get()
        if item is _SHUTDOWN:
            raise APIError(503, _SHUTTING_DOWN, code="server_shutting_down")
        if isinstance(item, BaseException):  # the engine loop died (or stopped) under this request
            raise APIError(503, _ENGINE_DOWN)  # no internal text: the cause is in the server log
        return item

    async def _collect(self, outputs: asyncio.Queue[Any], rids: list[str]) -> list[RequestOutput]:
        """The final output of every request, in prompt order."""
        latest: dict[str, RequestOutput] = {}
        pending = set(rids)
        while pending:
            out = await self._next(outputs)
            if out is None:
                raise APIError(499, "client disconnected")
            latest[out.request_id] = out
            if out.finished:
                pending.discard(out.request_id)
        return [latest[r] for r in rids]

    async def _events(
        self, outputs: asyncio.Queue[Any], rids: list[str], job: _Job, public_id: str, created: int
    ) -> AsyncIterator[str]:
        longest_stop = max((len(s) for s in job.params.stop), default=0)
        stream = StreamFormatter(
            self.formatter, public_id, created, job.chat, job.params.n, max(longest_stop - 1, 0), job.echo,
            job.logprobs, job.prompts,
        )  # fmt: skip
        index_of = {rid: i for i, rid in enumerate(rids)}
        if job.chat:
            for chunk in stream.role_chunks():
                yield _event(chunk)
        latest: dict[str, RequestOutput] = {}
        pending = set(rids)
        while pending:
            try:
                out = await self._next(outputs)
            except APIError as exc:
                yield _event(error_body(exc.status, exc.message, exc.param, exc.code))
                break
            if out is None:
                return
            latest[out.request_id] = out
            if out.finished:
                pending.discard(out.request_id)
            for update in stream.updates(out, index_of[out.request_id]):
                yield _event(update)
        else:
            if job.include_usage:
                yield _event(stream.usage_chunk([latest[r] for r in rids]))
        yield "data: [DONE]\n\n"


def authorization(headers: Headers) -> str | None:
    """The request's one ``Authorization`` header. Two are a 400: a proxy that appends its own would otherwise
    leave the client's first one in charge (as with X-Cache-Salt)."""
    values = headers.getlist("authorization")
    if len(values) > 1:
        raise APIError(400, "the Authorization header is given more than once", code="invalid_authorization")
    return values[0] if values else None


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
