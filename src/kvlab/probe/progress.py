"""How far a probe has got, for a front end to show (the probe itself never prints).

A probe runs in phases, in this order (a phase that does not apply to a run is skipped): ``capabilities``,
``granularity``, ``salts``, ``references``, ``determinism``, ``bursts``, ``reuse``, ``timing`` and ``metrics``
for the passphrase probe (``probe.run_probe``); ``metrics`` (finding the hit counter) and ``extraction`` for the
prompt-extraction attack (``extract.run_extract``). The caller's callback gets a ``PhaseProgress`` when a phase
starts (``done`` 0), after every unit of a phase that has a count (a request, a burst, a trial, a step), and
when it ends (``finished``); a phase that raises never ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

PHASES = (
    "capabilities",
    "granularity",
    "salts",
    "references",
    "determinism",
    "bursts",
    "reuse",
    "timing",
    "extraction",
    "metrics",
)
# What one unit of each counted phase is, for a display to say.
UNITS = {
    "granularity": "lengths",  # prefix lengths measured
    "references": "requests",
    "determinism": "prompts",
    "bursts": "bursts",
    "reuse": "steps",  # a trial, or a group's twin measured
    "timing": "trials",
    "extraction": "steps",
}


@dataclass(frozen=True)
class PhaseProgress:
    phase: str  # one of PHASES
    done: int  # units of the phase done so far
    total: int | None  # units the phase will do; None: it has no count known in advance
    finished: bool = False


ProgressCallback = Callable[[PhaseProgress], None]
Tick = Callable[[], None]  # one unit of the current phase is done


def no_tick() -> None:
    """The tick of a phase nobody watches."""


class Phases:
    """Reports a run's phases to ``callback`` (None: to nobody)."""

    def __init__(self, callback: ProgressCallback | None = None) -> None:
        self.callback = callback
        self.seconds: dict[str, float] = {}  # each phase run so far: how long it took (the JUnit test cases' time)

    def _emit(self, event: PhaseProgress) -> None:
        if self.callback is not None:
            self.callback(event)

    @contextmanager
    def phase(self, name: str, total: int | None = None) -> Iterator[Tick]:
        """``with phases.phase("bursts", total=n) as tick:`` ... ``tick()`` after each unit."""
        if name not in PHASES:
            raise ValueError(f"unknown probe phase {name!r}; phases: {', '.join(PHASES)}")
        done, t0 = 0, time.perf_counter()
        self._emit(PhaseProgress(name, 0, total))

        def tick() -> None:
            nonlocal done
            done += 1
            self._emit(PhaseProgress(name, done, total))

        try:
            yield tick
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        self._emit(PhaseProgress(name, done, total, finished=True))
