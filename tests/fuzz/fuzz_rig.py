"""Helpers of the fuzzer's tests: trial runners on the suite's mini models, one per (strategy, budget, model)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from kvlab.fuzz import CrashInjection, FuzzSettings, TrialRunner
from oracle_cache import mini


@functools.cache
def runner(strategy: str | None = None, shrink_budget: int = 40, model: str = "mini") -> TrialRunner:
    """A runner on one of the mini models (the suite's own mini, or mini-gqa / mini-mqa, seed 0); cached, so its
    oracle memo is shared by the tests using it."""
    settings = FuzzSettings(model=model, strategy=strategy, shrink_budget=shrink_budget)
    return TrialRunner(settings, loaded=mini() if model == "mini" else None)


@dataclass(frozen=True)
class AlwaysCrash(CrashInjection):
    """A trial that kills every worker that runs it (module level: spawned workers unpickle it by name)."""

    def maybe_crash(self, index: int) -> None:
        if index in self.indices:
            os._exit(70)
