"""The one thread that owns the engine.

The engine is not thread-safe, so every call into it happens on this thread: HTTP handlers send
commands (add, abort) through a queue and receive outputs on their own asyncio queue. While any
request is in flight the thread steps the engine without pause, so requests that arrive mid-run join
the running batch at the next step (continuous batching); when idle it blocks on the command queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.engine.engine import Engine, EngineStats
from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests in flight: the client should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; no request can be served."""


@dataclass
class _Add:
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    request_id: str
    out: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    accepted: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_id: str


class EngineLoop:
    """Runs ``engine`` on a background thread; ``submit`` / ``abort`` are safe from any event loop."""

    def __init__(self, engine: Engine, max_pending: int = 256) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._streams: dict[str, _Add] = {}
        # Counted on the caller's side at submit time, so the 429 decision needs no round trip to the thread.
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._state_lock = threading.Lock()
        self.on_death: list[Callable[[BaseException], None]] = []  # e.g. the server stopping itself
        self._thread = threading.Thread(target=self._run, name="kvlab-engine-loop", daemon=True)

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def stats(self) -> EngineStats:
        """The stats as of the last step (a snapshot: reading the engine itself would race the loop)."""
        return self._stats

    @property
    def num_pending(self) -> int:
        return self._pending

    @property
    def stopped_cleanly(self) -> bool:
        """Stopped by ``stop()``, not by an error."""
        return self._error is None and not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    async def submit(
        self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> tuple[str, asyncio.Queue[RequestOutput | BaseException]]:
        """Queue a request; returns its id and the queue its outputs arrive on (the last one has
        ``finished``). Raises ``QueueFullError``, ``InvalidRequestError`` or ``EngineDeadError``."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        with self._pending_lock:
            if self._pending >= self.max_pending:
                raise QueueFullError(
                    f"{self._pending} requests are already in flight (max_pending={self.max_pending}); retry later"
                )
            self._pending += 1
        rid = f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        cmd = _Add(prompt, params, cache_salt, rid, asyncio.Queue(), loop, concurrent.futures.Future())
        with self._state_lock:
            # Under the lock that _die takes: a command is either queued before death (and failed by it)
            # or refused here, never left in a queue nobody reads.
            if self._error is not None:
                self._release()
                raise EngineDeadError("the engine loop is not running")
            self._commands.put(cmd)
        try:
            await asyncio.wrap_future(cmd.accepted)
        except BaseException:
            self._release()
            raise
        return rid, cmd.out

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _release(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    # ------------------------------------------------------------ loop thread
    def _run(self) -> None:
        # Engine.step isolates every fault it can pin on one request (that request ends with an error);
        # an exception that still reaches here means the engine's own state may be broken, so the loop
        # stops for good and says so rather than serving on from an unknown state.
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                # Block only when idle; with work in flight, take whatever commands arrived and step.
                if not self._drain(block=not busy):
                    return
                outs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # Stats first: a client that reads /metrics right after its answer must see this step.
                self._stats = self.engine.stats()
                for out in outs:
                    self._deliver(out)
        except BaseException as exc:
            log.exception("engine loop died")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Fail every request in flight and every command still queued, at once; then tell the owner."""
        with self._state_lock:
            self._error = exc
            dead = EngineDeadError(f"engine loop died: {type(exc).__name__}")
            for cmd in list(self._streams.values()):
                self._push(cmd, dead)
            self._streams.clear()
            while True:
                try:
                    queued = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(queued, _Add) and not queued.accepted.done():
                    queued.accepted.set_exception(dead)
        for callback in self.on_death:
            callback(exc)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
                continue
            try:
                self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id, cache_salt=cmd.cache_salt)
            except InvalidRequestError as exc:
                cmd.accepted.set_exception(exc)
                continue
            except Exception as exc:  # one odd request must not stop the loop for everyone
                log.exception("request %s could not be added", cmd.request_id)
                cmd.accepted.set_exception(InvalidRequestError(f"the request could not be queued: {exc}"))
                continue
            self._streams[cmd.request_id] = cmd
            cmd.accepted.set_result(None)

    def _abort(self, request_id: str) -> None:
        cmd = self._streams.pop(request_id, None)
        if cmd is None:
            return  # already finished
        self.engine.abort(request_id)
        self._forget(request_id)
        self._stats = self.engine.stats()
        self._release()

    def _deliver(self, out: RequestOutput) -> None:
        cmd = self._streams.get(out.request_id)
        if cmd is None:
            return
        if out.finished:
            # Released before the client hears of it, so the client never sees its own request in flight.
            del self._streams[out.request_id]
            self._forget(out.request_id)
            self._release()
        self._push(cmd, out)

    def _forget(self, request_id: str) -> None:
        # The engine keeps every group for ``output()``; a server that runs for days must drop them.
        self.engine.release(request_id)

    @staticmethod
    def _push(cmd: _Add, item: Any) -> None:
        # RuntimeError: the client's event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            cmd.loop.call_soon_threadsafe(cmd.out.put_nowait, item)
