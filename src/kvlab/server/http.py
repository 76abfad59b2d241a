"""A small HTTP/1.1 server on asyncio streams (one request per connection).

Known debt: the house rule is FastAPI + uvicorn for the server. This module was written in a session
whose environment lacked them; it handles exactly what an OpenAI client needs (Content-Length bodies,
JSON responses, server-sent events, noticing a client that goes away so its request is aborted) and is
the one module to replace when porting: the routes (app.py) and the engine loop do not depend on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class HTTPRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    # Set when the peer closes its side: the handler aborts the work it started for this request.
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    # Server-sent events: each yielded string is sent as one ``data:`` event.
    stream: AsyncIterator[str] | None = None
    # Called once the response is over, however it ended (even if the stream never started): the place
    # to abort the work behind a stream whose client went away.
    on_close: Callable[[], None] | None = None


def json_response(status: int, obj: Any) -> Response:
    return Response(status, json.dumps(obj, ensure_ascii=False).encode())


Handler = Callable[[HTTPRequest], Awaitable[Response]]


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _read_request(reader: asyncio.StreamReader) -> HTTPRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError as exc:
        raise _BadRequest(431, "request headers too large") from exc
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError as exc:
        raise _BadRequest(400, f"malformed request line {lines[0]!r}") from exc
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadRequest(400, f"malformed header line {line!r}")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _BadRequest(411, "chunked request bodies are not supported: send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError as exc:
        raise _BadRequest(400, "Content-Length is not an integer") from exc
    if length < 0 or length > MAX_BODY_BYTES:
        raise _BadRequest(413, f"request body of {length} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        body = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        return None
    return HTTPRequest(method.upper(), target.split("?", 1)[0], headers, body)


def _head(status: int, headers: dict[str, str]) -> bytes:
    reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HTTPServer:
    def __init__(self, handler: Handler, error_body: Callable[[int, str], bytes]) -> None:
        self.handler = handler
        self.error_body = error_body
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(self._connection, host, port, limit=MAX_HEADER_BYTES, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def serve_forever(self) -> None:
        assert self._server is not None, "call start() first"
        async with self._server:
            await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                req = await _read_request(reader)
            except _BadRequest as exc:
                await self._send(writer, Response(exc.status, self.error_body(exc.status, str(exc))))
                return
            if req is None:
                return
            watcher = asyncio.ensure_future(self._watch(reader, req.disconnected))
            try:
                resp = await self.handler(req)
                await self._send(writer, resp, req.disconnected)
            finally:
                watcher.cancel()
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("error while serving a connection")
        finally:
            writer.close()

    @staticmethod
    async def _watch(reader: asyncio.StreamReader, disconnected: asyncio.Event) -> None:
        # One request per connection: any read that returns means the client closed (or misbehaves).
        try:
            while await reader.read(4096):
                pass
        except ConnectionError:
            pass
        disconnected.set()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, resp: Response, disconnected: asyncio.Event | None = None) -> None:
        headers = {"Content-Type": resp.content_type, "Connection": "close"}
        if resp.stream is None:
            headers["Content-Length"] = str(len(resp.body))
            writer.write(_head(resp.status, headers) + resp.body)
            await writer.drain()
            return
        headers["Content-Type"] = "text/event-stream; charset=utf-8"
        headers["Cache-Control"] = "no-cache"
        try:
            writer.write(_head(resp.status, headers))
            async for event in resp.stream:
                if disconnected is not None and disconnected.is_set():
                    break
                writer.write(f"data: {event}\n\n".encode())
                await writer.drain()
        finally:
            # Closing the generator runs its cleanup (the abort) even when the client went away. When a
            # cancellation hit it mid-``__anext__`` its cleanup has already run, and Python 3.11 then
            # still calls it "running": nothing is left to do.
            with contextlib.suppress(RuntimeError):
                await resp.stream.aclose()  # type: ignore[attr-defined]
            if resp.on_close is not None:
                resp.on_close()
