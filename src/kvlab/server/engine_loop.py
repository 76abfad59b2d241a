"""The one thread that owns the engine.

The engine is not thread-safe, so every call into it happens on this thread: HTTP handlers send
commands (add, abort) through a queue and receive outputs on their own asyncio queue. While any
request is in flight the thread steps the engine without pause, so requests that arrive mid-run join
the running batch at the next step (continuous batching); when idle it blocks on the command queue.

Prompts are tokenised by ``submit`` on a worker thread, never here: one client's huge prompt must not
stall the steps every other request is waiting on. A place among ``max_pending`` can be taken with
``reserve`` before the request's body is even read, so a full server answers 429 at no cost. Each tenant
may have at most ``max_tenant_seqs`` sequences (prompts times n) in flight: one tenant's backlog is its own,
and the scheduler shares the engine fairly among the tenants that have work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvlab.engine.engine import Engine
from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling import InvalidRequestError, SamplingParams, bad_words_token_ids
from kvlab.engine.stats import EngineStats
from kvlab.server.public_prefixes import PublicPrefixes, resolve_public_prefix

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests in flight: the client should retry later (HTTP 429)."""


class TenantBusyError(QueueFullError):
    """The sender's tenant has its share of sequences in flight: it should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; no request can be served."""


class OutputObserver(Protocol):
    """Told, on the loop's thread, of every output delivered and every request aborted (the server's metrics).
    It must be quick and must not raise; if it does, the loop logs it and goes on without it."""

    def on_output(self, out: RequestOutput) -> None: ...

    def on_abort(self, request_id: str, n: int) -> None: ...

    def reset(self) -> None: ...


class Slot:
    """One of the ``max_pending`` places, taken by ``EngineLoop.reserve``. Hand it to ``submit`` (the loop
    then frees it when the request ends) or ``release`` it; releasing twice, or after ``submit``, is a no-op."""

    def __init__(self, owner: EngineLoop) -> None:
        self._owner: EngineLoop | None = owner
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self._owner is not None

    def release(self) -> None:
        owner = self._take()
        if owner is not None:
            owner._release()

    def _take(self) -> EngineLoop | None:
        with self._lock:
            owner, self._owner = self._owner, None
        return owner


@dataclass
class _Add:
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    tenant: str | None
    request_id: str
    out: asyncio.Queue[Any]  # RequestOutput or the BaseException that ended the loop; maybe shared
    loop: asyncio.AbstractEventLoop
    accepted: concurrent.futures.Future[None]
    public_prefix_tokens: int = 0


@dataclass
class _Abort:
    request_id: str


