"""Spreading a campaign's trials over executors: in-process, a local process pool, or Ray actors.

Trials go out in chunks of consecutive indices; each worker keeps one ``TrialRunner`` (the model loaded
once, by the pool's initializer or the actor's constructor). Results come back in any order and the
``Reducer`` folds them by index, so the outcome does not depend on the executor.

A worker that dies loses nothing: the trials it may have been running are queued again, one trial per
chunk and run where a death can be pinned on them, so that a trial which itself kills its worker is
singled out. A trial pinned with ``max_attempts`` deaths is reported as a ``crash`` failure; the summary
counts worker deaths and retried trials.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from kvlab.config import ConfigError, check_int
from kvlab.fuzz.campaign import CrashInjection, FuzzSettings, Reducer, TrialResult, TrialRunner
from kvlab.fuzz.generate import draw_case
from kvlab.fuzz.trial import COVERAGE, Failure

Progress = Callable[[Reducer], None]


class WorkersDying(RuntimeError):
    """Workers die before they finish any trial: they cannot start, and respawning them will not help."""


class WorkerInitError(RuntimeError):
    """Raised by a worker whose setup (loading the model) failed, on every chunk it is given: an ordinary
    exception travels back to the coordinator, where a worker that just exits would look like a crash."""


def start_runner(settings: FuzzSettings, crash: CrashInjection | None) -> TrialRunner | WorkerInitError:
    """A worker's runner, or the reason it could not be built (one torch thread: one worker per core)."""
    import torch

    torch.set_num_threads(1)
    try:
        return TrialRunner(settings, crash=crash)
    except Exception as exc:
        return WorkerInitError(f"a worker could not start: {type(exc).__name__}: {exc}")


def run_on(runner: TrialRunner | WorkerInitError | None, indices: list[int]) -> list[TrialResult]:
    if not isinstance(runner, TrialRunner):
        raise runner or WorkerInitError("the worker was not initialised")
    return runner.run_chunk(indices)


@dataclass(frozen=True)
class ScaleOptions:
    """How a campaign is spread out (never what it finds)."""

    workers: int | None = None  # processes (or Ray actors); None: in this process (with Ray: one per CPU)
    ray: str | None = None  # "auto" (a running cluster), "local" (start one here) or a cluster address
    chunk_size: int = 8
    max_attempts: int = 3  # workers one trial may kill before it is reported as a crash
    crash: CrashInjection | None = None  # test hook: make workers die (see CrashInjection)

    def __post_init__(self) -> None:
        if self.workers is not None:
            check_int("ScaleOptions", "workers", self.workers, 1)
        check_int("ScaleOptions", "chunk_size", self.chunk_size, 1)
        check_int("ScaleOptions", "max_attempts", self.max_attempts, 1)
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray):
            raise ConfigError(f"ScaleOptions.ray must be 'auto', 'local' or an address, got {self.ray!r}")

    @property
    def executor(self) -> str:
        return "ray" if self.ray is not None else "pool" if self.workers is not None else "serial"


@dataclass
class CampaignSummary:
    settings: FuzzSettings
    trials_requested: int
    trials: int  # folded in index order (fewer than requested when max_failures stopped the campaign)
    failing: list[TrialResult]
    kinds: dict[str, int]
    digest: str
    executor: str
    workers: int
    wall_s: float
    first_result_s: float = 0.0  # wall time until the first chunk came back (start-up included)
    coverage: dict[str, int] = field(default_factory=dict)  # trials that exercised each engine path
    worker_deaths: int = 0
    retried_trials: int = 0

    @property
    def failures(self) -> int:
        return len(self.failing)

    @property
    def trials_per_s(self) -> float:
        return self.trials / self.wall_s if self.wall_s > 0 else 0.0

    def outcome(self) -> tuple[int, str, list[TrialResult]]:
        """What must be equal across executors for the same settings."""
        return self.trials, self.digest, self.failing

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.settings.model,
            "seed": self.settings.seed,
            "strategy": self.settings.strategy,
            "trials_requested": self.trials_requested,
            "trials": self.trials,
            "failures": self.failures,
            "failure_kinds": self.kinds,
            "digest": self.digest,
            "executor": self.executor,
            "workers": self.workers,
            "wall_s": round(self.wall_s, 3),
            "first_result_s": round(self.first_result_s, 3),
            "trials_per_s": round(self.trials_per_s, 2),
            "worker_deaths": self.worker_deaths,
            "retried_trials": self.retried_trials,
            "coverage": {k: round(n / self.trials, 4) for k, n in self.coverage.items()} if self.trials else {},
            "failing": [_failing_to_dict(r) for r in self.failing],
        }


def _failing_to_dict(r: TrialResult) -> dict[str, Any]:
    return {
        "trial": r.index,
        "failures": [str(f) for f in r.failures],
        "case": r.case.to_dict() if r.case else None,
        "shrunk": r.shrunk.to_dict() if r.shrunk else None,
        "shrunk_failures": [str(f) for f in r.shrunk_failures],
        "shrink_runs": r.shrink_runs,
    }


