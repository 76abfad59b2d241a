"""Summaries of experiment results: per-strategy rates, the rich table, JSON, the --check verdict."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

from kvlab.experiment.harness import ExperimentConfig, TrialResult, trial_to_dict
from kvlab.experiment.strategies import Strategy


@dataclass(frozen=True)
class StrategySummary:
    strategy: str
    expect: str
    description: str
    trials: int
    contaminated_trials: int
    equals_other_trials: int
    caught_trials: int  # trials with at least one sanitizer violation
    missed_trials: int  # contaminated trials the sanitizer did not catch
    uninformative_trials: int
    drift_trials: int  # reduced precision: an output drifted by rounding, with no foreign read
    contaminated_requests: int
    requests: int
    peak_shared_refcount: int
    cow_copies: int
    leaked_blocks: int
    attention_similarity: float | None  # contaminated request vs its polluter, in the trial
    attention_similarity_reference: float | None  # the same pairs run alone

    @property
    def contaminated_pct(self) -> float:
        return 100.0 * self.contaminated_trials / self.trials

    @property
    def equals_other_pct(self) -> float:
        return 100.0 * self.equals_other_trials / self.trials

    @property
    def caught_pct(self) -> float:
        """Share of contaminated trials in which the sanitizer reported the foreign read."""
        if not self.contaminated_trials:
            return 100.0 if not self.caught_trials else 0.0
        return 100.0 * (self.contaminated_trials - self.missed_trials) / self.contaminated_trials

    def problems(self) -> list[str]:
        """Why --check fails for this strategy (empty when it behaved as it claims)."""
        out = []
        if self.expect == "safe":
            if self.contaminated_trials:
                out.append(f"{self.strategy}: safe strategy contaminated {self.contaminated_trials} trials")
            if self.caught_trials:
                out.append(f"{self.strategy}: safe strategy has sanitizer violations in {self.caught_trials} trials")
            if self.leaked_blocks:
                out.append(f"{self.strategy}: safe strategy leaked {self.leaked_blocks} blocks")
        elif not self.contaminated_trials:
            out.append(f"{self.strategy}: unsafe strategy never contaminated: the harness did not see its failure")
        if self.missed_trials:
            out.append(f"{self.strategy}: {self.missed_trials} contaminated trials escaped the sanitizer")
        return out


def summarize(strategy: Strategy, results: list[TrialResult]) -> StrategySummary:
    sims = [r.attention_similarity for t in results for r in t.requests if r.attention_similarity is not None]
    refs = [
        r.attention_similarity_reference
        for t in results
        for r in t.requests
        if r.attention_similarity is not None and r.attention_similarity_reference is not None
    ]
    return StrategySummary(
        strategy=strategy.name,
        expect=strategy.expect,
        description=strategy.description,
        trials=len(results),
        contaminated_trials=sum(t.contaminated for t in results),
        equals_other_trials=sum(t.equals_other for t in results),
        caught_trials=sum(t.caught for t in results),
        missed_trials=sum(t.contaminated and not t.caught for t in results),
        uninformative_trials=sum(t.uninformative for t in results),
        drift_trials=sum(t.drift for t in results),
        contaminated_requests=sum(r.outcome == "contaminated" for t in results for r in t.requests),
        requests=sum(len(t.requests) for t in results),
        peak_shared_refcount=max((t.peak_refcount for t in results), default=0),
        cow_copies=sum(t.cow_copies for t in results),
        leaked_blocks=sum(t.leaked_blocks for t in results),
        attention_similarity=sum(sims) / len(sims) if sims else None,
        attention_similarity_reference=sum(refs) / len(refs) if refs else None,
    )


# (header, justification) of the summary table, shared by the terminal table and the HTML report. Columns:
# contaminated trials, trials where an output equals another request's reference, contaminated trials the
# sanitizer caught, peak refcount of a shared block, CoW copies, blocks leaked after the trials, and the
# cosine similarity of a contaminated request's attention to its polluter's (alone: the same two requests
# run alone).
SUMMARY_COLUMNS: list[tuple[str, JustifyMethod]] = [
    ("strategy", "left"),
    ("expect", "left"),
    ("trials", "right"),
    ("contam.", "right"),
    ("= other's", "right"),
    ("caught", "right"),
    ("peak rc", "right"),
    ("CoW", "right"),
    ("leaked", "right"),
    ("attn sim (alone)", "right"),
]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def summary_cells(s: StrategySummary) -> list[str]:
    """One row of the summary table as text, in the order of ``SUMMARY_COLUMNS``."""
    # With no contaminated trial there is no catch rate; violations then mean a false alarm or a leak
    # that did not change the output, worth a word rather than a number.
    caught = f"{s.caught_pct:.0f}%" if s.contaminated_trials else ("-" if not s.caught_trials else "violations!")
    return [
        s.strategy,
        s.expect,
        str(s.trials),
        f"{s.contaminated_pct:.0f}%",
        f"{s.equals_other_pct:.0f}%",
        caught,
        str(s.peak_shared_refcount),
        str(s.cow_copies),
        str(s.leaked_blocks),
        f"{_fmt(s.attention_similarity)} ({_fmt(s.attention_similarity_reference)})",
    ]


def render_table(summaries: list[StrategySummary], title: str) -> Table:
    """The summary table for the terminal; strategies that fail --check are shown in red."""
    table = Table(title=title)
    for col, just in SUMMARY_COLUMNS:
        table.add_column(col, justify=just)
    for s in summaries:
        name, *rest = summary_cells(s)
        # Text, not markup: a user-defined strategy name may contain brackets.
        table.add_row(Text(name, style="red" if s.problems() else ""), *rest)
    return table


def write_json(
    path: str | Path,
    cfg: ExperimentConfig,
    model: str,
    summaries: list[StrategySummary],
    results: dict[str, list[TrialResult]],
    wall_seconds: float,
) -> None:
    payload: dict[str, Any] = {
        "model": model,
        "config": asdict(cfg),
        "wall_seconds": wall_seconds,
        "summary": {
            s.strategy: {
                **asdict(s),
                "contaminated_pct": s.contaminated_pct,
                "equals_other_pct": s.equals_other_pct,
                "caught_pct": s.caught_pct,
            }
            for s in summaries
        },
        "trials": {name: [trial_to_dict(t) for t in ts] for name, ts in results.items()},
    }
    Path(path).write_text(json.dumps(payload, indent=1, ensure_ascii=False), encoding="utf-8")
