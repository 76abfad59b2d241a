from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvlab.analysis.timeline import ownership_grid
from kvlab.analysis.trace_explain import load_trace, replay
from kvlab.cli import app
from kvlab.experiment.harness import Experiment, ExperimentConfig
from kvlab.experiment.passphrases import default_passphrases
from kvlab.experiment.strategies import BUILTIN_STRATEGIES
from kvlab.instrument.trace import TraceEvent
from kvlab.model import load_model

STRATEGIES = ("shared-no-cow", "shared-cow")
Run = tuple[Path, dict[str, Any]]  # the trace file and the --json document
CAUSE = re.compile(r"request (\w+) read block (\d+) .* written by request (\w+)")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A real experiment run through the CLI: its trace file and its --json (with the sanitizer's causes)."""
    d = tmp_path_factory.mktemp("trace")
    trace, js = d / "trace.jsonl", d / "run.json"
    res = CliRunner().invoke(
        app,
        ["experiment", "--strategies", ",".join(STRATEGIES), "--trials", "3", "--trace", str(trace), "--json", str(js)],
    )
    assert res.exit_code == 0, res.output
    return trace, json.loads(js.read_text())


def _trials(doc: dict[str, Any], strategy: str) -> list[dict[str, Any]]:
    found = [v for v in _walk(doc) if isinstance(v, dict) and v.get("strategy") == strategy and "root_causes" in v]
    assert found, f"no trials of {strategy} in the --json output"
    return found


def _walk(x: object) -> Iterator[object]:
    yield x
    if isinstance(x, dict):
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v)


def test_explain_finds_the_sanitizers_root_cause_in_every_contaminated_no_cow_trial(run: Run) -> None:
    trace, doc = run
    groups = load_trace(trace)
    checked = 0
    for t in _trials(doc, "shared-no-cow"):
        rep = replay(groups[("shared-no-cow", t["index"])])
        overwritten = {(f.reader, f.block, f.writer) for f in rep.foreign if f.kind == "overwritten"}
        for cause in t["root_causes"]:
            m = CAUSE.search(cause)
            assert m, cause
            assert (m[1], int(m[2]), m[3]) in overwritten, (cause, overwritten)
            checked += 1
    assert checked, "no contaminated shared-no-cow trial to check"


def test_cow_trials_share_by_hits_and_never_overwrite(run: Run) -> None:
    trace, doc = run
    groups = load_trace(trace)
    for t in _trials(doc, "shared-cow"):
        assert not t["root_causes"]
        events = groups[("shared-cow", t["index"])]
        rep = replay(events)
        assert rep.block_size == 16
        assert [f for f in rep.foreign if f.kind == "overwritten"] == []
        hits = [f for f in rep.foreign if f.kind == "hit"]
        assert hits and all(f.reader != f.writer for f in hits)
        # The chain starts where the shared state was made and ends with the hit that took it.
        for f in hits:
            assert f.chain[0].op == "alloc" and f.chain[0].request == f.writer
            assert any(e.op == "hit" and e.request == f.reader for e in f.chain)
        # A full-block hit stays shared at the end of its step; a partial one may be copied within the step.
        blocks, steps, requests, grid = ownership_grid(events)
        for e in events:
            if e.op == "hit" and not e.detail["partial"]:
                assert grid[blocks.index(e.block), steps.index(e.step)] == len(requests) + 1


def test_in_memory_trace_and_cli_file_replay_alike(run: Run, tmp_path: Path) -> None:
    trace, _ = run
    kept: dict[tuple[str, int], list[TraceEvent]] = {}
    exp = Experiment(
        load_model("mini"),
        default_passphrases(),
        ExperimentConfig(trials=1),
        trace_sink=lambda s, i, tr: kept.__setitem__((s, i), list(tr.events)),
    )
    exp.run_strategy(BUILTIN_STRATEGIES["shared-no-cow"])
    from_file = replay(load_trace(trace)[("shared-no-cow", 0)])
    in_memory = replay(kept[("shared-no-cow", 0)])
    key = lambda r: [(f.step, f.reader, f.block, f.writer, f.kind, f.slots) for f in r.foreign]  # noqa: E731
    assert key(from_file) == key(in_memory) and key(in_memory)
    # A Trace(path) file nests the detail; it must load to the same events.
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps({**e.__dict__}) + "\n" for e in kept[("shared-no-cow", 0)]))
    assert load_trace(path)[(None, None)] == kept[("shared-no-cow", 0)]


