"""How a request's outputs reach its client: collected into one answer, or sent as server-sent events as they
come; how a client going away is noticed; and how the server's stop ends the requests still in flight.

A request's engine requests answer on one queue (``asyncio.Queue``), told apart by request id. Besides
``RequestOutput`` the queue may carry None (the client went away), an exception (the engine loop died) or
``SHUTDOWN`` (the grace period ended): each ends the answer, a stream with an OpenAI-shaped error event."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from kvlab.engine.request import RequestOutput
from kvlab.server.errors import APIError, error_body
from kvlab.server.mapping import Job
from kvlab.server.openai_format import Formatter, StreamFormatter

log = logging.getLogger(__name__)

ENGINE_DOWN = "the engine is not running; see the server log"
SHUTTING_DOWN = "the server is shutting down; retry later"
DONE = "data: [DONE]\n\n"


class _ShuttingDown(Exception):
    """Put on a request's output queue when the shutdown grace period ends."""


SHUTDOWN = _ShuttingDown()


class Shutdown:
    """The server's stop, as requests see it: once ``draining``, new requests get a 503; once ``expired`` (the
    grace period is over), each request still in flight ends with a 503."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = False
        self._inflight: set[asyncio.Queue[Any]] = set()  # the output queues of requests being answered

    def begin(self, grace: float) -> None:
        """Called on the server's event loop when it stops accepting."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace, self._expire)

    def track(self, outputs: asyncio.Queue[Any]) -> None:
        self._inflight.add(outputs)
        if self.expired:  # the grace period ended while this request was being queued
            outputs.put_nowait(SHUTDOWN)

    def untrack(self, outputs: asyncio.Queue[Any]) -> None:
        self._inflight.discard(outputs)

    def _expire(self) -> None:
        self.expired = True
        if self._inflight:
            log.warning("ending %d request(s) still running after the shutdown grace period", len(self._inflight))
        for outputs in list(self._inflight):
            outputs.put_nowait(SHUTDOWN)


def watch_disconnect(request: Request, outputs: asyncio.Queue[Any]) -> asyncio.Future[None]:
    """Listen for the client going away, which wakes the reader of ``outputs`` with None; cancel when done."""

    async def watch() -> None:
        # The body has been read: the next ASGI message is the disconnect (or the end of the response).
        while (await request.receive())["type"] != "http.disconnect":
            pass
        outputs.put_nowait(None)

    return asyncio.ensure_future(watch())


async def next_output(outputs: asyncio.Queue[Any]) -> RequestOutput | None:
    """The next output, or None once the client has gone away."""
    item = await outputs.get()
    if item is SHUTDOWN:
        raise APIError(503, SHUTTING_DOWN, code="server_shutting_down")
    if isinstance(item, BaseException):  # the engine loop died (or stopped) under this request
        raise APIError(503, ENGINE_DOWN)  # no internal text: the cause is in the server log
    return item


async def collect(outputs: asyncio.Queue[Any], rids: Sequence[str]) -> list[RequestOutput]:
    """The final output of every request, in prompt order."""
    latest: dict[str, RequestOutput] = {}
    pending = set(rids)
    while pending:
        out = await next_output(outputs)
        if out is None:
            raise APIError(499, "client disconnected")
        latest[out.request_id] = out
        if out.finished:
            pending.discard(out.request_id)
    return [latest[r] for r in rids]


def answer(formatter: Formatter, job: Job, public_id: str, created: int, finals: list[RequestOutput]) -> BaseModel:
    """The whole answer of a request that does not stream."""
    if job.chat:
        return formatter.chat(public_id, created, finals[0], job.logprobs, job.return_token_ids)
    return formatter.completion(
        public_id, created, finals, job.prompts, job.echo, job.logprobs is not None, job.return_token_ids
    )


def sse(data: BaseModel | dict[str, Any]) -> str:
    obj = data.model_dump(mode="json") if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def events(
    formatter: Formatter, outputs: asyncio.Queue[Any], rids: Sequence[str], job: Job, public_id: str, created: int
) -> AsyncIterator[str]:
    """The answer as server-sent events: chunks as the outputs come, the usage chunk if asked for, [DONE].
    A chat stream starts with the role chunks; with ``return_token_ids`` they carry the prompt's token ids, so
    they wait for the first output (as vLLM's first chunk does)."""
    longest_stop = max((len(s) for s in job.params.stop), default=0)
    stream = StreamFormatter(
        formatter, public_id, created, job.chat, job.params.n, max(longest_stop - 1, 0), job.echo,
        job.logprobs, job.prompts, job.return_token_ids,
    )  # fmt: skip
    index_of = {rid: i for i, rid in enumerate(rids)}
    roles_due = job.chat
    if roles_due and not job.return_token_ids:
        for chunk in stream.role_chunks():
            yield sse(chunk)
        roles_due = False
    latest: dict[str, RequestOutput] = {}
    pending = set(rids)
    while pending:
        try:
            out = await next_output(outputs)
        except APIError as exc:
            yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
            break
        if out is None:
            return
        if roles_due:
            for chunk in stream.role_chunks(out.prompt_token_ids):
                yield sse(chunk)
            roles_due = False
        latest[out.request_id] = out
        if out.finished:
            pending.discard(out.request_id)
        for update in stream.updates(out, index_of[out.request_id]):
            yield sse(update)
    else:
        if job.include_usage:
            yield sse(stream.usage_chunk([latest[r] for r in rids]))
    yield DONE


class EventStream(StreamingResponse):
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