class _Dispatch:
    """Chunk bookkeeping shared by every executor: the queue, retries after a worker died, progress.

    When a worker dies, the trials it may have been running become *suspects*: each is retried on its own
    (``isolate``: with nothing else in flight on a pool, whose one death breaks every worker), so that a
    death can be pinned on one trial. Only such pinned deaths count against a trial; a trial pinned with
    ``max_attempts`` of them is reported as a crash, never retried forever and never silently dropped.
    """

    def __init__(self, settings: FuzzSettings, reducer: Reducer, opts: ScaleOptions, progress: Progress | None):
        self.settings = settings
        self.reducer = reducer
        self.opts = opts
        self.progress = progress
        self.queue: deque[list[int]] = deque(_chunks(reducer.total, opts.chunk_size))
        self.suspects: deque[int] = deque()
        self.kills: dict[int, int] = {}  # trial -> deaths pinned on it
        self.deaths = 0
        self.retried = 0
        self._deaths_in_a_row = 0  # without a single chunk coming back in between
        self.started = time.perf_counter()
        self.first_result_s: float | None = None  # start-up: workers spawned, model loaded, first chunk run

    def next_chunk(self) -> list[int] | None:
        if self.reducer.done:
            return None
        if self.suspects:
            return [self.suspects.popleft()]
        return self.queue.popleft() if self.queue else None

    def requeue(self, chunk: list[int]) -> None:
        """A chunk that never reached a worker: back to the front, unchanged."""
        if len(chunk) == 1 and chunk[0] in self.kills:
            self.suspects.appendleft(chunk[0])
        else:
            self.queue.appendleft(chunk)

    def died(self, workers: int) -> None:
        """A worker died. If they keep dying without returning anything, they cannot start (a model that
        does not load, a node without kvlab): stop rather than respawn them forever."""
        self.deaths += 1
        self._deaths_in_a_row += 1
        if self._deaths_in_a_row > self.opts.max_attempts * workers:
            raise WorkersDying(
                f"{self._deaths_in_a_row} workers died in a row without finishing a trial; "
                "check that each can import kvlab and load the model"
            )

    def completed(self, results: list[TrialResult]) -> None:
        """A worker returned a chunk."""
        if self.first_result_s is None:
            self.first_result_s = time.perf_counter() - self.started
        self._deaths_in_a_row = 0
        self._record(results)

    def _record(self, results: list[TrialResult]) -> None:
        self.reducer.add(results)
        if self.progress is not None:
            self.progress(self.reducer)

    def lost(self, chunk: list[int], alone: bool) -> None:
        """A worker died holding ``chunk``; ``alone``: nothing else could have killed it."""
        if alone and len(chunk) == 1:
            index = chunk[0]
            self.kills[index] = self.kills.get(index, 0) + 1
            if self.kills[index] >= self.opts.max_attempts:
                self._record([_killed_worker(self.settings, index, self.kills[index])])
                return
        self.retried += len(chunk)
        for index in reversed(chunk):
            self.kills.setdefault(index, 0)
            self.suspects.appendleft(index)

    @property
    def isolating(self) -> bool:
        return bool(self.suspects)


def _chunks(total: int, size: int) -> Iterator[list[int]]:
    for start in range(0, total, size):
        yield list(range(start, min(start + size, total)))


def _killed_worker(settings: FuzzSettings, index: int, attempts: int) -> TrialResult:
    case = draw_case(settings.meta(), settings.seed, index).case
    failure = Failure("crash", f"trial {index} killed its worker {attempts} times (no Python exception)")
    return TrialResult(index, case.digest(), (failure,), case, case, (failure,), 0)


def run_campaign(
    settings: FuzzSettings,
    trials: int,
    opts: ScaleOptions | None = None,
    max_failures: int | None = None,
    progress: Progress | None = None,
    runner: TrialRunner | None = None,
) -> CampaignSummary:
    """Run trials 0..trials-1 of ``settings`` and reduce them in index order. ``runner``: reuse a loaded
    model for the serial executor (tests, replays)."""
    check_int("run_campaign", "trials", trials, 1)
    opts = opts or ScaleOptions()
    reducer = Reducer(trials, max_failures)
    dispatch = _Dispatch(settings, reducer, opts, progress)
    t0 = time.perf_counter()
    if opts.executor == "serial":
        workers = 1
        _run_serial(runner or TrialRunner(settings), dispatch)
    elif opts.workers is not None and opts.executor == "pool":
        workers = opts.workers
        _run_pool(dispatch, workers)
    else:
        from kvlab.fuzz.ray_exec import run_ray

        workers = run_ray(dispatch, opts)
    return CampaignSummary(
        settings=settings,
        trials_requested=trials,
        trials=reducer.reduced,
        failing=list(reducer.failing),
        kinds=dict(sorted(reducer.kinds.items())),
        digest=reducer.digest(),
        executor=opts.executor,
        workers=workers,
        wall_s=time.perf_counter() - t0,
        first_result_s=dispatch.first_result_s or 0.0,
        coverage={k: reducer.coverage[k] for k in COVERAGE},
        worker_deaths=dispatch.deaths,
        retried_trials=dispatch.retried,
    )


def _run_serial(runner: TrialRunner, dispatch: _Dispatch) -> None:
    while (chunk := dispatch.next_chunk()) is not None:
        dispatch.completed(runner.run_chunk(chunk))


# ------------------------------------------------------------------------------------------- process pool
_WORKER: TrialRunner | WorkerInitError | None = None


def _init_worker(settings: FuzzSettings, crash: CrashInjection | None) -> None:
    """Pool initializer: load the model once per worker process."""
    global _WORKER
    _WORKER = start_runner(settings, crash)


def _worker_chunk(indices: list[int]) -> list[TrialResult]:
    return run_on(_WORKER, indices)


def _run_pool(dispatch: _Dispatch, workers: int) -> None:
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


def _pool_round(pool: ProcessPoolExecutor, dispatch: _Dispatch, workers: int) -> bool:
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


def _pool_broken(inflight: dict[Future[list[TrialResult]], list[int]], dispatch: _Dispatch) -> bool:
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
