"""Shrinking a failing case with hypothesis.

The trial's recorded choices go into an in-memory example database; ``hypothesis.find`` with only the
reuse and shrink phases replays them (the same builder, now fed by hypothesis) and then shrinks the
choice sequence while the case still fails the same way. Hypothesis's shrinker deletes and simplifies
choices (drops requests by flipping their ``keep`` flag, shortens prompts, lowers numbers towards the
front of each option list), which is what makes a minimal case.

Shrinking is bounded by a number of engine runs, not by time, and hypothesis is seeded from the trial:
the same failing trial shrinks to the same case on any worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase, choices_to_bytes
from hypothesis.errors import NoSuchExample, Unsatisfiable

from kvlab.fuzz.case import FuzzCase
from kvlab.fuzz.generate import CaseMeta, Choice, Chooser, Drawn, ReplayChooser, build_case

T = TypeVar("T")
_KEY = b"kvlab-fuzz-shrink"
# Hypothesis treats entries under the primary key as already shrunk and only replays them; entries under
# the secondary key (where it keeps non-minimal failures) are replayed and then shrunk.
_SECONDARY = _KEY + b".secondary"


class HypothesisChooser:
    """The builder's choices drawn by hypothesis: one bounded integer or boolean choice each, the same
    values ``RandomChooser`` records."""

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        self._draw = draw

    def integer(self, lo: int, hi: int, weights: Sequence[float] | None = None) -> int:
        return int(self._draw(st.integers(lo, hi)))

    def boolean(self, p: float) -> bool:
        return bool(self._draw(st.booleans()))

    def span(self, build: Callable[[Chooser], T]) -> T:
        value: T = self._draw(_span(build))
        return value


@st.composite
def _span(draw: Callable[[st.SearchStrategy[Any]], Any], build: Callable[[Chooser], Any]) -> Any:
    return build(HypothesisChooser(draw))


@st.composite
def _cases(draw: Callable[[st.SearchStrategy[Any]], Any], meta: CaseMeta) -> FuzzCase:
    return build_case(HypothesisChooser(draw), meta)


@dataclass(frozen=True)
class ShrinkResult:
    case: FuzzCase  # the smallest failing case found (the original if nothing smaller fails)
    runs: int  # engine runs spent


class _Budget:
    """``still_fails`` memoised by case and capped at ``budget`` engine runs (then: "does not fail")."""

    def __init__(self, original: FuzzCase, still_fails: Callable[[FuzzCase], bool], budget: int) -> None:
        self.still_fails = still_fails
        self.budget = budget
        self.runs = 0
        self.seen: dict[str, bool] = {original.digest(): True}

    def __call__(self, case: FuzzCase) -> bool:
        key = case.digest()
        if key not in self.seen:
            if self.runs >= self.budget:
                return False  # out of budget: hypothesis keeps the smallest failure it has
            self.runs += 1
            self.seen[key] = self.still_fails(case)
        return self.seen[key]


def drop_requests(drawn: Drawn, meta: CaseMeta, fails: Callable[[FuzzCase], bool]) -> tuple[FuzzCase, list[Choice]]:
    """First pass, before hypothesis: drop each request in turn while the case still fails.

    Hypothesis would get there too, but only after trying to simplify every knob and span in front of the
    requests, at one engine run each; this costs at most one run per request and usually halves the case.
    """
    case, choices = drawn.case, list(drawn.choices)
    for at in drawn.keep_at:
        if not choices[at]:
            continue
        trial = [*choices[:at], False, *choices[at + 1 :]]
        candidate = build_case(ReplayChooser(trial), meta)
        if candidate != case and fails(candidate):
            case, choices = candidate, trial
    return case, choices


def shrink_case(
    drawn: Drawn,
    meta: CaseMeta,
    still_fails: Callable[[FuzzCase], bool],
    budget: int,
    seed: str,
) -> ShrinkResult:
    """The smallest case ``still_fails`` accepts, reached from the trial's choices within ``budget`` runs."""
    condition = _Budget(drawn.case, still_fails, budget)
    start, choices = drop_requests(drawn, meta, condition)
    db = InMemoryExampleDatabase()
    db.save(_SECONDARY, choices_to_bytes(choices))
    conf = settings(
        database=db,
        phases=[Phase.reuse, Phase.shrink],  # no fresh generation: start from this trial, only shrink
        deadline=None,
        suppress_health_check=list(HealthCheck),
        max_examples=10**6,
    )
    try:
        with _seeded(seed):
            found = find(_cases(meta), condition, settings=conf, database_key=_KEY)
    except (NoSuchExample, Unsatisfiable):
        return ShrinkResult(start, condition.runs)
    # Hypothesis orders by choice sequence; report it only if it is also smaller by the case's own measure.
    return ShrinkResult(found if found.size() <= start.size() else start, condition.runs)


@contextmanager
def _seeded(seed: str) -> Iterator[None]:
    """Make hypothesis's shrinker (which makes some random choices) reproducible for this trial.

    ``find(random=...)`` and ``@seed`` would, but they also switch the example database off, and the
    database is how the trial's choices reach the shrinker. The global seed (what pytest's
    ``--hypothesis-seed`` sets) keeps it on. Workers are single-threaded, so setting it around one
    ``find`` call is safe; tests/fuzz checks that the same failing trial shrinks to the same case twice.
    """
    import hypothesis.core as core

    old = core.global_force_seed
    value = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big")
    core.global_force_seed = value  # type: ignore[assignment]  # typed None: it is normally set by pytest
    try:
        yield
    finally:
        core.global_force_seed = old
