"""Build the engine and app a server runs, and run them under uvicorn: on a background thread
(``RunningServer``: tests, embedding) or in the foreground (``kvlab serve``)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvlab.config import CacheConfig, ConfigError, SchedulerConfig, admission_blocks
from kvlab.engine.engine import Engine
from kvlab.engine.sizing import default_max_model_len, kv_rounding
from kvlab.memory import human_bytes
from kvlab.model.loader import LoadedModel, load_model
from kvlab.server.app import create_app
from kvlab.server.engine_loop import EngineLoop
from kvlab.server.guards import DRAIN_MAX_BYTES, READ_TIMEOUT_S, SHUTDOWN_GRACE_S, HTTPLimits
from kvlab.server.public_prefixes import PublicPrefixes, load_public_prefixes
from kvlab.server.tenancy import TenancyPolicy

log = logging.getLogger(__name__)

# When the server stops, requests in flight get ServerConfig.shutdown_grace seconds to finish; then the app
# ends each with an error, and uvicorn gets this many seconds more to write those answers before it cancels
# whatever is left (a client that does not read, say).
SHUTDOWN_FLUSH_S = 2.0


@dataclass
class ServerConfig:
    model: str = "mini"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_pending: int = 256
    # What one request and one tenant may put in flight, in sequences (prompts x n): None = the loop's
    # defaults (max_num_seqs per request, 4 x max_num_seqs per tenant). See EngineLoop.
    max_request_seqs: int | None = None
    max_tenant_seqs: int | None = None
    # HTTP hardening, so that a bad or slow client costs only itself. Host header values allowed besides the
    # bind address and localhost ("name", "name:port", or "*" for any); seconds a client has to send a
    # request's head, then its body; seconds requests in flight get to finish when the server stops (then
    # each ends with a 503).
    allowed_hosts: tuple[str, ...] = ()
    read_timeout: float = READ_TIMEOUT_S
    shutdown_grace: float = SHUTDOWN_GRACE_S
    unsafe_strategy: str | None = None
    # The engine's fast modes (``Engine(quantization=, attention_backend=)``); the model's dtype is the
    # loaded model's.
    quantization: str | None = None
    attention_backend: str = "reference"
    cache: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    weights_seed: int = 0  # a mini model's random weights
    # vLLM's --seed: one sampling stream for every request without a seed of its own, so one tenant's draws move
    # another's. None: each such request draws from a stream of its own (Engine(seed=)).
    seed: int | None = None
    # Tenancy (docs/architecture.md, "Security model"): API key -> tenant name; empty = no keys required.
    api_keys: dict[str, str] = field(default_factory=dict)
    # Who may share prefix-cache entries: "global" (everyone), "per-tenant" (requests of one tenant; all
    # key-less requests are one tenant), "off" (nobody: prefix caching disabled).
    prefix_sharing: str = "per-tenant"
    # usage.prompt_tokens_details.cached_tokens: "exact", "block" (rounded down to whole blocks), "off".
    report_cached_tokens: str = "block"
    # Honour X-Cache-Salt (only behind a proxy that sets it; otherwise a request carrying it gets a 400).
    trust_salt_header: bool = False
    # /metrics (tenancy.metrics_access): with a key, only for its holder (never a tenant's key); public, open
    # to anyone whatever it reveals; neither, open only while it tells no client more than its responses.
    metrics_api_key: str | None = None
    public_metrics: bool = False
    # Texts or chat messages shared across tenants (server.public_prefixes): a prompt that starts with one has
    # its full blocks keyed without the tenant's salt. None: only what clients declare public themselves.
    public_prefix_file: Path | None = None


def build_engine(cfg: ServerConfig, loaded: LoadedModel | None = None) -> Engine:
    """The engine the server runs; the same defaults as ``LLM(model)`` so offline and served outputs agree."""
    loaded = loaded or load_model(cfg.model, seed=cfg.weights_seed)
    cache_kw = dict(cfg.cache)
    # Fair eviction where there are tenants to be fair between; with one tenant it is the LRU order anyway.
    cache_kw.setdefault("eviction", "fair" if cfg.api_keys else "lru")
    if cfg.prefix_sharing == "off":
        cache_kw["share_prefix"] = False
    sched_kw = dict(cfg.scheduler)
    # unsafe=True: this config only sizes the pool; the real one is validated below.
    sizing = CacheConfig(**{**cache_kw, "unsafe": True})
    sched_kw.setdefault("max_model_len", default_max_model_len(loaded, sizing))
    if cfg.unsafe_strategy is not None:
        from kvlab.experiment.strategies import BUILTIN_STRATEGIES

        strategy = BUILTIN_STRATEGIES.get(cfg.unsafe_strategy)
        if strategy is None:
            raise ConfigError(f"unknown strategy {cfg.unsafe_strategy!r}; built-in: {', '.join(BUILTIN_STRATEGIES)}")
        cache, sched = strategy.configs(cache_kw, sched_kw)
    else:
        cache = CacheConfig(**cache_kw)
        sched = SchedulerConfig(**sched_kw)
    return Engine(
        loaded, cache, sched, quantization=cfg.quantization, attention_backend=cfg.attention_backend, seed=cfg.seed
    )


def tenancy_policy(cfg: ServerConfig, block_size: int) -> TenancyPolicy:
    return TenancyPolicy(
        api_keys=dict(cfg.api_keys),
        prefix_sharing=cfg.prefix_sharing,
        report_cached_tokens=cfg.report_cached_tokens,
        trust_salt_header=cfg.trust_salt_header,
        block_size=block_size,
        metrics_api_key=cfg.metrics_api_key,
        public_metrics=cfg.public_metrics,
    )


def log_kv_capacity(engine: Engine) -> bool:
    """One line on what the KV pool holds, and a warning when it cannot hold one request of max_model_len
    tokens (such a request would be refused, however idle the server). True when it warned."""
    cc, mml = engine.cache_config, engine.scheduler_config.max_model_len
    tokens = cc.num_blocks * cc.block_size
    storage = engine.storage
    log.info(
        "KV cache: %d blocks x %d tokens = %d tokens in %s, %s (%d bytes); max_model_len=%d",
        cc.num_blocks, cc.block_size, tokens, str(storage.dtype).removeprefix("torch."), human_bytes(storage.nbytes()),
        storage.nbytes(), mml,
    )  # fmt: skip
    # The engine's own admission rule (config.admission_blocks) for one request of max_model_len tokens.
    needed = admission_blocks(mml, cc.block_size)
    if needed <= cc.num_blocks:
        return False
    log.warning(
        "the KV cache (%d blocks of %d tokens) cannot hold one request of max_model_len=%d tokens (%d blocks "
        "with the copy-on-write spare): the longest requests will be refused; raise --num-blocks or lower "
        "--max-model-len",
        cc.num_blocks, cc.block_size, mml, needed,
    )  # fmt: skip
    return True


def warn_if_cache_rounds(engine: Engine) -> bool:
    """One warning where the pool stores K/V in a narrower dtype than the model computes in (a bf16 or fp8 cache):
    what that choice lets clients observe of each other. True when it warned."""
    stored, computed = engine.storage.dtype, engine.model.dtype
    if kv_rounding(stored, computed) is None:
        return False
    log.warning(
        "the KV cache stores K/V rounded to %s (the model computes in %s): a request's K/V can differ in their "
        "last bits with the other requests of its step and with prefix-cache hits, and rounding can turn that into "
        "another code, so an answer may change with other clients' traffic (kvlab probe can report it as a leak; "
        "docs/serving.md)",
        str(stored).removeprefix("torch."), str(computed).removeprefix("torch."),
    )  # fmt: skip
    return True


def build_app(cfg: ServerConfig, loaded: LoadedModel | None = None) -> FastAPI:
    engine = build_engine(cfg, loaded)
    log_kv_capacity(engine)
    warn_if_cache_rounds(engine)
    policy = tenancy_policy(cfg, engine.cache_config.block_size)
    log.info("%s", policy.describe())
    loop = EngineLoop(
        engine,
        max_pending=cfg.max_pending,
        max_request_seqs=cfg.max_request_seqs,
        max_tenant_seqs=cfg.max_tenant_seqs,
        public_prefixes=public_prefixes(cfg, engine),
    )
    warn_if_exposed(cfg)
    warn_if_metrics_public(policy)
    return create_app(loop, cfg.served_model_name or engine.loaded.name, policy, limits=http_limits(cfg))


def public_prefixes(cfg: ServerConfig, engine: Engine) -> PublicPrefixes | None:
    """The operator's public prefixes, tokenised with the served tokenizer (``PublicPrefixFileError``, a
    ValueError, names what is wrong with the file), and one log line on what they share."""
    if cfg.public_prefix_file is None:
        return None
    bs = engine.cache_config.block_size
    found = load_public_prefixes(cfg.public_prefix_file, engine.tokenizer, engine.scheduler_config.max_model_len, bs)
    sizes = sorted(len(p) for p in found.prefixes)
    shared = {
        "per-tenant": f"shared across tenants in whole blocks of {bs} tokens",
        "global": "shared across client salts (the rest is shared anyway: --prefix-sharing global)",
        "off": "not shared: prefix caching is off",
    }[cfg.prefix_sharing]
    log.info("public prefixes: %d from %s (%d..%d tokens), %s", len(found), cfg.public_prefix_file, sizes[0],
             sizes[-1], shared)  # fmt: skip
    return found


def http_limits(cfg: ServerConfig) -> HTTPLimits:
    return HTTPLimits(
        bind_host=cfg.host,
        allowed_hosts=tuple(cfg.allowed_hosts),
        read_timeout=cfg.read_timeout,
        shutdown_grace=cfg.shutdown_grace,
    )


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def warn_if_exposed(cfg: ServerConfig) -> bool:
    """Warn when the server listens beyond this machine and requires no API key: anyone who can reach the
    port can use it, and read the shared prefix cache through its side channels. True when it warned."""
    if is_loopback(cfg.host) or cfg.api_keys:
        return False
    log.warning(
        "listening on %s, which is reachable from other machines, without --api-key: anyone who can reach "
        "the port can use this server",
        cfg.host,
    )
    return True


def warn_if_metrics_public(policy: TenancyPolicy) -> bool:
    """Warn when --public-metrics opens a /metrics that the default rule would have closed, saying what it
    reveals to anyone. True when it warned."""
    access = policy.metrics_access()
    if access.mode != "public" or access.reveals is None:
        return False
    log.warning("--public-metrics: anyone who can reach the server reads /metrics; it reveals %s", access.reveals)
    return True


def listen(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 takes a free one. Bound before uvicorn starts, so the address is known at
    once (and a bad one fails here, not in uvicorn's thread); connections wait in the backlog till it runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not create_server's 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
    # and without it every keep-alive response waited ~40 ms for the peer's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ambiguous_framing(request: h11.Request) -> str | None:
    """Why the body length of ``request`` is ambiguous (RFC 9112 section 6.1), or None when it is not.

    h11 refuses conflicting Content-Length values and any transfer coding but chunked (a 400, and the
    connection closes), but serves these two by the chunked coding alone and keeps the connection: a proxy in
    front that went by the Content-Length would see the rest as another request than this server does
    (request smuggling). The RFC has the server close the connection after such a request; it is refused."""
    names = {name for name, _ in request.headers}  # h11 gives them lower-cased
    if b"transfer-encoding" not in names:
        return None
    if b"content-length" in names:
        return "Content-Length and Transfer-Encoding together"
    if request.http_version < b"1.1":  # HTTP/1.0 has no transfer codings: the framing is faulty
        return "Transfer-Encoding in an HTTP/1.0 request"
    return None


class FramingCheckedConnection(h11.Connection):
    """h11's connection, refusing a request of ambiguous framing (``ambiguous_framing``) the way h11 refuses
    a malformed one: uvicorn answers 400 with Connection: close and closes, and no app code runs for it."""

    refusal: str | None = None  # why the last request was refused, for the 400's text

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        event = super().next_event()
        if isinstance(event, h11.Request):
            self.refusal = ambiguous_framing(event)
            if self.refusal is not None:
                raise h11.RemoteProtocolError(self.refusal)
        return event


class _LingeringTransport:
    """The transport uvicorn is given: its ``close`` is ``TimedH11Protocol.close_transport`` (which may
    linger), and it counts as closing from then on; all else is the socket's transport."""

    def __init__(self, transport: asyncio.Transport, protocol: TimedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_transport()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the client: ``read_timeout`` seconds to deliver a request's
    head, counted from when the connection opened or the previous response ended, and as long to finish a
    body the app answered without reading (an early 429: h11 discards the rest as it arrives).

    uvicorn waits for neither: its keep-alive timer is cancelled by the first byte of the next request, so a
    client that sends its headers a byte at a time, or nothing at all on a fresh connection, would hold the
    connection for ever. While the app reads a body, the app's own deadline applies (``_read_body``).

    Also: a request of ambiguous framing is a 400 (``FramingCheckedConnection``), and a connection closed
    while the client may still be sending closes gracefully (``close_transport``)."""

    read_timeout: float = READ_TIMEOUT_S
    conn: FramingCheckedConnection
    socket_transport: asyncio.Transport  # the real one; uvicorn holds a _LingeringTransport around it
    _deadline: asyncio.TimerHandle | None = None
    _linger: asyncio.TimerHandle | None = None
    _dropped = 0  # bytes read and dropped while lingering
    _stopping = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size
        limits = {} if size is None else {"max_incomplete_event_size": size}
        self.conn = FramingCheckedConnection(h11.SERVER, **limits)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.socket_transport = transport
        super().connection_made(cast(asyncio.Transport, _LingeringTransport(transport, self)))
        self._sync_deadline()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self._drop(len(data))
            return
        super().data_received(data)
        self._sync_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self._stopping = True  # the server waits for every connection to close: none lingers from now on
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a request h11 refused; it says why when the refusal is kvlab's.
        refusal = self.conn.refusal
        super().send_400_response(msg if refusal is None else f"Invalid HTTP request received: {refusal}.")

    @property
    def lingering(self) -> bool:
        return self._linger is not None

    def close_transport(self) -> None:
        """uvicorn's close: after a response that ends the connection, or a request h11 refused. While the
        client may still be sending (a body nobody read to its end, or whatever follows a malformed request)
        it is a lingering close: the answer and a FIN go out, and what still arrives is read and dropped, up
        to ``DRAIN_MAX_BYTES`` and for ``read_timeout`` seconds, until the client closes. Closed at once, the
        socket would answer those bytes with a reset, and a client still sending its body would see the
        reset instead of the answer (a 413 for a body declared too large, say)."""
        sock = self.socket_transport
        sending = self.conn.their_state in (h11.SEND_BODY, h11.ERROR)
        if self.lingering or self._stopping or sock.is_closing() or not sending or not sock.can_write_eof():
            sock.close()
            return
        sock.write_eof()  # after what is buffered: the client reads the whole answer, then the end
        sock.resume_reading()  # uvicorn stops reading a body the app leaves unread
        self._cancel_deadline()
        self._linger = self.loop.call_later(self.read_timeout, sock.close)

    def _drop(self, size: int) -> None:
        self._dropped += size
        if self._dropped > DRAIN_MAX_BYTES:
            self.socket_transport.close()

    def _waiting_on_client(self) -> bool:
        their = self.conn.their_state
        return their is h11.IDLE or (their is h11.SEND_BODY and self.conn.our_state is h11.DONE)

    def _sync_deadline(self) -> None:
        if self.transport.is_closing() or not self._waiting_on_client():
            self._cancel_deadline()
        elif self._deadline is None:  # armed once per wait: trickling bytes does not push it back
            self._deadline = self.loop.call_later(self.read_timeout, self._expire)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._waiting_on_client() and not self.transport.is_closing():
            self.logger.info("dropped a connection that sent no complete request within %gs", self.read_timeout)
            self.socket_transport.close()  # no lingering: the client had its time


def timed_protocol(read_timeout: float) -> type[TimedH11Protocol]:
    """The protocol class for uvicorn (it builds one per connection and takes no arguments for it)."""
    return type("KvlabH11Protocol", (TimedH11Protocol,), {"read_timeout": read_timeout})


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the app the moment it stops accepting: requests in flight then get the grace
    period, and each still running after it ends with an OpenAI-shaped error instead of a cut connection."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


def uvicorn_server(app: FastAPI, log_level: str = "info", access_log: bool = False) -> uvicorn.Server:
    """Run it with ``.run(sockets=[listen(...)])``. Timeouts and the grace period come from the app's
    ``HTTPLimits`` (``app.state.http_limits``)."""
    limits: HTTPLimits = getattr(app.state, "http_limits", None) or HTTPLimits()
    config = uvicorn.Config(
        app,
        # None: uvicorn's loggers go through the process's own logging setup instead of replacing it.
        log_config=None,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        http=timed_protocol(limits.read_timeout),
        timeout_graceful_shutdown=math.ceil(limits.shutdown_grace + SHUTDOWN_FLUSH_S),  # uvicorn takes an int
    )
    begin_shutdown: Callable[[float], None] | None = getattr(app.state, "begin_shutdown", None)
    return GracefulServer(config, lambda: begin_shutdown(limits.shutdown_grace) if begin_shutdown else None)


def serve_until_stopped(app: FastAPI, sock: socket.socket, access_log: bool = False) -> int:
    """Run in the foreground until SIGINT/SIGTERM, or until the engine loop dies: then the server stops at
    once and the exit status is 1, so a supervisor restarts it instead of it lingering half-alive."""
    server = uvicorn_server(app, access_log=access_log)
    loop: EngineLoop = app.state.engine_loop

    def on_death(exc: BaseException) -> None:
        log.error("the engine loop died (%s); stopping the server", type(exc).__name__)
        server.should_exit = True

    loop.on_death.append(on_death)
    server.run(sockets=[sock])
    return 0 if loop.alive or loop.stopped_cleanly else 1


class RunningServer:
    """A server on a background thread with its own event loop: for tests and embedding."""

    def __init__(self, cfg: ServerConfig, loaded: LoadedModel | None = None) -> None:
        self.cfg = cfg
        self.app = build_app(cfg, loaded)
        self.loop: EngineLoop = self.app.state.engine_loop
        self.engine = self.loop.engine
        self.port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return url(self.cfg.host, self.port or 0)

    def start(self, timeout: float = 30.0) -> RunningServer:
        sock = listen(self.cfg.host, self.cfg.port)
        self.port = sock.getsockname()[1]
        self._server = uvicorn_server(self.app, log_level="warning")
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="kvlab-http", daemon=True
        )
        self._thread.start()
        # uvicorn has no "started" event to wait on; its flag is set once the lifespan and listener are up.
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                sock.close()
                raise RuntimeError(f"the server did not start (waited up to {timeout}s); see the log")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float | None = None) -> None:
        if self._server is None or self._thread is None:
            return
        if timeout is None:  # the grace period, the time to write the errors after it, and a margin
            timeout = self.cfg.shutdown_grace + SHUTDOWN_FLUSH_S + 10.0
        # uvicorn's own shutdown: stop accepting, let in-flight requests finish within the grace period (then
        # the app ends each with an error), then the lifespan stops the engine loop.
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the HTTP thread did not stop within %ss", timeout)
        if self.loop.alive:
            self.loop.stop(timeout)

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
