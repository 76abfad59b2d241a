"""Build the engine a server runs and run the HTTP server on a background thread (`kvlab serve`, tests)."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvlab.config import CacheConfig, ConfigError, SchedulerConfig
from kvlab.engine.llm import Engine
from kvlab.model.loader import LoadedModel, load_model
from kvlab.server.app import OpenAIApp, error_body
from kvlab.server.engine_loop import EngineLoop
from kvlab.server.http import HTTPServer

log = logging.getLogger(__name__)


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
    sched_kw.setdefault(
        "max_model_len",
        min(
            loaded.config.max_position_embeddings,
            cache_kw.get("num_blocks", CacheConfig.num_blocks) * cache_kw.get("block_size", CacheConfig.block_size),
        ),
    )
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


class RunningServer:
    """A server on a background thread with its own event loop: for tests and embedding."""

    def __init__(self, cfg: ServerConfig, loaded: LoadedModel | None = None) -> None:
        self.cfg = cfg
        self.engine = build_engine(cfg, loaded)
        self.loop = EngineLoop(self.engine, max_pending=cfg.max_pending)
        name = cfg.served_model_name or self.engine.loaded.name
        self.app = OpenAIApp(self.loop, name)
        self.http = HTTPServer(self.app.handle, error_body)
        self.port: int | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> RunningServer:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            self._aio = asyncio.new_event_loop()
            asyncio.set_event_loop(self._aio)
            try:
                self.port = self._aio.run_until_complete(self.http.start(self.cfg.host, self.cfg.port))
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                return
            ready.set()
            try:
                self._aio.run_until_complete(self.http.serve_forever())
            except asyncio.CancelledError:
                pass
            finally:
                # Connections still open (streams, clients that never read) are cancelled, so each one
                # runs its cleanup and aborts its request before the loop goes away.
                pending = asyncio.all_tasks(self._aio)
                for task in pending:
                    task.cancel()
                self._aio.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self._aio.close()

        self.loop.start()
        self._thread = threading.Thread(target=run, name="kvlab-http", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the server did not start listening within {timeout}s")
        if errors:
            self.loop.stop()
            raise errors[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._aio is not None and self._thread is not None and self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self.http.close(), self._aio)
            try:
                fut.result(timeout)
            except Exception:
                log.exception("error while closing the HTTP server")
            self._thread.join(timeout)
        self.loop.stop(timeout)

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