class EngineLoop:
    """Runs ``engine`` on a background thread; ``submit`` / ``abort`` are safe from any event loop."""

    def __init__(
        self,
        engine: Engine,
        max_pending: int = 256,
        max_request_seqs: int | None = None,
        max_tenant_seqs: int | None = None,
        public_prefixes: PublicPrefixes | None = None,
    ) -> None:
        """``max_request_seqs``: sequences (prompts x n) one HTTP request may ask for (default: max_num_seqs, a
        full running batch); ``max_tenant_seqs``: sequences one tenant may have in flight (default: 4 x
        max_num_seqs). The server enforces the first, ``submit`` the second. ``public_prefixes``: the operator's
        (``--public-prefix-file``), matched against every prompt's token ids once tokenised."""
        self.engine = engine
        self.public_prefixes = public_prefixes
        self.max_pending = max_pending
        seats = engine.scheduler_config.max_num_seqs
        self.max_request_seqs = seats if max_request_seqs is None else max_request_seqs
        self.max_tenant_seqs = 4 * seats if max_tenant_seqs is None else max_tenant_seqs
        for name in ("max_pending", "max_request_seqs", "max_tenant_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._tenant_seqs: dict[str | None, int] = {}  # under _pending_lock, like _pending
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._streams: dict[str, _Add] = {}
        # Counted on the caller's side at submit time, so the 429 decision needs no round trip to the thread.
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._violations = self._count_violations()
        self.observer: OutputObserver | None = None  # set before start(); see OutputObserver
        self._error: BaseException | None = None
        self._closed = False  # stopped by stop(): like _error, makes submit refuse (under _state_lock)
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
    def num_violations(self) -> int | None:
        """Foreign reads the KV sanitizer caught, as of the last step; None without the sanitizer."""
        return self._violations

    def _count_violations(self) -> int | None:
        return None if self.engine.sanitizer is None else len(self.engine.violations)

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

    def reserve(self) -> Slot:
        """Take one of the ``max_pending`` places for a request about to be read. Raises ``QueueFullError``
        (HTTP 429) or ``EngineDeadError``."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        with self._pending_lock:
            if self._pending >= self.max_pending:
                raise QueueFullError(
                    f"{self._pending} requests are already in flight (max_pending={self.max_pending}); retry later"
                )
            self._pending += 1
        return Slot(self)

    async def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        slot: Slot | None = None,
        out: asyncio.Queue[Any] | None = None,
        tenant: str | None = None,
        public_prefix_tokens: int = 0,
    ) -> tuple[str, asyncio.Queue[Any]]:
        """Queue a request; returns its id and the queue its outputs arrive on (the last one has
        ``finished``). Raises ``QueueFullError`` (``TenantBusyError`` when ``tenant`` has its
        ``max_tenant_seqs`` in flight), ``InvalidRequestError`` or ``EngineDeadError``.

        ``slot`` is a place taken earlier by ``reserve`` (else one is taken here); a text prompt is
        tokenised on a worker thread, so the engine thread only ever sees token ids. ``out``: a queue to
        share with other requests (several prompts of one HTTP request), told apart by ``request_id``.
        ``public_prefix_tokens``: the client's (``kvlab_public_prefix_tokens``); the engine gets the larger of it
        and the operator's longest public prefix the token ids start with (``public_prefixes``)."""
        slot = slot if slot is not None else self.reserve()
        try:
            ids = await self._tokenize(prompt)
            if params.bad_words and not params.bad_words_token_ids:  # tokenised here too, as the prompt is
                words = await asyncio.to_thread(bad_words_token_ids, self.engine.tokenizer, params.bad_words)
                params = dataclasses.replace(params, bad_words_token_ids=words)
            public = resolve_public_prefix(ids, public_prefix_tokens, self.public_prefixes)
        except BaseException:
            slot.release()
            raise
        rid = f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        queue_ = out if out is not None else asyncio.Queue()
        cmd = _Add(ids, params, cache_salt, tenant, rid, queue_, loop, concurrent.futures.Future(), public)
        with self._state_lock:
            # Under the lock that _die takes: a command is either queued before death (and failed by it)
            # or refused here, never left in a queue nobody reads.
            if self._error is not None or self._closed:
                slot.release()
                raise EngineDeadError("the engine loop is not running")
            try:
                self._take_tenant_seqs(tenant, params.n)
            except TenantBusyError:
                slot.release()
                raise
            if slot._take() is None:  # released behind our back (a bug): never count a request twice
                raise RuntimeError("submit() was given a slot that was already released")
            # From here the loop thread owns the count: it releases it when the request is refused,
            # aborted, finished, or failed by the loop's death.
            self._commands.put(cmd)
        try:
            await asyncio.wrap_future(cmd.accepted)
        except asyncio.CancelledError:
            # The client's task was cancelled (it went away, or the server is stopping) while the command
            # waited in the queue: the request may be admitted after all, so abort it rather than leave it
            # running for nobody. The abort follows the add in the queue, so it always finds it.
            self.abort(rid)
            raise
        return rid, cmd.out

    async def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        try:
            # Off the event loop and off the engine thread: the default executor's workers.
            return await asyncio.to_thread(self.engine.tokenizer.encode, prompt)
        except Exception as exc:
            # One line, not a traceback: a client can send this as often as it likes. %r: the message may
            # hold the offending character (a lone surrogate), which a UTF-8 log stream cannot write.
            log.warning("a prompt could not be tokenised: %s %.200r", type(exc).__name__, str(exc))
            raise InvalidRequestError("the prompt could not be tokenised; is it valid Unicode text?") from exc

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _take_tenant_seqs(self, tenant: str | None, n: int) -> None:
        with self._pending_lock:
            held = self._tenant_seqs.get(tenant, 0)
            if held + n > self.max_tenant_seqs:
                # The sender's own numbers only: nothing here tells it about anyone else's traffic.
                raise TenantBusyError(
                    f"this API key already has {held} sequences in flight; {n} more would pass the limit of "
                    f"{self.max_tenant_seqs} (kvlab serve --max-tenant-seqs); retry later"
                )
            self._tenant_seqs[tenant] = held + n

    def _release(self, cmd: _Add | None = None) -> None:
        """Give back a place among max_pending, and the sequences ``cmd`` held of its tenant's share."""
        with self._pending_lock:
            self._pending -= 1
            if cmd is not None:
                left = self._tenant_seqs[cmd.tenant] - cmd.params.n
                if left:
                    self._tenant_seqs[cmd.tenant] = left
                else:
                    del self._tenant_seqs[cmd.tenant]  # tenants come and go: keep no entry for an idle one

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
                    # Stopped: whatever is still in flight or queued ends now, with an error its client sees
                    # (the server has already let in-flight requests finish or ended them itself).
                    with self._state_lock:
                        self._closed = True
                        self._fail_all(EngineDeadError("the engine loop has stopped"))
                    return
                outs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # Stats first: a client that reads /metrics right after its answer must see this step.
                self._stats = self.engine.stats()
                self._violations = self._count_violations()
                for out in outs:
                    self._deliver(out)
        except BaseException as exc:
            log.exception("engine loop died")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Fail every request in flight and every command still queued, at once; then tell the owner."""
        with self._state_lock:
            self._error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {type(exc).__name__}"))
        for callback in self.on_death:
            callback(exc)

    def _fail_all(self, error: EngineDeadError) -> None:
        self._observe("reset")
        for cmd in list(self._streams.values()):
            self._push(cmd, error)
            self._release(cmd)
        self._streams.clear()
        while True:
            try:
                queued = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(queued, _Add) and not queued.accepted.done():
                queued.accepted.set_exception(error)
                self._release(queued)

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
                self.engine.add_request(
                    cmd.prompt,
                    cmd.params,
                    request_id=cmd.request_id,
                    cache_salt=cmd.cache_salt,
                    tenant=cmd.tenant,
                    public_prefix_tokens=cmd.public_prefix_tokens,
                )
            except InvalidRequestError as exc:
                self._release(cmd)
                cmd.accepted.set_exception(exc)
                continue
            except Exception:  # one odd request must not stop the loop for everyone
                log.exception("request %s could not be added", cmd.request_id)
                self._release(cmd)
                # The traceback is in the log; the client learns nothing of the internals.
                cmd.accepted.set_exception(InvalidRequestError("the request could not be queued; see the server log"))
                continue
            self._streams[cmd.request_id] = cmd
            cmd.accepted.set_result(None)

    def _abort(self, request_id: str) -> None:
        cmd = self._streams.pop(request_id, None)
        if cmd is None:
            return  # already finished
        self.engine.abort(request_id)
        self._observe("on_abort", request_id, cmd.params.n)
        self._forget(request_id)
        self._stats = self.engine.stats()
        self._release(cmd)

    def _deliver(self, out: RequestOutput) -> None:
        cmd = self._streams.get(out.request_id)
        if cmd is None:
            return
        self._observe("on_output", out)
        if out.finished:
            # Released before the client hears of it, so the client never sees its own request in flight.
            del self._streams[out.request_id]
            self._forget(out.request_id)
            self._release(cmd)
        self._push(cmd, out)

    def _forget(self, request_id: str) -> None:
        # The engine keeps every group for ``output()``; a server that runs for days must drop them.
        self.engine.release(request_id)

    def _observe(self, method: str, *args: Any) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, method)(*args)
        except Exception:  # metrics must never stop the engine: drop the observer, keep serving
            log.exception("the output observer failed; it is switched off")
            self.observer = None

    @staticmethod
    def _push(cmd: _Add, item: Any) -> None:
        # RuntimeError: the client's event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            cmd.loop.call_soon_threadsafe(cmd.out.put_nowait, item)
