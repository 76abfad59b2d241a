"""A fuzz campaign: numbered trials, each drawn from (seed, index), run, judged and, when it fails, shrunk.

``TrialRunner`` is what every worker holds (the model loaded once, the oracle's memo); ``Reducer`` folds
results in index order, whatever order they arrive in, so a campaign's outcome is the same serially, on a
process pool or on Ray.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlab.config import KV_CACHE_DTYPES, ConfigError, check_choice, check_int
from kvlab.experiment.strategies import BUILTIN_STRATEGIES
from kvlab.fuzz.case import PRECISIONS, ROW_INVARIANT, FuzzCase
from kvlab.fuzz.generate import CaseMeta, Drawn, WorkloadBounds, draw_case
from kvlab.fuzz.oracle import Oracle
from kvlab.fuzz.trial import AloneRuns, Failure, Verdict, run_case
from kvlab.model.loader import LoadedModel


@dataclass(frozen=True)
class FuzzSettings:
    """Everything that decides a campaign's results (how it is spread over workers does not)."""

    model: str = "mini"
    model_seed: int = 0
    seed: int = 0
    strategy: str | None = None  # an experiment strategy (the unsafe ones give the fuzzer something to find)
    shrink: bool = True
    shrink_budget: int = 300  # engine runs one failing trial may spend on shrinking
    bounds: WorkloadBounds = field(default_factory=WorkloadBounds)
    # Unsafe: every trial speculates and rejected drafts stay findable (the sanitizer's "draft" reads find it).
    commit_rejected_drafts: bool = False
    kv_cache_dtype: str | None = None  # every trial's cache stores K/V so (None: drawn per trial, mostly "auto")
    precision: str | None = None  # every trial computes in it (case.PRECISIONS; None: drawn per trial, mostly fp32)

    def __post_init__(self) -> None:
        check_int("FuzzSettings", "model_seed", self.model_seed, 0)
        check_int("FuzzSettings", "seed", self.seed, 0)
        check_int("FuzzSettings", "shrink_budget", self.shrink_budget, 0)
        if self.strategy is not None and self.strategy not in BUILTIN_STRATEGIES:
            raise ConfigError(
                f"FuzzSettings.strategy must be one of {sorted(BUILTIN_STRATEGIES)} or None, got {self.strategy!r}"
            )
        if self.kv_cache_dtype is not None:
            check_choice("FuzzSettings", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.precision is not None:
            check_choice("FuzzSettings", "precision", self.precision, PRECISIONS)
        if not isinstance(self.bounds, WorkloadBounds):
            raise ConfigError(f"FuzzSettings.bounds must be a WorkloadBounds, got {type(self.bounds).__name__}")

    def meta(self) -> CaseMeta:
        inject_empty = self.strategy is not None and BUILTIN_STRATEGIES[self.strategy].inject_empty
        # The empty-request strategy's leak needs a zero-length prompt beside others: let the draw make one.
        bounds = replace(self.bounds, allow_empty=True) if inject_empty else self.bounds
        return CaseMeta(
            self.model,
            self.model_seed,
            self.strategy,
            bounds,
            self.commit_rejected_drafts,
            self.kv_cache_dtype,
            self.precision,
        )


@dataclass(frozen=True)
class TrialResult:
    """One trial's outcome; failing trials carry their case and its shrunk form. No timing: two runs of the
    same trial must compare equal."""

    index: int
    digest: str  # the drawn case's
    failures: tuple[Failure, ...] = ()
    case: FuzzCase | None = None
    shrunk: FuzzCase | None = None
    shrunk_failures: tuple[Failure, ...] = ()
    shrink_runs: int = 0
    coverage: frozenset[str] = frozenset()  # engine paths the trial exercised (trial.COVERAGE)

    @property
    def failed(self) -> bool:
        return bool(self.failures)


@dataclass(frozen=True)
class CrashInjection:
    """Test hook for the retry path: the first worker to reach one of these trial indices exits abruptly.
    ``marker_dir`` remembers across processes that it already happened, so the retry succeeds."""

    indices: tuple[int, ...]
    marker_dir: str

    def maybe_crash(self, index: int) -> None:
        if index not in self.indices:
            return
        marker = Path(self.marker_dir) / f"crashed-{index}"
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return
        os._exit(70)  # no cleanup, no exception: what an OOM kill or a segfault looks like to the parent


class TrialRunner:
    """Runs trials by index. Holds the model (loaded once per worker) and the oracles' memos: the dense oracle's, and
    the row-invariant precision's runs alone (made at its first trial: a bf16 copy of the model)."""

    def __init__(
        self, settings: FuzzSettings, loaded: LoadedModel | None = None, crash: CrashInjection | None = None
    ) -> None:
        from kvlab.model import load_model

        self.settings = settings
        self.meta = settings.meta()
        self.loaded = loaded or load_model(settings.model, seed=settings.model_seed)
        self.oracle = Oracle(self.loaded.model, alphabet=self.meta.bounds.alphabet)
        self.alone: AloneRuns | None = None
        self.crash = crash

    def run_case(self, case: FuzzCase) -> Verdict:
        if case.config.precision == ROW_INVARIANT and self.alone is None:
            self.alone = AloneRuns(self.loaded)
        return run_case(self.loaded, case, self.oracle, self.alone)

    def draw(self, index: int) -> Drawn:
        return draw_case(self.meta, self.settings.seed, index)

    def run(self, index: int) -> TrialResult:
        if self.crash is not None:
            self.crash.maybe_crash(index)
        drawn = self.draw(index)
        case = drawn.case
        verdict = self.run_case(case)
        if verdict.ok:
            return TrialResult(index, case.digest(), coverage=verdict.coverage)
        shrunk, shrunk_verdict, runs = case, verdict, 0
        if self.settings.shrink and self.settings.shrink_budget > 0:
            shrunk, runs = self._shrink(index, drawn, verdict)
            shrunk_verdict = self.run_case(shrunk)
        return TrialResult(
            index,
            case.digest(),
            verdict.failures,
            _noted(case, verdict, index),
            _noted(shrunk, shrunk_verdict, index),
            shrunk_verdict.failures,
            runs,
            verdict.coverage,
        )

    def run_chunk(self, indices: list[int]) -> list[TrialResult]:
        return [self.run(i) for i in indices]

    def _shrink(self, index: int, drawn: Drawn, verdict: Verdict) -> tuple[FuzzCase, int]:
        from kvlab.fuzz.shrink import shrink_case  # hypothesis is imported only when something failed

        kind = verdict.primary

        def still_fails(candidate: FuzzCase) -> bool:
            return kind in self.run_case(candidate).kinds

        res = shrink_case(drawn, self.meta, still_fails, self.settings.shrink_budget, f"{self.settings.seed}/{index}")
        return res.case, res.runs


def _noted(case: FuzzCase, verdict: Verdict, index: int) -> FuzzCase:
    note: dict[str, Any] = {"trial": index, "failures": [str(f) for f in verdict.failures]}
    if verdict.root_causes:
        note["root_causes"] = list(verdict.root_causes)
    return replace(case, note=note)


class Reducer:
    """Folds trial results in index order, however they arrive; stops the campaign after ``max_failures``
    failing trials (counted in index order, so the cut-off is the same on any executor)."""

    def __init__(self, total: int, max_failures: int | None = None) -> None:
        self.total = total
        self.max_failures = max_failures
        self._pending: dict[int, TrialResult] = {}
        self._next = 0
        self._hash = hashlib.sha256()
        self.failing: list[TrialResult] = []
        self.kinds: Counter[str] = Counter()
        self.coverage: Counter[str] = Counter()
        self.arrived = 0
        self.failures_seen = 0  # failures among all arrived results (for the progress bar)

    def add(self, results: list[TrialResult]) -> None:
        for r in results:
            if r.index >= self._next and r.index not in self._pending:
                self._pending[r.index] = r
                self.arrived += 1
                self.failures_seen += r.failed
        while self._next in self._pending and not self.done:
            self._fold(self._pending.pop(self._next))
            self._next += 1

    def _fold(self, r: TrialResult) -> None:
        kinds = sorted({f.kind for f in r.failures})
        self._hash.update(f"{r.index}:{r.digest}:{','.join(kinds)};".encode())
        self.coverage.update(r.coverage)
        if r.failed:
            self.failing.append(r)
            self.kinds.update(kinds)

    @property
    def reduced(self) -> int:
        """Trials folded so far: a contiguous prefix of the campaign."""
        return self._next

    @property
    def done(self) -> bool:
        stopped = self.max_failures is not None and len(self.failing) >= self.max_failures
        return stopped or self._next >= self.total

    def digest(self) -> str:
        """Identity of the reduced results: equal on every executor for the same settings."""
        return self._hash.hexdigest()[:16]
