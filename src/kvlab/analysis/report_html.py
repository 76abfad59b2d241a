"""``kvlab experiment --report DIR``: one self-contained HTML page (figures embedded as base64 PNG).

For each strategy it shows the summary row, and for one clean and one contaminated trial: the requests'
outcomes, the sanitizer's root causes, the foreign reads replayed from the trace with the events that led
to them, the block timeline, and the per-head attention of the contaminated request (or of the first
request in a clean trial). Trials are deterministic given (seed, index), so the chosen trials are re-run
with a trace and attention capture rather than keeping every trial's trace in memory.
"""

from __future__ import annotations

import base64
import html
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvlab.analysis.trace_explain import format_event, replay
from kvlab.experiment.harness import Experiment, TrialResult, plan_trials
from kvlab.experiment.report import StrategySummary
from kvlab.experiment.strategies import Strategy
from kvlab.instrument.trace import Trace, TraceEvent

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.bad td { background: #fde2e2; }
img.fig { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; display: block; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 12px; }
.trial { border-left: 4px solid #9c9; padding-left: 1em; margin: 1em 0; }
.trial.contaminated { border-color: #d66; }
"""

# Sets data-figures on <body> once the page has loaded, so a headless browser can tell that every
# embedded figure decoded (a broken data URI leaves naturalWidth at 0).
_CHECK = """
<script>
window.addEventListener('load', () => {
  const imgs = Array.from(document.querySelectorAll('img.fig'));
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute('data-figures', ok + '/' + imgs.length);
});
</script>
"""


def _png_data_uri(draw) -> str:
    """Call ``draw(path)`` with a temporary PNG path and return the file as a data URI."""
    fd, path = tempfile.mkstemp(suffix=".png")
    os.close(fd)
    try:
        draw(path)
        data = Path(path).read_bytes()
    finally:
        os.unlink(path)
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _img(uri: str, alt: str) -> str:
    return f'<img class="fig" alt="{html.escape(alt)}" src="{uri}">'


def _summary_table(summaries: Sequence[StrategySummary]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    head = (
        "<tr><th>strategy</th><th>expect</th><th>trials</th><th>contaminated</th><th>= other's</th>"
        "<th>caught</th><th>peak rc</th><th>CoW</th><th>leaked</th><th>attn sim (alone)</th></tr>"
    )
    rows = []
    for s in summaries:
        caught = f"{s.caught_pct:.0f}%" if s.contaminated_trials else ("-" if not s.caught_trials else "violations!")
        cls = ' class="bad"' if s.problems() else ""
        rows.append(
            f"<tr{cls}><td>{html.escape(s.strategy)}</td><td>{s.expect}</td><td>{s.trials}</td>"
            f"<td>{s.contaminated_pct:.0f}%</td><td>{s.equals_other_pct:.0f}%</td><td>{caught}</td>"
            f"<td>{s.peak_shared_refcount}</td><td>{s.cow_copies}</td><td>{s.leaked_blocks}</td>"
            f"<td>{f(s.attention_similarity)} ({f(s.attention_similarity_reference)})</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _outcomes(t: TrialResult) -> str:
    rows = []
    for r in t.requests:
        rows.append(
            f"<tr><td>{html.escape(r.name)}</td><td>{r.outcome}</td><td>{t.arrivals.get(r.name, '-')}</td>"
            f"<td>{'-' if r.first_divergence is None else r.first_divergence}</td>"
            f"<td>{'-' if r.max_logit_diff is None else f'{r.max_logit_diff:.2e}'}</td>"
            f"<td>{html.escape(r.polluter or '-')}</td><td>{html.escape(r.equals_other or '-')}</td></tr>"
        )
    head = (
        "<tr><th>request</th><th>outcome</th><th>arrival step</th><th>first divergent token</th>"
        "<th>max |logit diff|</th><th>polluter</th><th>output = reference of</th></tr>"
    )
    return f"<table>{head}{''.join(rows)}</table>"


def _trial_section(exp: Experiment, strategy: Strategy, t: TrialResult) -> str:
    from kvlab.analysis.plots import attention_matrix, plot_heads
    from kvlab.analysis.timeline import plot_timeline

    kept: list[list[TraceEvent]] = []

    def sink(_s: str, _i: int, tr: Trace) -> None:
        kept.append(list(tr.events))

    plan = plan_trials(exp.passphrases, exp.cfg, strategy.inject_empty)[t.index]
    # The harness has no public "run one trial and hand back its capture"; _execute is that, and rerunning
    # it reproduces the trial exactly (fresh engine, deterministic plan).
    rerun = Experiment(exp.loaded, exp.passphrases, exp.cfg, trace_sink=sink)._execute(strategy, plan)
    events = kept[0]
    kind = "contaminated" if t.contaminated else "clean"
    parts = [f'<div class="trial {kind}"><h3>{kind} trial {t.index} (group {html.escape(t.group)})</h3>']
    parts.append(_outcomes(t))
    if t.root_causes:
        parts.append("<h4>Root cause (sanitizer)</h4>")
        parts += [f"<p>{html.escape(c)}</p>" for c in t.root_causes]
    elif t.violations == 0:
        parts.append("<p>The sanitizer saw no read of foreign state.</p>")
    rep = replay(events)
    bad = [f for f in rep.foreign if f.kind == "overwritten"]
    hits = [f for f in rep.foreign if f.kind == "hit"]
    parts.append(
        f"<h4>Foreign reads replayed from the trace</h4><p>{len(bad)} of state overwritten while held, "
        f"{len(hits)} of state shared through a prefix hit.</p>"
    )
    for f in (bad or hits)[:2]:
        chain = "\n".join(format_event(e) for e in f.chain)
        parts.append(f"<p>{html.escape(f.headline())}</p><pre>{html.escape(chain)}</pre>")
    if events:
        title = f"{strategy.name} trial {t.index}: block timeline"
        parts.append(_img(_png_data_uri(lambda p: plot_timeline(events, p, title)), title))
    who = next((r.name for r in t.requests if r.outcome == "contaminated"), t.requests[0].name)
    cap = rerun["capture"]
    if cap.records.get(who):
        m = attention_matrix(cap, who, exp.layer)
        title = f"{strategy.name} trial {t.index}: request {who}, layer {exp.layer}, per-head attention"
        parts.append(_img(_png_data_uri(lambda p: plot_heads(m, p, title)), title))
    parts.append("</div>")
    return "\n".join(parts)


def _diversity_section(exp: Experiment) -> str:
    from kvlab.analysis.diversity import measure_diversity
    from kvlab.analysis.plots import plot_diversity
    from kvlab.model import load_model
    from kvlab.model.mini import MINI_VARIANTS

    group = exp.passphrases.groups[0]
    ids = exp._prompt_ids(group, group.prompts[0])
    variants = [load_model(n) for n in MINI_VARIANTS] if exp.loaded.name in MINI_VARIANTS else [exp.loaded]
    results = [measure_diversity(v, ids, max_tokens=4)[0] for v in variants]
    rows = "".join(f"<tr><td>{r.model}</td><td>{r.num_kv_heads}</td><td>{r.mean:.4f}</td></tr>" for r in results)
    uri = _png_data_uri(lambda p: plot_diversity(results, p, "head diversity (mean pairwise JSD between heads)"))
    return (
        "<h2>Head diversity</h2><p>Mean pairwise Jensen-Shannon divergence (bits) between the heads' attention "
        f"distributions, prompt {html.escape(group.prompts[0])!r} of group {html.escape(group.name)}.</p>"
        f"<table><tr><th>model</th><th>KV heads</th><th>diversity</th></tr>{rows}</table>"
        + _img(uri, "head diversity by KV heads")
    )


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
    body = [f"<h1>{html.escape(title)}</h1>", _summary_table(summaries), _diversity_section(exp)]
    for s in strategies:
        trials = results[s.name]
        summary = next(x for x in summaries if x.strategy == s.name)
        body.append(f"<h2>{html.escape(s.name)}</h2><p>{html.escape(s.description)} (expected {s.expect}).</p>")
        for p in summary.problems():
            body.append(f"<p><b>check failed:</b> {html.escape(p)}</p>")
        clean = next((t for t in trials if not t.contaminated and not t.violations), None)
        dirty = next((t for t in trials if t.contaminated), None)
        if clean is None:
            body.append("<p>No clean trial.</p>")
        if dirty is None:
            body.append("<p>No contaminated trial.</p>")
        for t in (clean, dirty):
            if t is not None:
                body.append(_trial_section(exp, s, t))
    page = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
        f"<body>\n{chr(10).join(body)}\n{_CHECK}</body></html>\n"
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


__all__ = ["write_report"]
