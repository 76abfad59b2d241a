"""Helpers of the fuzzer's tests: trial runners on the suite's mini model, one per (strategy, budget)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from kvlab.fuzz import CrashInjection, FuzzSettings, TrialRunner
from oracle_cache import mini


@functools.cache
def runner(strategy: str | None = None, shrink_budget: int = 40) -> TrialRunner:
    """A runner on the suite's mini model; cached, so its oracle memo is shared by the tests using it."""
    return TrialRunner(FuzzSettings(strategy=strategy, shrink_budget=shrink_budget), loaded=mini())


@dataclass(frozen=True)
class AlwaysCrash(CrashInjection):
    """A trial that kills every worker that runs it (module level: spawned workers unpickle it by name)."""

    def maybe_crash(self, index: int) -> None:
        if index in self.indices:
            os._exit(70)
