"""Summaries of experiment results: per-strategy rates, the rich table, JSON, the --check verdict."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

from kvlab.experiment.harness import LOGIT_ATOL, ExperimentConfig, TrialResult, trial_to_dict
from kvlab.experiment.strategies import Strategy


@dataclass(frozen=True)
class StrategySummary:
    strategy: str
    expect: str
    description: str
    trials: int
    contaminated_trials: int  # a request's output changed or its logits moved (fp32), whatever a person sees
    took_other_trials: int  # a request answered with another's reference instead of its own
    output_changed_trials: int  # a request's greedy tokens differ from its own reference
    logits_moved_trials: int  # a request's logits moved beyond the tolerance, its tokens unchanged
    identical_trials: int  # every request gave the same answer although their references differ
    polluted: dict[str, int]  # request name (arrival order: A first) -> trials in which its output changed
    caught_trials: int  # trials with at least one sanitizer violation: a request read K/V another wrote
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

    def pct(self, trials: int) -> float:
        return 100.0 * trials / self.trials

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
        took_other_trials=sum(t.took_other_answer for t in results),
        output_changed_trials=sum(t.output_changed for t in results),
        logits_moved_trials=sum(t.logits_moved for t in results),
        identical_trials=sum(t.outputs_identical for t in results),
        polluted=dict(sorted(Counter(name for t in results for name in t.polluted).items())),
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


# The two summary tables, shared by the terminal and the HTML report: (header, justification) per column.
# The first is what a reader of the founding document's table expects (what happened to the answers), the
# second what the cache did. Headers break where a terminal table should; LEGEND explains every column in one
# line, keyed by its header on one line (printed under the tables, and in JSON).
OUTCOME_COLUMNS: list[tuple[str, JustifyMethod]] = [
    ("strategy", "left"),
    ("foreign\nread", "right"),
    ("logits\nmoved", "right"),
    ("output\nchanged", "right"),
    ("took\nother's\nanswer", "right"),
    ("outputs\nidentical", "right"),
    ("polluted", "left"),
]
CACHE_COLUMNS: list[tuple[str, JustifyMethod]] = [
    ("strategy", "left"),
    ("expect", "left"),
    ("uninf.", "right"),
    ("caught", "right"),
    ("peak\nrefcount", "right"),
    ("CoW\ncopies", "right"),
    ("leaked\nblocks", "right"),
    ("attention\nsim (alone)", "right"),
]
LEGEND: dict[str, str] = {
    "foreign read": "trials where the KV sanitizer saw a request read K/V another request wrote",
    "logits moved": f"trials where a request's logits moved by more than {LOGIT_ATOL:g}, its tokens unchanged",
    "output changed": "trials where a request's greedy tokens differ from its own reference (the request run alone)",
    "took other's answer": "trials where a request's tokens equal another's reference and differ from its own",
    "outputs identical": "trials where every request gave the same tokens although their references differ",
    "polluted": "whose output changed, by arrival (A first), in how many trials",
    "uninf.": "uninformative trials: every request has the same reference, so no answer can show whose it is",
    "caught": "share of contaminated trials (output changed or logits moved) with a foreign read",
    "peak refcount": "highest reference count of a shared block",
    "CoW copies": "copy-on-write block copies, over all trials",
    "leaked blocks": "KV blocks still held after the trials ended",
    "attention sim (alone)": "cosine similarity of a contaminated request's attention to its polluter's (run alone)",
}


# The founding document's results (section 4.3, and its text on hash collisions): its group, the kvlab strategy
# that reproduces it, and what it saw. The HTML report puts a run's numbers beside them.
DOCUMENT_TABLE: list[tuple[str, str, str]] = [
    ("1: no sharing", "isolated", "both outputs correct, refcount 1"),
    ("2: sharing without copy-on-write", "shared-no-cow", "about 30%: both outputs the same, both request A's answer"),
    ("3: sharing with copy-on-write", "shared-cow", "both correct, shared blocks at refcount 2, a copy on write"),
    ("(its text) a hash collision", "weak-hash", "different prefixes share one key: wrong sharing"),
]
DOCUMENT_COLUMNS = ["the document's group", "kvlab strategy", "the document saw", "this run"]


def document_rows(summaries: list[StrategySummary]) -> list[list[str]]:
    """The document's table with this run's outcomes beside each group whose strategy ran."""
    by_name = {s.strategy: s for s in summaries}
    rows = []
    for group, strategy, saw in DOCUMENT_TABLE:
        s = by_name.get(strategy)
        if s is None:
            continue
        polluted = ", ".join(f"{name} {n}" for name, n in s.polluted.items()) or "none"
        run = (
            f"foreign read {s.pct(s.caught_trials):.0f}%, output changed {s.pct(s.output_changed_trials):.0f}%, "
            f"took the other's answer {s.pct(s.took_other_trials):.0f}%, outputs identical "
            f"{s.pct(s.identical_trials):.0f}%; polluted: {polluted}; peak refcount {s.peak_shared_refcount}, "
            f"{s.cow_copies} copies"
        )
        rows.append([group, strategy, saw, run])
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def outcome_cells(s: StrategySummary) -> list[str]:
    """One row of the outcome table as text, in the order of ``OUTCOME_COLUMNS``."""
    polluted = " ".join(f"{name} {n}" for name, n in s.polluted.items()) or "-"
    counts = (s.caught_trials, s.logits_moved_trials, s.output_changed_trials, s.took_other_trials, s.identical_trials)
    return [s.strategy, *(f"{s.pct(n):.0f}%" for n in counts), polluted]


def cache_cells(s: StrategySummary) -> list[str]:
    """One row of the cache table as text, in the order of ``CACHE_COLUMNS``."""
    # With no contaminated trial there is no catch rate; violations then mean a false alarm or a leak
    # that did not change the output, worth a word rather than a number.
    caught = f"{s.caught_pct:.0f}%" if s.contaminated_trials else ("-" if not s.caught_trials else "violations!")
    return [
        s.strategy,
        s.expect,
        f"{s.pct(s.uninformative_trials):.0f}%",
        caught,
        str(s.peak_shared_refcount),
        str(s.cow_copies),
        str(s.leaked_blocks),
        f"{_fmt(s.attention_similarity)} ({_fmt(s.attention_similarity_reference)})",
    ]


SUMMARY_TABLES: list[tuple[str, list[tuple[str, JustifyMethod]], Callable[[StrategySummary], list[str]]]] = [
    ("what the answers show", OUTCOME_COLUMNS, outcome_cells),
    ("what the cache did", CACHE_COLUMNS, cache_cells),
]


def render_tables(summaries: list[StrategySummary], title: str) -> list[Table]:
    """The summary tables for the terminal; strategies that fail --check are shown in red. Headers wrap at
    their spaces; strategy names are never cut: in 80 columns every name stays whole and distinct."""
    tables = []
    longest_name = max((len(s.strategy) for s in summaries), default=8)
    for caption, columns, cells in SUMMARY_TABLES:
        # No rules between columns and no padding: a row fits 80 terminal columns with the longest built-in name.
        table = Table(
            title=f"{title}: {caption}", title_justify="left", box=box.SIMPLE_HEAD, padding=0, show_edge=False
        )
        (first, first_just), *others = columns
        table.add_column(first, justify=first_just, no_wrap=True, min_width=longest_name)
        for col, just in others:
            table.add_column(col, justify=just)
        for s in summaries:
            name, *values = cells(s)
            # Text, not markup: a user-defined strategy name may contain brackets.
            table.add_row(Text(name, style="red" if s.problems() else ""), *values)
        tables.append(table)
    return tables


def legend_lines() -> list[str]:
    return [f"{column}: {meaning}" for column, meaning in LEGEND.items()]


def json_payload(
    cfg: ExperimentConfig,
    model: str,
    summaries: list[StrategySummary],
    results: dict[str, list[TrialResult]],
    wall_seconds: float,
) -> dict[str, Any]:
    """The experiment as one JSON document: the legend, the config, every strategy's summary, every trial."""
    return {
        "model": model,
        "legend": LEGEND,
        "config": asdict(cfg),
        "wall_seconds": wall_seconds,
        "summary": {
            s.strategy: {
                **asdict(s),
                "contaminated_pct": s.contaminated_pct,
                "took_other_pct": s.pct(s.took_other_trials),
                "output_changed_pct": s.pct(s.output_changed_trials),
                "caught_pct": s.caught_pct,
            }
            for s in summaries
        },
        "trials": {name: [trial_to_dict(t) for t in ts] for name, ts in results.items()},
    }


def write_json(
    path: str | Path,
    cfg: ExperimentConfig,
    model: str,
    summaries: list[StrategySummary],
    results: dict[str, list[TrialResult]],
    wall_seconds: float,
) -> None:
    payload = json_payload(cfg, model, summaries, results, wall_seconds)
    Path(path).write_text(json.dumps(payload, indent=1, ensure_ascii=False), encoding="utf-8")
