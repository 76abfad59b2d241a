"""The probe's time budget (``--max-seconds``): what a slow server costs is measured, not assumed.

The probe's phases that repeat a unit of measurement — lengths of the granularity search, prompts of the
determinism check, rounds of bursts, reuse trials, timing pairs — share the seconds the budget has left when
each starts, in the proportions of ``SHARES`` (a phase that finishes early leaves its time to the next ones).
Each phase measures its own pace as it goes and stops adding units when the next would end past its
allowance; the first unit always runs, so every phase measures something. The fixed phases (capabilities,
salts, references, /metrics) are not cut: a few requests each, they run whatever the budget says.

What a cut costs is said where the verdict is made: a search stopped short of the context is never clean, a
timing run with fewer pairs states the smallest AUC it can still show, a check on fewer prompts or rounds
says how many. ``Budget(None)`` never cuts (``--max-seconds 0``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# Shares of the cuttable phases. The timing gets the most: it decides the side channels a server without
# cached_tokens has, and its pairs are the least compressible (every test needs enough of them to reach alpha).
SHARES: Mapping[str, float] = {"granularity": 0.15, "determinism": 0.15, "bursts": 0.1, "reuse": 0.2, "timing": 0.4}
DEFAULT_MAX_SECONDS = 300.0


@dataclass
class Allowance:
    """One phase's share of the budget: it ends at ``end`` on ``clock`` (infinity: unbounded)."""

    phase: str
    end: float
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.started = self.clock()

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.end)

    def left(self) -> float:
        """Seconds until the end of the allowance (may be negative: overrun)."""
        return self.end - self.clock()

    def fits(self, seconds: float) -> bool:
        """Whether work of ``seconds`` more ends within the allowance."""
        return self.clock() + seconds <= self.end

    def from_now(self) -> Allowance:
        """The same end, its pace measured from now (a second kind of unit within the phase)."""
        return Allowance(self.phase, self.end, self.clock)

    def affords(self, done: int, more: int = 1) -> bool:
        """Whether ``more`` units fit at the pace of the ``done`` measured so far; the first always does."""
        if done <= 0 or not self.bounded:
            return True
        pace = (self.clock() - self.started) / done
        return self.fits(pace * more)


def unbounded(phase: str) -> Allowance:
    """An allowance that never cuts (a phase run outside a budget, as the unit tests do)."""
    return Allowance(phase, math.inf)


@dataclass
class Budget:
    """``seconds`` for the whole run (None: no bound) from the moment it is made, shared by ``SHARES``."""

    seconds: float | None
    clock: Callable[[], float] = time.monotonic
    shares: Mapping[str, float] = field(default_factory=lambda: dict(SHARES))
    started: float = field(default=0.0)
    cuts: dict[str, str] = field(default_factory=dict)  # phase -> what was left out, and what it costs
    _pending: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"the time budget must be > 0 seconds (or None: no bound), got {self.seconds}")
        self.started = self.clock()
        self._pending = list(self.shares)

    def skip(self, phase: str) -> None:
        """``phase`` will not run: its share goes to the phases still to come (else it would be left unused)."""
        if phase in self._pending:
            self._pending.remove(phase)

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - (self.clock() - self.started)

    def allowance(self, phase: str) -> Allowance:
        """``phase``'s share of what is left, among the phases not yet started (``phase`` among them)."""
        if phase not in self.shares:
            raise ValueError(f"no share of the time budget for phase {phase!r}; phases: {', '.join(self.shares)}")
        pending = self._pending if phase in self._pending else [*self._pending, phase]
        share = self.shares[phase] / sum(self.shares[p] for p in pending)
        self.skip(phase)  # taken now: what it leaves unused goes to the phases after it
        return Allowance(phase, self.clock() + max(self.left(), 0.0) * share, self.clock)

    def cut(self, phase: str, what: str) -> None:
        """Record what ``phase`` left out for the budget (the reports say it)."""
        self.cuts[phase] = what
