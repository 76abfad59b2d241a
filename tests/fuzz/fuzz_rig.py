"""Helpers of the fuzzer's tests: trial runners on the suite's mini models, one per (strategy, budget, model)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest
import torch

from kvlab.attention.flash import flash_prefill_kernel
from kvlab.fuzz import CrashInjection, FuzzSettings, TrialRunner
from kvlab.model.int8_linear import vnni_kernel_ready
from oracle_cache import mini

# Whether this CPU runs the row-invariant precision's kernels (the int8 VNNI product and the bf16 flash loop); where it
# does not, the mode falls back to other kernels, which make no row-invariance claim.
ROW_INVARIANT_KERNELS = vnni_kernel_ready() and flash_prefill_kernel(torch.bfloat16) is not None
needs_row_invariant_kernels = pytest.mark.skipif(
    not ROW_INVARIANT_KERNELS, reason="the row-invariant precision's kernels need AVX512-VNNI and AVX512-BF16"
)


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
