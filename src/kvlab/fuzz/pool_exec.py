"""The process-pool executor: ``workers`` spawned processes, each loading the model once (its initializer).

A dead worker breaks the whole pool: the chunks it did not return are handed back to the ``Dispatch``,
and a fresh pool takes them on.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from kvlab.fuzz.campaign import CrashInjection, FuzzSettings, TrialResult, TrialRunner
from kvlab.fuzz.dispatch import Dispatch, WorkerInitError, WorkersDying, run_on, start_runner

_WORKER: TrialRunner | WorkerInitError | None = None


def _init_worker(settings: FuzzSettings, crash: CrashInjection | None) -> None:
    """Pool initializer: load the model once per worker process."""
    global _WORKER
    _WORKER = start_runner(settings, crash)


def _worker_chunk(indices: list[int]) -> list[TrialResult]:
    return run_on(_WORKER, indices)


def run_pool(dispatch: Dispatch, workers: int) -> None:
    # spawn, not fork: a forked child of a process that already ran torch can hang in OpenMP.
    ctx = multiprocessing.get_context("spawn")
    while True:
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_init_worker, initargs=(dispatch.settings, dispatch.opts.crash)
        ) as pool:
            broken = _pool_round(pool, dispatch, workers)
            if not broken:
                return
            dispatch.died(workers)  # a dead worker breaks the whole pool: start a fresh one with the lost chunks


def _pool_round(pool: ProcessPoolExecutor, dispatch: Dispatch, workers: int) -> bool:
    """Feed the pool until the queue is empty (False) or a worker died (True: lost chunks are requeued)."""
    inflight: dict[Future[list[TrialResult]], list[int]] = {}
    while True:
        # A suspect runs alone: a dead worker breaks the whole pool, and the death must be pinned on it.
        limit = 1 if dispatch.isolating or any(c[0] in dispatch.kills for c in inflight.values()) else 2 * workers
        while len(inflight) < limit and (chunk := dispatch.next_chunk()) is not None:
            try:
                inflight[pool.submit(_worker_chunk, chunk)] = chunk
            except BrokenProcessPool:
                dispatch.requeue(chunk)
                break
            limit = 1 if len(chunk) == 1 and chunk[0] in dispatch.kills else limit
        if not inflight:
            return False
        wait(inflight, return_when=FIRST_COMPLETED)
        if _pool_broken(inflight, dispatch):
            return True
        if dispatch.reducer.done:
            pool.shutdown(wait=True, cancel_futures=True)
            return False


def _pool_broken(inflight: dict[Future[list[TrialResult]], list[int]], dispatch: Dispatch) -> bool:
    """Collect the finished futures. True when the pool broke: then every future is settled, and the
    chunks that did not come back are lost (pinned on their trial only if it was alone in the pool)."""
    done = [f for f in inflight if f.done()]
    broken = any(isinstance(f.exception(), BrokenProcessPool) for f in done)
    if broken:
        done = list(inflight)  # a broken pool settles every future
    alone = len(inflight) == 1
    for fut in done:
        chunk = inflight.pop(fut)
        exc = fut.exception()
        if isinstance(exc, BrokenProcessPool):
            dispatch.lost(chunk, alone)
        elif isinstance(exc, WorkerInitError):
            raise WorkersDying(str(exc)) from exc
        else:
            dispatch.completed(fut.result())  # any other exception is a bug of the fuzzer: let it raise
    return broken
