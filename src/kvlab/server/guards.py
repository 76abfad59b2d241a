"""The HTTP hardening around the routes: what the server accepts and how long it waits.

Bad and oversized input costs its sender, not everyone: a body over the size limit is refused as it streams
in, and a prompt over the character limit (both derived from ``max_model_len``: ``bytes_per_token_bound``,
``body_limit``) before it is tokenised; a body that does not arrive within the read timeout gets a 408; JSON
the parser cannot take (deep nesting, 5,000-digit integers) is a 400. Requests a browser could be tricked into
sending are refused before any route runs: a ``Host`` outside the allow-list (DNS rebinding) and a POST that
is not ``application/json`` (a cross-site form post).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvlab.server.errors import APIError, clip, error_body, json_response

log = logging.getLogger(__name__)

MAX_SALT_LEN = 256
# Seconds a client has to send a request's head, and then its body: a stalled or trickling client is dropped.
READ_TIMEOUT_S = 30.0
# Seconds requests in flight get to finish when the server stops, before each ends with a 503.
SHUTDOWN_GRACE_S = 5.0


def validate_salt(value: Any, source: str) -> str:
    """A salt is 1..256 printable ASCII characters: anything else is more likely a bug than a tenant id."""
    if not isinstance(value, str):
        raise APIError(400, f"{source} must be a string, got {type(value).__name__}", "cache_salt")
    if not 0 < len(value) <= MAX_SALT_LEN or not all(" " <= c <= "~" for c in value):
        raise APIError(
            400, f"{source} must be 1..{MAX_SALT_LEN} printable ASCII characters, got {value!r:.80}", "cache_salt"
        )
    return value


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def loads_json(raw: bytes) -> Any:
    """The body as Python values; a 400 (never a 500) for anything the parser refuses.

    Read the way a filtering proxy in front of the server reads it, so both see one request: UTF-8 only (RFC
    8259 §8.1: no UTF-16 or UTF-32, no byte order mark, which Python's parser would otherwise detect and
    accept), and every object's keys unique (a proxy that checks the first ``max_tokens`` and a server that
    used the last would read two different requests)."""
    encoding = json.detect_encoding(raw)
    if encoding != "utf-8":
        what = "starts with a UTF-8 byte order mark" if encoding == "utf-8-sig" else f"is {encoding.upper()}"
        raise APIError(400, f"the request body {what}: JSON bodies must be UTF-8 without a byte order mark")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        message = f"the request body has the key {clip(exc.key)} more than once in one object"
        raise APIError(400, message, exc.key if len(exc.key) <= 64 else None) from None
    except RecursionError:
        # The C parser counts its depth (10k nested arrays): a client error, not a server one.
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: it is not UTF-8 ({exc.reason})") from None
    except ValueError as exc:
        # JSONDecodeError, and what Python's int-string conversion limit raises for an integer literal of
        # more than 4,300 digits.
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


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


# A body found too large as it streams in (chunked: no length to refuse up front) gets its 413 once its rest
# has been read and dropped, up to this many bytes, and the connection stays usable; a client still sending
# would otherwise see its connection reset instead of the answer. Memory stays flat: nothing is kept. A
# larger rest, or a body declared too large (answered at once, unread), gets the answer with Connection:
# close, and the HTTP layer's lingering close reads and drops up to this many bytes more of what is still
# arriving (serve.TimedH11Protocol.close_transport). Other early answers (401, 415, 429) are not held back:
# their bodies are small, and a keep-alive client's rest is dropped by the HTTP layer as it arrives.
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
    browser send: a Host outside the allow-list (DNS rebinding), and a POST (``/v1``, ``/tokenize``, ...)
    whose Content-Type is not application/json. Browsers send text/plain, form and multipart posts
    cross-site without asking (CORS "simple requests"); application/json needs a preflight, which this
    server never grants."""

    def __init__(self, app: ASGIApp, hosts: HostAllowList) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                status, message, code = refusal
                await json_response(status, error_body(status, message, code=code))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.hosts.allows(host, scope.get("server")):
            return 400, f"the Host {clip(host)} is not allowed here (see kvlab serve --allowed-host)", "invalid_host"
        if scope["method"] == "POST":
            content_type = headers.get("content-type")
            media, _, params = (content_type or "").partition(";")
            if content_type is None or media.strip().lower() != "application/json":
                message = f"the request body must be application/json, got {clip(content_type)}"
                return 415, message, "unsupported_media_type"
            charset = _charset(params)
            if charset is not None and charset.lower() not in ("utf-8", "utf8"):
                # A proxy would decode the body as this charset, the JSON parser as UTF-8: two readings.
                message = f"the request body must be UTF-8 JSON (RFC 8259), got charset={clip(charset)}"
                return 415, message, "unsupported_media_type"
        return None


def _charset(params: str) -> str | None:
    """The ``charset`` parameter of a Content-Type's parameters (after the media type), unquoted; None if absent."""
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"')
    return None


async def read_body(request: Request, limit: int, timeout: float, why: str) -> bytes:
    """The whole body, at most ``limit`` bytes (``why`` says where the limit comes from), within ``timeout``
    seconds; a 413, 408 or 499 otherwise. Read by hand, not by FastAPI: a body is refused as it streams in,
    before it is ever whole in memory, and before any parsing."""
    too_large = f"the request body is over the limit of {limit} bytes ({why})"
    declared = request.headers.get("content-length", "")
    # Refused unread when it says it is too large (an over-long number is too large too), at once: the body
    # was never going to be read, so waiting for it would only make a client that stalls wait for the read
    # timeout. The connection closes; the HTTP layer's lingering close (serve.TimedH11Protocol) drops what
    # is still arriving, so a client still sending reads this answer rather than a reset.
    if _is_number(declared) and (len(declared) > 18 or int(declared) > limit):
        raise APIError(413, too_large, headers={"Connection": "close"})
    raw = bytearray()
    try:
        # One deadline for the whole body: a client that trickles a byte a second is dropped like one
        # that stalls (uvicorn's keep-alive timeout covers only idle connections).
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:  # checked as it streams in: never more than the limit in memory
                    raise APIError(413, too_large)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            code="request_timeout",
            headers={"Connection": "close"},  # the client is stalled: do not wait for the rest
        ) from None
    except ClientDisconnect as exc:
        raise APIError(499, "client disconnected") from exc
    request.state.body_complete = True  # an error from here on needs no draining (see create_app)
    return bytes(raw)
