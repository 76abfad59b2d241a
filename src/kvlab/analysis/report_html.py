"""``kvlab experiment --report DIR``: one self-contained HTML page (figures embedded as base64 PNG).

For each strategy it shows the summary row, and for one clean and one contaminated trial: the requests'
outcomes, the sanitizer's root causes, the foreign reads replayed from the trace with the events that led
to them, the block timeline, and the per-head attention of the contaminated request (or of the first
request in a clean trial). Trials are deterministic given (seed, index), so the chosen trials are re-run
with ``Experiment.record_trial`` rather than keeping every trial's trace in memory.

The page is rendered from the jinja2 templates in ``templates/`` with autoescaping on: prompts, group and
strategy names come from a user's passphrase file and must reach the page as text, never as markup.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from matplotlib.figure import Figure

from kvlab.analysis.diversity import DiversityResult, measure_diversity
from kvlab.analysis.plots import DPI, attention_matrix, diversity_figure, heads_figure
from kvlab.analysis.timeline import timeline_figure
from kvlab.analysis.trace_explain import format_event, replay
from kvlab.experiment.harness import Experiment, TrialResult
from kvlab.experiment.report import LEGEND, SUMMARY_TABLES, StrategySummary
from kvlab.experiment.strategies import Strategy
from kvlab.model import load_model
from kvlab.model.mini import MINI_VARIANTS

try:
    import jinja2
except ImportError as exc:  # the core install has no jinja2; say which extra brings it
    raise ImportError("the HTML report needs jinja2: pip install 'kvlab[report]'") from exc


@dataclass(frozen=True)
class Image:
    alt: str
    uri: str  # data:image/png;base64,...


@dataclass(frozen=True)
class SummaryRow:
    bad: bool  # the strategy fails --check
    cells: list[str]


@dataclass(frozen=True)
class SummaryTable:
    caption: str
    columns: list[str]
    rows: list[SummaryRow]


@dataclass(frozen=True)
class ForeignReadView:
    headline: str
    chain: str  # the trace events that set the read up, one per line


@dataclass(frozen=True)
class TrialView:
    kind: str  # clean | contaminated
    result: TrialResult
    overwritten: int
    hits: int
    reads: list[ForeignReadView]
    images: list[Image]


@dataclass(frozen=True)
class StrategyView:
    strategy: Strategy
    problems: list[str]
    missing: list[str]  # kinds of trial (clean, contaminated) that no trial of the strategy was
    trials: list[TrialView]


@dataclass(frozen=True)
class DiversityView:
    group: str
    prompt: str
    results: list[DiversityResult]
    image: Image


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("kvlab.analysis", "templates"),
        autoescape=True,  # every template is HTML; no file-name rule that a new template could slip past
        undefined=jinja2.StrictUndefined,  # a misspelt field fails the report instead of printing nothing
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,  # an included template ends its line
    )


def _embed(fig: Figure, alt: str) -> Image:
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return Image(alt, "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"))


def _trial_view(exp: Experiment, strategy: Strategy, t: TrialResult) -> TrialView:
    rec = exp.record_trial(strategy, exp.plans(strategy)[t.index])
    rep = replay(rec.events)
    bad = [f for f in rep.foreign if f.kind == "overwritten"]
    hits = [f for f in rep.foreign if f.kind == "hit"]
    # Two examples are enough to read; the overwrites are the leaks, so they go first.
    reads = [ForeignReadView(f.headline(), "\n".join(format_event(e) for e in f.chain)) for f in (bad or hits)[:2]]
    images = []
    if rec.events:
        title = f"{strategy.name} trial {t.index}: block timeline"
        images.append(_embed(timeline_figure(rec.events, title), title))
    who = next((r.name for r in t.requests if r.outcome == "contaminated"), t.requests[0].name)
    if rec.capture.records.get(who):
        title = f"{strategy.name} trial {t.index}: request {who}, layer {exp.layer}, per-head attention"
        images.append(_embed(heads_figure(attention_matrix(rec.capture, who, exp.layer), title), title))
    kind = "contaminated" if t.contaminated else "clean"
    return TrialView(kind, t, len(bad), len(hits), reads, images)


def _strategy_view(
    exp: Experiment, strategy: Strategy, trials: list[TrialResult], summary: StrategySummary
) -> StrategyView:
    clean = next((t for t in trials if not t.contaminated and not t.violations), None)
    dirty = next((t for t in trials if t.contaminated), None)
    missing = [kind for kind, t in (("clean", clean), ("contaminated", dirty)) if t is None]
    shown = [_trial_view(exp, strategy, t) for t in (clean, dirty) if t is not None]
    return StrategyView(strategy, summary.problems(), missing, shown)


def _diversity_view(exp: Experiment) -> DiversityView:
    group = exp.passphrases.groups[0]
    prompt = group.prompts[0]
    ids = exp.prompt_ids(group, prompt)
    # The mini variants differ only in KV heads: side by side they show what sharing K/V does to the heads.
    variants = [load_model(n) for n in MINI_VARIANTS] if exp.loaded.name in MINI_VARIANTS else [exp.loaded]
    results = [measure_diversity(v, ids, max_tokens=4)[0] for v in variants]
    fig = diversity_figure(results, "head diversity (mean pairwise JSD between heads)")
    return DiversityView(group.name, prompt, results, _embed(fig, "head diversity by KV heads"))


def write_report(
    directory: str | os.PathLike[str],
    exp: Experiment,
    strategies: Sequence[Strategy],
    results: dict[str, list[TrialResult]],
    summaries: Sequence[StrategySummary],
    title: str,
) -> Path:
    """Write ``DIR/report.html`` and return its path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    by_name = {s.strategy: s for s in summaries}
    page = (
        _environment()
        .get_template("report.html")
        .render(
            title=title,
            tables=[
                SummaryTable(
                    caption,
                    [h.replace("\n", " ") for h, _ in columns],
                    [SummaryRow(bool(s.problems()), cells(s)) for s in summaries],
                )
                for caption, columns, cells in SUMMARY_TABLES
            ],
            legend=LEGEND,
            diversity=_diversity_view(exp),
            strategies=[_strategy_view(exp, s, results[s.name], by_name[s.name]) for s in strategies],
        )
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


__all__ = ["write_report"]
