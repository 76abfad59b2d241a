"""``kvlab experiment --report DIR``: one self-contained HTML page (figures embedded as base64 PNG).

For each strategy it shows the summary row, and for one clean and one contaminated trial: the requests'
outcomes, the sanitizer's root causes, the foreign reads replayed from the trace with the events that led
to them, the block timeline, and the per-head attention of the contaminated request (or of the first
request in a clean trial). Trials are deterministic given (seed, index), so the chosen trials are re-run
with ``Experiment.record_trial`` rather than keeping every trial's trace in memory.

The page is rendered from the jinja2 templates in ``templates/`` with autoescaping on: prompts, group and
strategy names come from a user's passphrase file and must reach the page as text, never as markup. A table
of contents at the top links every section (the summary tables, head diversity, each strategy and each trial
shown) by an id made from its name (``slugify``: ASCII letters, digits and dashes, whatever the name holds),
made unique in page order (``Anchors``), so a link to a section stays valid from run to run.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from matplotlib.figure import Figure

from kvlab.analysis.diversity import DiversityResult, measure_diversity
from kvlab.analysis.plots import DPI, attention_matrix, decode_tokens, diversity_figure, heads_figure
from kvlab.analysis.timeline import timeline_figure
from kvlab.analysis.trace_explain import format_event, replay
from kvlab.experiment.harness import Experiment, TrialResult
from kvlab.experiment.report import DOCUMENT_COLUMNS, LEGEND, SUMMARY_TABLES, StrategySummary, document_rows
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
    anchor: str


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
    anchor: str

    @property
    def title(self) -> str:
        return f"{self.kind} trial {self.result.index} (group {self.result.group})"


@dataclass(frozen=True)
class StrategyView:
    strategy: Strategy
    problems: list[str]
    missing: list[str]  # kinds of trial (clean, contaminated) that no trial of the strategy was
    trials: list[TrialView]
    anchor: str


@dataclass(frozen=True)
class DiversityView:
    group: str
    prompt: str
    results: list[DiversityResult]
    image: Image
    anchor: str


@dataclass(frozen=True)
class TocEntry:
    title: str
    anchor: str
    children: list[TocEntry]


def slugify(text: str) -> str:
    """An id fragment that is safe anywhere (in an attribute, after ``#`` in a URL): lower-case ASCII letters,
    digits and single dashes. Accents are dropped (é -> e); a name with nothing of that kind left (e.g. only
    CJK characters or punctuation) becomes ``x`` and 8 hex digits of its SHA-1, still stable."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return slug or "x" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


class Anchors:
    """Hands out the page's ids: the slug of the given parts joined by dashes, with ``-2``, ``-3``, ...
    appended when it is taken, so two sections never share an id and the ids depend only on the page."""

    def __init__(self, reserved: Sequence[str] = ()) -> None:
        self._taken = set(reserved)

    def __call__(self, *parts: str) -> str:
        base = "-".join(slugify(p) for p in parts)
        anchor, n = base, 2
        while anchor in self._taken:
            anchor, n = f"{base}-{n}", n + 1
        self._taken.add(anchor)
        return anchor


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


def _trial_view(exp: Experiment, strategy: Strategy, t: TrialResult, anchor: str) -> TrialView:
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
    who = next((r for r in t.requests if r.outcome == "contaminated"), t.requests[0])
    if rec.capture.records.get(who.name):
        title = f"{strategy.name} trial {t.index}: request {who.name}, layer {exp.layer}, per-head attention"
        matrix = attention_matrix(rec.capture, who.name, exp.layer)
        # The tokens it read: its prompt as sent, then its own output (what it generated in this trial).
        prompt = exp.prompt_ids(exp.passphrases.group(t.group), who.prompt) if who.prompt else []
        ids = [*prompt, *who.tokens]
        tokens = decode_tokens(exp.loaded.tokenizer, ids) if len(ids) >= matrix.shape[-1] else None
        images.append(_embed(heads_figure(matrix, title, tokens), title))
    kind = "contaminated" if t.contaminated else "clean"
    return TrialView(kind, t, len(bad), len(hits), reads, images, anchor)


def _strategy_view(
    exp: Experiment, strategy: Strategy, trials: list[TrialResult], summary: StrategySummary, anchors: Anchors
) -> StrategyView:
    clean = next((t for t in trials if not t.contaminated and not t.violations), None)
    dirty = next((t for t in trials if t.contaminated), None)
    missing = [kind for kind, t in (("clean", clean), ("contaminated", dirty)) if t is None]
    anchor = anchors("strategy", strategy.name)
    shown = [
        _trial_view(exp, strategy, t, anchors(anchor, kind, "trial", str(t.index)))
        for kind, t in (("clean", clean), ("contaminated", dirty))
        if t is not None
    ]
    return StrategyView(strategy, summary.problems(), missing, shown, anchor)


def _diversity_view(exp: Experiment, anchor: str) -> DiversityView:
    group = exp.passphrases.groups[0]
    prompt = group.prompts[0]
    ids = exp.prompt_ids(group, prompt)
    # The mini variants differ only in KV heads: side by side they show what sharing K/V does to the heads.
    variants = [load_model(n) for n in MINI_VARIANTS] if exp.loaded.name in MINI_VARIANTS else [exp.loaded]
    results = [measure_diversity(v, ids, max_tokens=4)[0] for v in variants]
    fig = diversity_figure(results, "head diversity (mean pairwise JSD between heads)")
    return DiversityView(group.name, prompt, results, _embed(fig, "head diversity by KV heads"), anchor)


def _contents(
    tables: Sequence[SummaryTable], diversity: DiversityView, strategies: Sequence[StrategyView]
) -> list[TocEntry]:
    """The table of contents: the summary tables, head diversity, each strategy with the trials it shows."""
    return [
        *(TocEntry(t.caption.capitalize(), t.anchor, []) for t in tables),
        TocEntry("Head diversity", diversity.anchor, []),
        *(TocEntry(s.strategy.name, s.anchor, [TocEntry(t.title, t.anchor, []) for t in s.trials]) for s in strategies),
    ]


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
    anchors = Anchors(reserved=["contents"])  # in page order: an id depends only on what comes before it
    tables = [
        SummaryTable(
            caption,
            [h.replace("\n", " ") for h, _ in columns],
            [SummaryRow(bool(s.problems()), cells(s)) for s in summaries],
            anchors("summary", caption),
        )
        for caption, columns, cells in SUMMARY_TABLES
    ]
    against = document_rows(list(summaries))
    if against:
        caption = "against the founding document's table"
        tables.append(
            SummaryTable(
                caption, DOCUMENT_COLUMNS, [SummaryRow(False, r) for r in against], anchors("summary", caption)
            )
        )
    diversity = _diversity_view(exp, anchors("head-diversity"))
    views = [_strategy_view(exp, s, results[s.name], by_name[s.name], anchors) for s in strategies]
    page = (
        _environment()
        .get_template("report.html")
        .render(
            title=title,
            contents=_contents(tables, diversity, views),
            tables=tables,
            legend=LEGEND,
            diversity=diversity,
            strategies=views,
        )
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


__all__ = ["Anchors", "slugify", "write_report"]
