"""OpenAI-compatible routes over the engine loop, as a FastAPI app: /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics.

Every malformed request gets an OpenAI-style error body ``{"error": {"message", "type", "param",
"code"}}`` and never reaches the engine; so do unknown routes and wrong methods (FastAPI's own
``{"detail": ...}`` and 422 bodies never reach a client). ``cache_salt`` (body) or ``X-Cache-Salt``
(header, set by a trusted proxy, so it wins) puts a request's prefix-cache entries in a namespace of their
own. A client that goes away has its request aborted, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling import InvalidRequestError, SamplingParams
from kvlab.server.engine_loop import EngineDeadError, EngineLoop, QueueFullError

MAX_SALT_LEN = 256
MAX_BODY_BYTES = 4 * 1024 * 1024
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    type_ = _ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(status: int, obj: Any, headers: Mapping[str, str] | None = None) -> Response:
    # Not JSONResponse: that one writes compact separators; these bodies read as the earlier server's did.
    return Response(json.dumps(obj, ensure_ascii=False), status, headers, media_type="application/json")


def validate_salt(value: Any, source: str) -> str:
    """A salt is 1..256 printable ASCII characters: anything else is more likely a bug than a tenant id."""
    if not isinstance(value, str):
        raise APIError(400, f"{source} must be a string, got {type(value).__name__}", "cache_salt")
    if not 0 < len(value) <= MAX_SALT_LEN or not all(" " <= c <= "~" for c in value):
        raise APIError(
            400, f"{source} must be 1..{MAX_SALT_LEN} printable ASCII characters, got {value!r:.80}", "cache_salt"
        )
    return value


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any, kind_name: str) -> Any:
    if name not in body or body[name] is None:
        return default
    v = body[name]
    # bool is an int in Python, but `"max_tokens": true` is a client bug, not 1.
    if isinstance(v, bool) and bool not in kinds:
        raise APIError(400, f"'{name}' must be {kind_name}, got a boolean", name)
    if not isinstance(v, kinds):
        raise APIError(400, f"'{name}' must be {kind_name}, got {type(v).__name__}", name)
    # Python's JSON reader accepts NaN and Infinity; a NaN temperature would poison the sampler.
    if isinstance(v, float) and not math.isfinite(v):
        raise APIError(400, f"'{name}' must be a finite number, got {v}", name)
    return v


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


class OpenAIApp:
    """The routes; ``create_app`` wraps them in a FastAPI app."""

    def __init__(self, loop: EngineLoop, model_name: str, max_tokens_default: int = 16) -> None:
        self.loop = loop
        self.model_name = model_name
        self.max_tokens_default = max_tokens_default
        self.tokenizer = loop.engine.tokenizer
        self.created = int(time.time())
        self.max_model_len = loop.engine.scheduler_config.max_model_len
        self.router = APIRouter()
        for method, path, endpoint in (
            ("GET", "/health", self.health),
            ("GET", "/metrics", self.metrics),
            ("GET", "/v1/models", self.models),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat_completions),
        ):
            self.router.add_api_route(path, endpoint, methods=[method])

    # ---------------------------------------------------------------- simple routes
    async def health(self) -> Response:
        if not self.loop.alive:
            raise APIError(503, "the engine loop has stopped")
        return json_response(200, {"status": "ok"})

    async def models(self) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvlab",
            "max_model_len": self.max_model_len,
        }
        return json_response(200, {"object": "list", "data": [card]})

    async def metrics(self) -> Response:
        s = self.loop.stats
        rows = [
            ("kv_cache_usage_perc", "gauge", "KV-cache usage in percent of the block pool", s.kv_cache_usage_perc),
            ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
            ("num_preemptions", "counter", "Requests preempted (recomputed later)", s.num_preemptions),
            ("num_requests_running", "gauge", "Requests in the running batch", s.num_requests_running),
            ("num_requests_waiting", "gauge", "Requests waiting to be scheduled", s.num_requests_waiting),
            (
                "num_requests_pending",
                "gauge",
                "Requests accepted by the server and not finished",
                self.loop.num_pending,
            ),
        ]
        lines = []
        for name, kind, help_, value in rows:
            lines += [
                f"# HELP kvlab:{name} {help_}",
                f"# TYPE kvlab:{name} {kind}",
                f'kvlab:{name}{{model_name="{self.model_name}"}} {float(value)}',
            ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---------------------------------------------------------------- generation
    async def _parse(self, request: Request) -> dict[str, Any]:
        # The body is read and checked here, not by a pydantic model: every error keeps the OpenAI shape.
        raw = bytearray()
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_BODY_BYTES:
                    raise APIError(413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes")
        except ClientDisconnect as exc:
            raise APIError(499, "client disconnected") from exc
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required and must be a string", "model")
        if model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )
        return body

    def _params(self, body: dict[str, Any], max_tokens_key: str = "max_tokens") -> SamplingParams:
        max_tokens = _field(body, max_tokens_key, (int,), self.max_tokens_default, "an integer")
        if max_tokens < 1:
            raise APIError(400, f"'{max_tokens_key}' must be >= 1, got {max_tokens}", max_tokens_key)
        temperature = _field(body, "temperature", (int, float), 1.0, "a number")
        top_p = _field(body, "top_p", (int, float), 1.0, "a number")
        top_k = _field(body, "top_k", (int,), 0, "an integer")
        seed = _field(body, "seed", (int,), None, "an integer")
        n = _field(body, "n", (int,), 1, "an integer")
        ignore_eos = _field(body, "ignore_eos", (bool,), False, "a boolean")
        if seed is not None and not 0 <= seed < 2**63:
            raise APIError(400, f"'seed' must be in [0, 2**63), got {seed}", "seed")
        if top_k < 0:  # OpenAI/vLLM clients send -1 for "off"
            top_k = 0
        if body.get("stop") not in (None, [], ""):
            raise APIError(400, "'stop' strings are not supported by kvlab; use max_tokens", "stop")
        try:
            return SamplingParams(
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=top_k,
                seed=seed,
                max_tokens=max_tokens,
                n=n,
                ignore_eos=ignore_eos,
            )
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from exc

    @staticmethod
    def _salt(request: Request, body: dict[str, Any]) -> str | None:
        if "x-cache-salt" in request.headers:
            return validate_salt(request.headers["x-cache-salt"], "the X-Cache-Salt header")
        if body.get("cache_salt") is not None:
            return validate_salt(body["cache_salt"], "'cache_salt'")
        return None

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt = list(prompt)
        elif not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string, a list of one string, or a list of token ids", "prompt")
        return await self._generate(request, body, prompt, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise APIError(400, f"messages[{i}] must be an object with string 'role' and 'content'", "messages")
        prompt = self.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages])
        return await self._generate(request, body, prompt, chat=True)

    async def _generate(self, request: Request, body: dict[str, Any], prompt: str | list[int], chat: bool) -> Response:
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        params = self._params(body, key)
        stream = _field(body, "stream", (bool,), False, "a boolean")
        salt = self._salt(request, body)
        try:
            rid, outputs = await self.loop.submit(prompt, params, salt)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full") from exc
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "prompt" if "prompt" in str(exc) else None) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from exc
        close = self._watch(request, rid, outputs)
        public_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if stream:
            return _EventStream(self._events(outputs, public_id, chat, params.n), on_close=close)
        try:
            while (out := await self._next(outputs)) is not None and not out.finished:
                pass
        finally:
            close()
        if out is None:
            raise APIError(499, "client disconnected")
        return json_response(200, self._full(out, public_id, chat))

    def _watch(self, request: Request, rid: str, outputs: asyncio.Queue) -> Callable[[], None]:
        """Listen for the client going away, which wakes the reader of ``outputs`` with None. Returns the
        function that ends the request: stop listening, abort it (a no-op once it has finished)."""

        async def watch() -> None:
            # The body has been read: the next ASGI message is the disconnect (or the end of the response).
            while (await request.receive())["type"] != "http.disconnect":
                pass
            outputs.put_nowait(None)

        task = asyncio.ensure_future(watch())

        def close() -> None:
            task.cancel()
            self.loop.abort(rid)

        return close

    @staticmethod
    async def _next(outputs: asyncio.Queue) -> RequestOutput | None:
        """The next output, or None once the client has gone away."""
        item = await outputs.get()
        if isinstance(item, BaseException):  # the engine loop died under this request
            raise APIError(503, str(item))
        return item

    def _full(self, out: RequestOutput, public_id: str, chat: bool) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            # token_ids is a kvlab extension: probes compare tokens exactly, text can hide differences.
            choice: dict[str, Any] = {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": None,
                "token_ids": c.token_ids,
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {
            "id": public_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(out.prompt_token_ids) + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
            },
        }

    async def _events(self, outputs: asyncio.Queue, public_id: str, chat: bool, n: int) -> AsyncIterator[str]:
        sent = [""] * n
        closed: set[int] = set()
        finished = False
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(data: Any) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def chunk(index: int, text: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
            return event(
                {
                    "id": public_id,
                    "object": obj,
                    "created": int(time.time()),
                    "model": self.model_name,
                    "choices": [choice],
                }
            )

        if chat:
            for i in range(n):
                yield chunk(i, None, None, role=True)
        while not finished:
            try:
                out = await self._next(outputs)
            except APIError as exc:
                yield event(_error(exc.status, exc.message))
                break
            if out is None:
                return
            finished = out.finished
            for c in out.outputs:
                if c.index in closed:
                    continue
                # A multi-byte character may be split across tokens; its incomplete tail decodes to one
                # U+FFFD that may still become a real character, so hold back one (and only one: the
                # earlier ones are final, and a model may well emit invalid bytes for ever).
                text = c.text if c.finish_reason or not c.text.endswith("\ufffd") else c.text[:-1]
                if c.index >= len(sent):
                    sent.extend([""] * (c.index + 1 - len(sent)))
                delta = text[len(sent[c.index]) :]
                if delta or c.finish_reason:
                    yield chunk(c.index, delta, c.finish_reason if c.finish_reason else None)
                    sent[c.index] = text
                if c.finish_reason:
                    closed.add(c.index)
        yield "data: [DONE]\n\n"


def create_app(loop: EngineLoop, model_name: str) -> FastAPI:
    """The ASGI app; its lifespan starts and stops ``loop`` (reachable as ``app.state.engine_loop``)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            # uvicorn has let in-flight requests finish, or cancelled them (each aborts its engine request).
            await asyncio.to_thread(loop.stop)

    # No /docs or /openapi.json: the routes parse their own bodies, so the schema would say nothing.
    app = FastAPI(title="kvlab", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop
    app.include_router(OpenAIApp(loop, model_name).router)

    # Starlette types every handler as taking Exception; each is registered for one class below, so the
    # asserts only narrow to what it is always given.
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return json_response(exc.status, _error(exc.status, exc.message, exc.param, exc.code))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        # Starlette's own: unknown route (404), wrong method (405, with its Allow header).
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return json_response(exc.status_code, _error(exc.status_code, message), exc.headers)

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        # Unreachable while the routes take no typed parameters; here so FastAPI's 422 can never leak.
        return json_response(400, _error(400, f"invalid request: {exc.errors()}"))

    async def internal_error(_: Request, exc: Exception) -> Response:
        # Starlette logs the traceback after this answer; the client learns nothing of the internals.
        return json_response(500, _error(500, "internal server error; see the server log"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
    return app
