"""What every executor of a campaign shares: how it is spread out, the chunk queue, worker set-up, deaths.

Trials go out in chunks of consecutive indices; each worker keeps one ``TrialRunner`` (the model loaded
once, by the pool's initializer or the actor's constructor). Results come back in any order and the
``Reducer`` folds them by index, so the outcome does not depend on the executor.

A worker that dies loses nothing: the trials it may have been running are queued again, one trial per
chunk and run where a death can be pinned on them, so that a trial which itself kills its worker is
singled out. A trial pinned with ``max_attempts`` deaths is reported as a ``crash`` failure; the summary
counts worker deaths and retried trials.

The executors (``pool_exec``, ``ray_exec``) import this module and never each other or ``scale``, which
only chooses one of them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvlab.config import ConfigError, check_int
from kvlab.fuzz.campaign import CrashInjection, FuzzSettings, Reducer, TrialResult, TrialRunner
from kvlab.fuzz.generate import draw_case
from kvlab.fuzz.trial import Failure

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


class Dispatch:
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


def run_serial(runner: TrialRunner, dispatch: Dispatch) -> None:
    """The in-process executor: one runner, chunk after chunk."""
    while (chunk := dispatch.next_chunk()) is not None:
        dispatch.completed(runner.run_chunk(chunk))