def test_trace_cli_summarize_explain_timeline(run: Run, tmp_path: Path) -> None:
    trace, _ = run
    runner = CliRunner()
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    a_events = [x for x in lines if x["strategy"] == "shared-no-cow" and x["trial"] == 0 and x["request"] == "A"]
    res = runner.invoke(
        app, ["trace", "summarize", str(trace), "--strategy", "shared-no-cow", "--trial", "0", "--request", "A"]
    )
    assert res.exit_code == 0, res.output
    assert "request A:" in res.output and "request B:" not in res.output
    assert sum(1 for ln in res.output.splitlines() if ln.startswith("  step")) == len(a_events)

    res = runner.invoke(app, ["trace", "explain", str(trace), "--strategy", "shared-no-cow"])
    assert res.exit_code == 0, res.output
    assert "<- foreign (overwritten)" in res.output and "== strategy shared-no-cow, trial 0 ==" in res.output

    res = runner.invoke(app, ["trace", "explain", str(trace), "--request", "Z"])
    assert res.exit_code == 2

    out = tmp_path / "tl.png"
    res = runner.invoke(
        app, ["trace", "timeline", str(trace), "--strategy", "shared-cow", "--trial", "1", "--plot", str(out)]
    )
    assert res.exit_code == 0, res.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    ambiguous = runner.invoke(app, ["trace", "timeline", str(trace), "--plot", str(tmp_path / "x.png")])
    assert ambiguous.exit_code == 2


def test_verified_prefix_hits_are_shared_reads_not_foreign_ones(run: Run) -> None:
    """``trace explain`` called the shared-cow strategy's ordinary prefix hits "foreign": a verified hit is the
    reader's own prefix, computed by another request, and is shown only with --reads shared (or all)."""
    from kvlab.analysis.trace_explain import explain_text

    trace, doc = run
    groups = load_trace(trace)
    for t in _trials(doc, "shared-cow"):
        rep = replay(groups[("shared-cow", t["index"])])
        assert rep.foreign and all(f.shared for f in rep.foreign)
        assert explain_text(rep).startswith("no foreign reads")
        assert "<- shared (verified hit)" in explain_text(rep, reads="shared")
    res = CliRunner().invoke(app, ["trace", "explain", str(trace), "--strategy", "shared-cow", "--trial", "0"])
    assert res.exit_code == 0 and "<- foreign" not in res.output and "--reads shared" in res.output
    # The unsafe strategy's overwrites stay foreign, whatever the hits before them were.
    for t in _trials(doc, "shared-no-cow"):
        rep = replay(groups[("shared-no-cow", t["index"])])
        if t["root_causes"]:
            assert "<- foreign (overwritten)" in explain_text(rep)
    bad = CliRunner().invoke(app, ["trace", "explain", str(trace), "--reads", "some"])
    assert bad.exit_code == 2


def test_unverified_hits_of_a_weak_hash_are_foreign(tmp_path: Path) -> None:
    """weak-hash shares blocks on a colliding key without comparing tokens: its hits are not shared reads."""
    from kvlab.analysis.trace_explain import explain_text
    from kvlab.instrument.trace import Trace

    traces: list[Trace] = []
    exp = Experiment(
        load_model("mini"),
        default_passphrases(),
        ExperimentConfig(trials=6),
        trace_sink=lambda s, i, t: traces.append(t),
    )
    results = exp.run_strategy(BUILTIN_STRATEGIES["weak-hash"])
    contaminated = [i for i, r in enumerate(results) if r.contaminated]
    assert contaminated
    for i in contaminated:
        rep = replay(traces[i].events)
        hits = [f for f in rep.foreign if f.kind == "hit"]
        assert hits and not any(f.shared for f in hits)
        assert "<- foreign (hit, unverified)" in explain_text(rep)
