"""OpenAI-compatible routes over the engine loop, as a FastAPI app: /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics.

Every malformed request gets an OpenAI-style error body ``{"error": {"message", "type", "param",
"code"}}`` and never reaches the engine; so do unknown routes and wrong methods (FastAPI's own
``{"detail": ...}`` and 422 bodies never reach a client). ``cache_salt`` (body) or ``X-Cache-Salt``
(header, set by a trusted proxy, so it wins) puts a request's prefix-cache entries in a namespace of their
own. A client that goes away has its request aborted, which frees its KV blocks at once.

Bad and oversized input costs its sender, not everyone (issue 14, section 4): a full server answers 429
(with ``Retry-After``) before reading the body; a body over the size limit is refused as it streams in, and
a prompt over the character limit (both derived from ``max_model_len``: ``bytes_per_token_bound``,
``body_limit``) before it is tokenised, which happens on a worker thread, not the engine's; a body that does
not arrive within the read timeout gets a 408; JSON the parser cannot take (deep nesting, 5,000-digit
integers) and numbers no float can hold are 400s; client values are clipped before they are echoed in a
message; unknown chat roles are refused. Requests a browser could be tricked into sending are refused before
any of that: a ``Host`` outside the allow-list (DNS rebinding) and a ``/v1`` POST that is not
``application/json`` (a cross-site form post). When the server stops, requests in flight get a grace period,
then an OpenAI-shaped 503 (a stream: an error event and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling import InvalidRequestError, SamplingParams
from kvlab.server.engine_loop import EngineDeadError, EngineLoop, QueueFullError, Slot
from kvlab.server.tenancy import AuthError, TenancyPolicy

log = logging.getLogger(__name__)

MAX_SALT_LEN = 256
# Seconds a client told 429 (or 503 while the server stops) should wait before retrying.
RETRY_AFTER_S = 1
# Seconds a client has to send a request's head, and then its body: a stalled or trickling client is dropped.
READ_TIMEOUT_S = 30.0
# Seconds requests in flight get to finish when the server stops, before each ends with a 503.
SHUTDOWN_GRACE_S = 5.0
# The roles a chat message may have (OpenAI's, plus "developer"); anything else, template markup
# such as "<|im_start|>" smuggled into a role included, is refused.
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# Client values echoed in an error message are cut to this many characters: a 1 MB model name is not
# sent back whole (nor written whole to a log).
CLIP_CHARS = 120
_ENGINE_DOWN = "the engine is not running; see the server log"
_SHUTTING_DOWN = "the server is shutting down; retry later"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # The last guard against echoing a huge client value: no message is longer than this.
        message = message if len(message) <= 4 * CLIP_CHARS else message[: 4 * CLIP_CHARS] + "…"
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})


def clip(value: Any, limit: int = CLIP_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages; computed from a prefix when the value is a
    long string, so a 1 MB value costs nothing. ``repr`` also escapes lone surrogates, which a log cannot write."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"… ({len(value)} characters)"
    if isinstance(value, int) and value.bit_length() > 4 * limit:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


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


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        # The C parser counts its depth (10k nested arrays): a client error, not a server one.
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: it is not UTF-8 ({exc.reason})") from None
    except ValueError as exc:
        # JSONDecodeError, and what Python's int-string conversion limit raises for an integer literal of
        # more than 4,300 digits.
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any, kind_name: str) -> Any:
    if name not in body or body[name] is None:
        return default
    v = body[name]
    # bool is an int in Python, but `"max_tokens": true` is a client bug, not 1.
    if isinstance(v, bool) and bool not in kinds:
        raise APIError(400, f"'{name}' must be {kind_name}, got a boolean", name)
    if not isinstance(v, kinds):
        raise APIError(400, f"'{name}' must be {kind_name}, got {type(v).__name__}", name)
    if isinstance(v, int) and float in kinds:
        # JSON integers are unbounded: 10**400 parses fine and is no float at all (float() overflows).
        try:
            v = float(v)
        except OverflowError:
            raise APIError(400, f"'{name}' must be a finite number, got {clip(v)}", name) from None
    # Python's JSON reader accepts NaN and Infinity; a NaN temperature would poison the sampler.
    if isinstance(v, float) and not math.isfinite(v):
        raise APIError(400, f"'{name}' must be a finite number, got {v}", name)
    return v


# ------------------------------------------------------------------------------------------------ limits
_SURROGATE = re.compile("[\ud800-\udfff]")
# A bound on how much a tokenizer's normalizer may shrink text before it is split: NFC composes three
# 3-byte Hangul jamo into one 3-byte syllable. (A normalizer that deletes text, such as BERT's control-
# character cleaner, has no bound; a prompt that relies on one is refused by size, which is the point.)
_NORMALIZER_SHRINK = 3
# Bytes per token assumed for a tokenizer whose vocabulary cannot be read: above the longest entry of the
# vocabularies kvlab loads except long whitespace runs (SmolLM2's longest, a newline and 80 spaces, is 81).
_FALLBACK_BYTES_PER_TOKEN = 128


def bytes_per_token_bound(tokenizer: Any) -> int:
    """An upper bound on the bytes of UTF-8 text one token of ``tokenizer`` can stand for.

    Why: every token covers at most this many bytes of the prompt and a character is at least one byte, so a
    prompt of more than ``max_model_len * bound`` characters cannot fit ``max_model_len`` tokens; it can be
    refused by its length alone, before the tokenizer spends time and memory on it. Read from the
    vocabulary: kvlab's byte tokenizer has one byte per token; in a byte-level BPE vocabulary (GPT-2,
    SmolLM2, Llama 3) each character of an entry is one byte; in any other (SentencePiece's "▁", "<0x0A>")
    an entry's UTF-8 length is never less than the text it stands for; added tokens such as "<|im_start|>",
    matched in raw text, count their UTF-8 length.
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        # kvlab's own ByteTokenizer encodes one token per UTF-8 byte.
        return 1 if type(tokenizer).__name__ == "ByteTokenizer" else _FALLBACK_BYTES_PER_TOKEN
    try:
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        byte_level = type(backend.decoder).__name__ == "ByteLevel"
    except Exception:  # another backend: be generous rather than refuse a prompt that fits
        return _FALLBACK_BYTES_PER_TOKEN
    longest = max((len(t) if byte_level else len(t.encode("utf-8")) for t in vocab), default=1)
    longest = max([longest, *(len(t.encode("utf-8")) for t in added)])
    return longest * (_NORMALIZER_SHRINK if backend.normalizer is not None else 1)


def body_limit(max_prompt_chars: int, max_model_len: int) -> int:
    """The largest request body worth reading, for prompts up to ``max_prompt_chars`` characters.

    The prompt's UTF-8 bytes are bounded by the same number (``max_model_len`` tokens of at most
    ``bytes_per_token_bound`` bytes), and JSON spends at most 6 bytes per UTF-8 byte ("\\u0001" for a
    1-byte character; a 4-byte one costs 12 as a surrogate-pair escape). Around the prompt: 64 KiB for the
    other fields and 64 bytes per token of ``max_model_len`` (a chat message costs its template at least one
    token, and a token id list about 8 bytes an id). Anything larger cannot be a request the engine would
    take, so it is refused while it streams in and never held in memory whole.
    """
    return 6 * max_prompt_chars + 64 * 1024 + 64 * max_model_len


# A 413 is sent once the rest of the oversized body has been read and dropped, up to this many bytes: a
# client still sending would otherwise see its connection reset (uvicorn closes at once when the client asked
# for Connection: close) instead of the answer. Memory stays flat: nothing is kept. A larger body gets the
# answer with Connection: close straight away. Other early answers (401, 415, 429) are not held back: their
# bodies are small, already buffered by the HTTP layer, and a keep-alive client's rest is dropped there.
DRAIN_MAX_BYTES = 16 * 1024 * 1024


def _is_number(text: str) -> bool:
    # Not str.isdigit alone: "²" is a digit to it, and int() refuses it.
    return text.isascii() and text.isdigit()


async def discard_body(receive: Receive, headers: Headers, timeout: float) -> bool:
    """Read and drop what is left of a request body. False when it did not end within ``DRAIN_MAX_BYTES``
    and ``timeout`` seconds (or the client went away): then the connection should close after the answer."""
    declared = headers.get("content-length", "")
    if _is_number(declared) and (len(declared) > 18 or int(declared) > DRAIN_MAX_BYTES):
        return False
    seen = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return False
                seen += len(message.get("body", b""))
                if seen > DRAIN_MAX_BYTES:
                    return False
                if not message.get("more_body", False):
                    return True
    except TimeoutError:
        return False


def check_text(text: str, what: str, param: str) -> None:
    """Refuse text with a lone surrogate ("\\ud800" in JSON): no UTF-8 encoder, the tokenizer's included,
    can take it. One log line, no traceback: a client can send this as often as it likes."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        log.info("refused a request: %s has a lone surrogate %r at character %d", what, bad.group(), bad.start())
        raise APIError(
            400, f"{what} is not valid Unicode: a lone surrogate {bad.group()!r} at character {bad.start()}", param
        )


@dataclass(frozen=True)
class HTTPLimits:
    """What the HTTP side accepts and how long it waits (``kvlab serve`` flags)."""

    bind_host: str = "127.0.0.1"
    # Host header values allowed besides the defaults (see HostAllowList): "name" (any port), "name:port",
    # or "*" (any Host: only behind a proxy that checks it).
    allowed_hosts: tuple[str, ...] = ()
    read_timeout: float = READ_TIMEOUT_S
    shutdown_grace: float = SHUTDOWN_GRACE_S

    def __post_init__(self) -> None:
        if not self.read_timeout > 0:
            raise ValueError(f"read_timeout must be > 0 seconds, got {self.read_timeout}")
        if not self.shutdown_grace >= 0:
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")
        HostAllowList(self.bind_host, self.allowed_hosts)  # a malformed entry fails at startup, not per request


def _canonical_host(name: str) -> str:
    name = name.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    try:
        return str(ipaddress.ip_address(name))  # "0:0:0:0:0:0:0:1" and "::1" are one address
    except ValueError:
        return name


def split_host(value: str) -> tuple[str, int | None] | None:
    """``(name, port)`` of a Host header value (port None when absent); None when it is malformed."""
    value = value.strip()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text: str | None = rest[1:] if rest else None
    elif value.count(":") > 1:  # an IPv6 address must be bracketed
        return None
    else:
        name, colon, port_text = value.partition(":")
        port_text = port_text if colon else None
    if not name or (port_text is not None and not re.fullmatch(r"[0-9]{1,5}", port_text)):
        return None
    return _canonical_host(name), None if port_text is None else int(port_text)


class HostAllowList:
    """The Host header values this server answers to (DNS rebinding: a page of evil.example whose name
    now resolves to 127.0.0.1 reaches the server with ``Host: evil.example:8000``, and is refused).

    Always allowed, with the port the connection arrived on or with none: the bind address, localhost,
    127.0.0.1, [::1], and the address the connection arrived at (an IP literal cannot be rebound). Extra
    entries: "name" (any port), "name:port", "*" (anything)."""

    def __init__(self, bind_host: str, extra: Iterable[str] = ()) -> None:
        self.any = False
        self.defaults = {_canonical_host(h) for h in (bind_host, "localhost", "127.0.0.1", "::1")}
        self.names: set[str] = set()
        self.exact: set[tuple[str, int]] = set()
        for entry in extra:
            if entry.strip() == "*":
                self.any = True
                continue
            parsed = split_host(entry)
            if parsed is None:
                raise ValueError(f"not a host name or host:port: {entry!r}")
            name, port = parsed
            if port is None:
                self.names.add(name)
            else:
                self.exact.add((name, port))

    def allows(self, host: str | None, local: tuple[str, int | None] | None) -> bool:
        if self.any or host is None:  # no Host at all (HTTP/1.0): not a browser
            return True
        parsed = split_host(host)
        if parsed is None:
            return False
        name, port = parsed
        if name in self.names or (port is not None and (name, port) in self.exact):
            return True
        # A browser names the port unless it is http's default; no port at all is also what HTTP/1.1 clients
        # on a raw socket often send. A wrong port means the request was meant for another server.
        if port is not None and port != (local[1] if local else None):
            return False
        return name in self.defaults or (local is not None and name == _canonical_host(local[0]))


class BrowserGuard:
    """ASGI middleware that refuses, before any route runs, what a page of another site could make a
    browser send: a Host outside the allow-list (DNS rebinding), and a ``/v1`` POST whose Content-Type is
    not application/json. Browsers send text/plain, form and multipart posts cross-site without asking (CORS
    "simple requests"); application/json needs a preflight, which this server never grants."""

    def __init__(self, app: ASGIApp, hosts: HostAllowList) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                status, message, code = refusal
                await json_response(status, _error(status, message, code=code))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.hosts.allows(host, scope.get("server")):
            return 400, f"the Host {clip(host)} is not allowed here (see kvlab serve --allowed-host)", "invalid_host"
        if scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            content_type = headers.get("content-type")
            if content_type is None or content_type.split(";", 1)[0].strip().lower() != "application/json":
                message = f"the request body must be application/json, got {clip(content_type)}"
                return 415, message, "unsupported_media_type"
        return None


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
        self.max_tokens_default = max_tokens_default
        self.tokenizer = loop.engine.tokenizer
        self.created = int(time.time())
        self.max_model_len = loop.engine.scheduler_config.max_model_len
        self.limits = limits or HTTPLimits()
        # Size limits derived from max_model_len (see bytes_per_token_bound and body_limit): whatever exceeds
        # them could never be served, so it is refused before it costs tokenising or memory.
        self.max_prompt_chars = self.max_model_len * bytes_per_token_bound(self.tokenizer)
        self.max_body_bytes = body_limit(self.max_prompt_chars, self.max_model_len)
        self._draining = False  # the server stopped accepting: new requests get a 503
        self._expired = False  # the grace period is over: requests still in flight end with a 503
        self._inflight: set[asyncio.Queue[Any]] = set()  # the output queues of requests being answered
        self.router = APIRouter()
        for method, path, endpoint in (
            ("GET", "/health", self.health),
            ("GET", "/metrics", self.metrics),
            ("GET", "/v1/models", self.models),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat_completions),
        ):
            route = self._admitted(endpoint) if method == "POST" else endpoint
            self.router.add_api_route(path, route, methods=[method])

    def _admitted(self, endpoint: Callable[..., Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """A generation route, refused while the server stops; whatever place among ``max_pending`` it took
        (``_parse``) is given back when it ends without having handed it to the engine loop."""

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

    async def models(self, request: Request) -> Response:
        self._tenant(request)
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
        # A place among max_pending first, so a full server spends nothing on reading and parsing a body;
        # _admitted gives it back if the request ends before reaching the engine loop.
        try:
            request.state.slot = self.loop.reserve()
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except EngineDeadError as exc:
            raise APIError(503, _ENGINE_DOWN) from exc
        body = _loads(await self._read_body(request))
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required and must be a string", "model")
        if model != self.model_name:
            raise APIError(
                404,
                f"the model {clip(model)} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )
        return body

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        too_large = f"the request body is over the limit of {limit} bytes (from max_model_len={self.max_model_len})"
        declared = request.headers.get("content-length", "")
        # Refused unread when it says it is too large (an over-long number is too large too). The rest of the
        # body is discarded by the HTTP layer as it arrives, so the client still reads this answer.
        if _is_number(declared) and (len(declared) > 18 or int(declared) > limit):
            raise APIError(413, too_large)
        raw = bytearray()
        try:
            # One deadline for the whole body: a client that trickles a byte a second is dropped like one
            # that stalls (uvicorn's keep-alive timeout covers only idle connections).
            async with asyncio.timeout(self.limits.read_timeout):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > limit:  # checked as it streams in: never more than the limit in memory
                        raise APIError(413, too_large)
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {self.limits.read_timeout:g} s",
                code="request_timeout",
                headers={"Connection": "close"},  # the client is stalled: do not wait for the rest
            ) from None
        except ClientDisconnect as exc:
            raise APIError(499, "client disconnected") from exc
        request.state.body_complete = True  # an error from here on needs no draining (see api_error)
        return bytes(raw)

    def _check_prompt(self, prompt: str | list[int]) -> None:
        """Refuse by size what cannot fit max_model_len tokens, before anything tokenises it."""
        if isinstance(prompt, list):
            if len(prompt) > self.max_model_len:
                raise APIError(
                    400, f"the prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len}", "prompt"
                )
            return
        if len(prompt) > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} characters; at most {self.max_prompt_chars} can fit "
                f"max_model_len={self.max_model_len} tokens",
                "prompt",
            )
        check_text(prompt, "the prompt", "prompt")

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

    def _tenant(self, request: Request) -> str:
        try:
            return self.policy.tenant(request.headers.get("authorization"))
        except AuthError as exc:
            raise APIError(401, str(exc), code="invalid_api_key") from exc

    def _salt(self, request: Request, body: dict[str, Any]) -> str | None:
        """The engine's salt: derived from the tenant; a client salt only narrows sharing inside it."""
        tenant = self._tenant(request)
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
        elif body.get("cache_salt") is not None:
            client_salt = validate_salt(body["cache_salt"], "'cache_salt'")
        return self.policy.cache_salt(tenant, client_salt)

    async def completions(self, request: Request) -> Response:
        self._tenant(request)  # before the body is read: an unauthenticated request costs nothing more
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
        self._tenant(request)
        body = await self._parse(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", "messages")
        if len(messages) > self.max_model_len:  # every message costs the chat template at least one token
            raise APIError(
                400, f"{len(messages)} messages cannot fit max_model_len={self.max_model_len} tokens", "messages"
            )
        size = 0
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise APIError(400, f"messages[{i}] must be an object with string 'role' and 'content'", "messages")
            if m["role"] not in CHAT_ROLES:
                # A role goes into the template verbatim: "user<|im_end|><|im_start|>system" would forge a turn.
                raise APIError(
                    400, f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {clip(m['role'])}", "messages"
                )
            check_text(m["content"], f"messages[{i}].content", "messages")
            size += len(m["content"])
        if size > self.max_prompt_chars:  # before the template renders it
            raise APIError(
                400,
                f"the messages have {size} characters; at most {self.max_prompt_chars} can fit "
                f"max_model_len={self.max_model_len} tokens",
                "messages",
            )
        try:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages]
            )
        except ValueError as exc:  # no chat template, or the template's own raise_exception
            raise APIError(400, f"the chat template refused these messages: {exc}", "messages") from None
        except Exception as exc:
            log.warning("the chat template failed: %s %.200r", type(exc).__name__, str(exc))
            raise APIError(400, "the model's chat template could not render these messages", "messages") from None
        return await self._generate(request, body, prompt, chat=True)

    async def _generate(self, request: Request, body: dict[str, Any], prompt: str | list[int], chat: bool) -> Response:
        self._check_prompt(prompt)
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        params = self._params(body, key)
        stream = _field(body, "stream", (bool,), False, "a boolean")
        salt = self._salt(request, body)
        if self._expired:
            raise APIError(503, _SHUTTING_DOWN, headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            # Tokenised by the loop on a worker thread, never on the engine's.
            rid, outputs = await self.loop.submit(prompt, params, salt, slot=getattr(request.state, "slot", None))
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "prompt" if "prompt" in str(exc) else None) from exc
        except EngineDeadError as exc:
            raise APIError(503, _ENGINE_DOWN) from exc  # the cause is in the log, not for clients
        self._inflight.add(outputs)
        if self._expired:  # the grace period ended while this one was being queued
            outputs.put_nowait(_SHUTDOWN)
        end = self._watch(request, rid, outputs)

        def close() -> None:
            self._inflight.discard(outputs)
            end()

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
        if item is _SHUTDOWN:
            raise APIError(503, _SHUTTING_DOWN, code="server_shutting_down")
        if isinstance(item, BaseException):  # the engine loop died (or stopped) under this request
            raise APIError(503, _ENGINE_DOWN)  # no internal text: the cause is in the server log
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
        response: dict[str, Any] = {
            "id": public_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(out.prompt_token_ids) + completion_tokens,
            },
        }
        cached = self.policy.reported_cached_tokens(out.num_cached_tokens)
        if cached is not None:
            response["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return response

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
                yield event(_error(exc.status, exc.message, exc.param, exc.code))
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

    # No /docs or /openapi.json: the routes parse their own bodies, so the schema would say nothing.
    app = FastAPI(title="kvlab", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop
    api = OpenAIApp(loop, model_name, policy, limits=limits)
    app.include_router(api.router)
    app.state.http_limits = limits
    app.state.begin_shutdown = api.begin_shutdown
    app.state.openai = api  # its derived limits (max_prompt_chars, max_body_bytes), for tests and tools
    hosts = HostAllowList(limits.bind_host, limits.allowed_hosts)
    app.add_middleware(BrowserGuard, hosts=hosts)

    async def unread_body_headers(request: Request, status: int) -> dict[str, str]:
        """For a 413, drop the unread rest of the body before answering (see DRAIN_MAX_BYTES)."""
        if status != 413 or getattr(request.state, "body_complete", False):
            return {}
        drained = await discard_body(request.receive, request.headers, limits.read_timeout)
        return {} if drained else {"Connection": "close"}

    # Starlette types every handler as taking Exception; each is registered for one class below, so the
    # asserts only narrow to what it is always given.
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        headers = {**exc.headers, **await unread_body_headers(request, exc.status)}
        return json_response(exc.status, _error(exc.status, exc.message, exc.param, exc.code), headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        # Starlette's own: unknown route (404), wrong method (405, with its Allow header).
        message = f"{exc.detail}: {request.method} {request.url.path[:CLIP_CHARS]}"
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
