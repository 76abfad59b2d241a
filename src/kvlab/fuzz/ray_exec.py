"""The Ray executor: one actor per CPU of the cluster, each holding a ``TrialRunner`` (model loaded once).

Ray is an optional extra (``pip install 'kvlab[ray]'``); this module is imported only for ``--ray``. An
actor that dies (its node lost, the process killed) is replaced and its chunk queued again elsewhere.
"""

from __future__ import annotations

import socket
from typing import Any

from kvlab.fuzz.campaign import CrashInjection, FuzzSettings, TrialResult
from kvlab.fuzz.dispatch import Dispatch, ScaleOptions, WorkerInitError, WorkersDying, run_on, start_runner


class RayUnavailable(RuntimeError):
    """``--ray`` was asked for but Ray is not installed or no cluster answers."""


class TrialActor:
    """Wrapped with ``ray.remote`` at run time (so importing kvlab never needs Ray)."""

    def __init__(self, settings: FuzzSettings, crash: CrashInjection | None) -> None:
        self.runner = start_runner(settings, crash)

    def run_chunk(self, indices: list[int]) -> list[TrialResult]:
        return run_on(self.runner, indices)


def connect(address: str, workers: int | None) -> tuple[Any, bool]:
    """The ``ray`` module, connected; True when this call started the Ray instance (and must stop it)."""
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable("Ray is not installed: pip install 'kvlab[ray]'") from exc
    if ray.is_initialized():
        return ray, False
    if address not in ("local", "auto"):
        check_reachable(address)
    try:
        if address == "local":
            # A private single-machine instance: as many CPUs as workers asked for (or every core).
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise RayUnavailable(f"cannot connect to Ray at {address!r}: {exc}") from exc
    return ray, True


# Seconds to reach a named cluster: Ray itself retries an address nobody answers for minutes, printing warnings.
CONNECT_TIMEOUT_S = 5.0


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """RayUnavailable, naming the address, unless something accepts a TCP connection at HOST:PORT (or
    ray://HOST:PORT) within ``timeout`` seconds."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    hint = "start one with 'ray start --head --port=6379' and pass HOST:6379, or use --ray local (or auto)"
    if not host or not port.isdigit():
        raise RayUnavailable(f"--ray {address!r} is not HOST:PORT (or local, auto); {hint}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise RayUnavailable(f"no Ray cluster answers at {address!r} within {timeout:g} s ({exc}); {hint}") from exc


def run_ray(dispatch: Dispatch, opts: ScaleOptions) -> int:
    """Run the dispatch's chunks on Ray actors; returns how many actors ran them."""
    assert opts.ray is not None
    ray, started = connect(opts.ray, opts.workers)
    try:
        n = opts.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        actor_cls = ray.remote(num_cpus=1, max_restarts=0)(TrialActor)
        _drive(ray, actor_cls, dispatch, n)
        return n
    finally:
        if started:
            ray.shutdown()


def _drive(ray: Any, actor_cls: Any, dispatch: Dispatch, n: int) -> None:
    from ray.exceptions import RayActorError, RayTaskError

    def spawn() -> Any:
        return actor_cls.remote(dispatch.settings, dispatch.opts.crash)

    idle = [spawn() for _ in range(n)]
    inflight: dict[Any, tuple[Any, list[int]]] = {}
    try:
        while True:
            while idle and (chunk := dispatch.next_chunk()) is not None:
                actor = idle.pop()
                inflight[actor.run_chunk.remote(chunk)] = (actor, chunk)
            if not inflight:
                return
            ready, _ = ray.wait(list(inflight), num_returns=1)
            for ref in ready:
                actor, chunk = inflight.pop(ref)
                try:
                    results = ray.get(ref)
                except RayActorError:
                    dispatch.died(n)
                    dispatch.lost(chunk, alone=True)  # an actor runs one chunk at a time: it was this one
                    idle.append(spawn())  # the replacement may land on another node
                    continue
                except RayTaskError as exc:
                    if isinstance(exc.cause, WorkerInitError):
                        raise WorkersDying(str(exc.cause)) from exc
                    raise
                dispatch.completed(results)
                idle.append(actor)
    finally:
        for actor in idle + [a for a, _ in inflight.values()]:
            ray.kill(actor)
