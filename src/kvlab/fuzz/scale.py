"""Spreading a campaign's trials over executors: in-process, a local process pool, or Ray actors.

This module only chooses the executor and summarises the campaign. What the executors share (the chunk
queue, worker set-up, retries after a worker died) is ``dispatch``; the executors are
``dispatch.run_serial``, ``pool_exec`` and ``ray_exec`` (imported only when ``--ray`` asks for it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvlab.config import check_int
from kvlab.fuzz.campaign import FuzzSettings, Reducer, TrialResult, TrialRunner
from kvlab.fuzz.dispatch import Dispatch, Progress, ScaleOptions, run_serial
from kvlab.fuzz.pool_exec import run_pool
from kvlab.fuzz.trial import COVERAGE


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
            "kv_cache_dtype": self.settings.kv_cache_dtype,
            "precision": self.settings.precision,
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
    dispatch = Dispatch(settings, reducer, opts, progress)
    t0 = time.perf_counter()
    if opts.executor == "serial":
        workers = 1
        run_serial(runner or TrialRunner(settings), dispatch)
    elif opts.workers is not None and opts.executor == "pool":
        workers = opts.workers
        run_pool(dispatch, workers)
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
