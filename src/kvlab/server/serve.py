"""Build the engine and app a server runs, and run them under uvicorn: on a background thread
(``RunningServer``: tests, embedding) or in the foreground (``kvlab serve``)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI

from kvlab.config import CacheConfig, ConfigError, SchedulerConfig
from kvlab.engine.engine import Engine, default_max_model_len
from kvlab.model.loader import LoadedModel, load_model
from kvlab.server.app import create_app
from kvlab.server.engine_loop import EngineLoop

log = logging.getLogger(__name__)

# Seconds in-flight requests get to finish when the server stops; then they are cancelled, which aborts them.
GRACEFUL_SHUTDOWN_S = 2


@dataclass
class ServerConfig:
    model: str = "mini"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_pending: int = 256
    unsafe_strategy: str | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


def build_engine(cfg: ServerConfig, loaded: LoadedModel | None = None) -> Engine:
    """The engine the server runs; the same defaults as ``LLM(model)`` so offline and served outputs agree."""
    loaded = loaded or load_model(cfg.model, seed=cfg.seed)
    cache_kw = dict(cfg.cache)
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
    return Engine(loaded, cache, sched)


def build_app(cfg: ServerConfig, loaded: LoadedModel | None = None) -> FastAPI:
    engine = build_engine(cfg, loaded)
    return create_app(EngineLoop(engine, max_pending=cfg.max_pending), cfg.served_model_name or engine.loaded.name)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 takes a free one. Bound before uvicorn starts, so the address is known at
    once (and a bad one fails here, not in uvicorn's thread); connections wait in the backlog till it runs."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=2048)


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_server(app: FastAPI, log_level: str = "info", access_log: bool = False) -> uvicorn.Server:
    """Run it with ``.run(sockets=[listen(...)])``."""
    config = uvicorn.Config(
        app,
        # None: uvicorn's loggers go through the process's own logging setup instead of replacing it.
        log_config=None,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return uvicorn.Server(config)


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

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is None or self._thread is None:
            return
        # uvicorn's own shutdown: stop accepting, let in-flight requests finish (or cancel them), then the
        # lifespan stops the engine loop.
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
