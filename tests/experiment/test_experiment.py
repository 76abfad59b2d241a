"""The passphrase experiment on the mini model: safe strategies never leak, unsafe ones do and are caught."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli_output import words
from kvlab.cli import app
from kvlab.experiment.harness import Experiment, ExperimentConfig, TrialResult, plan_trials, trial_to_dict
from kvlab.experiment.passphrases import PassphraseGroup, default_passphrases
from kvlab.experiment.report import summarize
from kvlab.experiment.strategies import BUILTIN_STRATEGIES
from kvlab.instrument.trace import TraceEvent
from kvlab.model import load_model

Runs = dict[str, list[TrialResult]]  # strategy -> its trials
UNSAFE = ["shared-no-cow", "shared-no-refcount", "weak-hash", "empty-request"]


@pytest.fixture(scope="module")
def default_run() -> Runs:
    """All six strategies x 100 trials with the CLI's defaults: the README's first command."""
    torch.set_num_threads(1)
    exp = Experiment(load_model("mini"), default_passphrases(), ExperimentConfig(trials=100))
    return {name: exp.run_strategy(s) for name, s in BUILTIN_STRATEGIES.items()}


@pytest.mark.parametrize("name", ["isolated", "shared-cow"])
def test_safe_strategies_never_contaminate(default_run: Runs, name: str) -> None:
    trials = default_run[name]
    assert len(trials) == 100
    assert [t.index for t in trials if t.contaminated] == []
    assert sum(t.violations for t in trials) == 0
    assert sum(t.leaked_blocks for t in trials) == 0
    # Informative trials exist: the prompts of a trial do continue differently, so a leak would show.
    assert sum(not t.uninformative for t in trials) > 50


def test_shared_cow_really_shares_in_every_trial(default_run: Runs) -> None:
    for t in default_run["shared-cow"]:
        assert t.peak_refcount >= 2, t.index
        assert t.cow_copies >= 1, t.index
    assert all(t.peak_refcount == 1 and t.cow_copies == 0 for t in default_run["isolated"])


@pytest.mark.parametrize("name", UNSAFE)
def test_unsafe_strategies_contaminate_and_the_sanitizer_catches_every_one(default_run: Runs, name: str) -> None:
    trials = default_run[name]
    contaminated = [t for t in trials if t.contaminated]
    assert len(contaminated) > 0
    assert [t.index for t in contaminated if not t.caught] == []
    for t in contaminated:
        assert t.root_causes and "written by request" in t.root_causes[0]
    s = summarize(BUILTIN_STRATEGIES[name], trials)
    assert s.problems() == []


def test_weak_hash_leaks_only_across_near_miss_prompts(default_run: Runs) -> None:
    groups = {t.group for t in default_run["weak-hash"] if t.contaminated}
    assert groups == {"near-miss"}
    # The victim reads the other prompt's whole prefix, yet on the mini model its answer stays its own: the
    # near-miss prompts continue alike (their references are equal), so only the logits move. Nothing here
    # may count as "took the other's answer": that needs references that differ.
    contaminated = [t for t in default_run["weak-hash"] if t.contaminated]
    assert all(t.logits_moved and not t.output_changed for t in contaminated)
    assert not any(t.took_other_answer or t.outputs_identical for t in default_run["weak-hash"])


def test_a_trial_whose_references_are_equal_never_counts_as_taking_the_others_answer() -> None:
    """The old "= other's" column counted a polluted output that equals *a* reference: where the two references
    are equal, that is its own answer too (26 of shared-no-cow's 100 trials, all near-miss, only logits
    moved). The near-miss group's two prompts have one reference; under the unsafe strategies that pollute
    them, no trial may count as "took the other's answer" or "outputs identical"."""
    near_miss = default_passphrases().group("near-miss")
    exp = Experiment(
        load_model("mini"), replace(default_passphrases(), groups=(near_miss,)), ExperimentConfig(trials=20)
    )
    for name in ("shared-no-cow", "weak-hash"):
        trials = exp.run_strategy(BUILTIN_STRATEGIES[name])
        assert all(t.uninformative or t.contaminated for t in trials)
        for t in trials:  # one reference: the two agree over their common length
            a, b = (r.reference for r in t.requests)
            assert a[: len(b)] == b[: len(a)], t.index
        polluted = [t for t in trials if t.contaminated]
        assert polluted, f"{name} should still pollute the near-miss prompts"
        for t in polluted:
            assert all(r.took_answer_of is None for r in t.requests), t.index
            assert not t.outputs_identical, t.index
        s = summarize(BUILTIN_STRATEGIES[name], trials)
        assert (s.took_other_trials, s.identical_trials) == (0, 0)


def test_outcome_columns_tell_what_a_person_sees_from_what_the_instruments_see(default_run: Runs) -> None:
    """The mini model's numbers behind the README's table (seed 0, 100 trials): shared-no-cow changes an
    answer in most trials, always the first arrival's more than the second's (B writes into A's partial
    block), and never hands over the other's answer; a safe strategy moves nothing."""
    s = summarize(BUILTIN_STRATEGIES["shared-no-cow"], default_run["shared-no-cow"])
    assert s.caught_trials == 100 and s.output_changed_trials > 50
    assert s.logits_moved_trials + s.output_changed_trials >= s.contaminated_trials
    assert s.polluted["A"] > s.polluted.get("B", 0)
    assert s.took_other_trials == 0 and s.identical_trials == 0
    for name in ("isolated", "shared-cow"):
        safe = summarize(BUILTIN_STRATEGIES[name], default_run[name])
        assert (safe.caught_trials, safe.logits_moved_trials, safe.output_changed_trials, safe.polluted) == (
            0,
            0,
            0,
            {},
        )
    empty = summarize(BUILTIN_STRATEGIES["empty-request"], default_run["empty-request"])
    assert empty.polluted == {"E": 100} and empty.took_other_trials > 0  # it answers with its neighbour's text


def test_summary_tables_fit_80_columns_with_every_strategy_name_whole(default_run: Runs) -> None:
    from rich.console import Console

    from kvlab.experiment.report import CACHE_COLUMNS, LEGEND, OUTCOME_COLUMNS, render_tables

    summaries = [summarize(BUILTIN_STRATEGIES[n], ts) for n, ts in default_run.items()]
    console = Console(width=80, record=True)
    for table in render_tables(summaries, "mini, 100 trials x 2 requests, seed 0"):
        console.print(table)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in BUILTIN_STRATEGIES:
        assert sum(line.split()[:1] == [name] for line in text.splitlines()) == 2, name  # once in each table
    assert "…" not in text
    # Every column has its line in the legend.
    assert {h.replace("\n", " ") for h, _ in OUTCOME_COLUMNS + CACHE_COLUMNS} - {"strategy", "expect"} == set(LEGEND)


def test_attention_similarity_to_the_polluter_is_measured(default_run: Runs) -> None:
    # The seed saw a polluted request attend like its polluter. Measured here (last layer, head mean, by
    # decode index, alone runs cut to the trial's steps): under shared-no-cow the pair is on average closer
    # than when run alone (0.846 vs 0.836); under weak-hash it is not (0.944 vs 0.996), because the near-miss
    # prompts already attend almost alike when alone. The test pins the first relation and that the metric
    # exists for every foreign polluter.
    for name in ("weak-hash", "shared-no-cow"):
        pairs = [
            (r.attention_similarity, r.attention_similarity_reference)
            for t in default_run[name]
            for r in t.requests
            if r.outcome == "contaminated" and r.polluter not in (None, r.name)
        ]
        assert pairs and all(a is not None and b is not None and -1 <= a <= 1.0001 for a, b in pairs)
    s = summarize(BUILTIN_STRATEGIES["shared-no-cow"], default_run["shared-no-cow"])
    assert s.attention_similarity > s.attention_similarity_reference


def test_attention_similarity_alone_runs_over_the_trial_steps() -> None:
    # The trial's pairs end with the shorter output; the alone runs are full length and must be cut there, or
    # the two means cover different steps (on SmolLM2 that alone moved 0.950 to 0.939 over 20 trials).
    from kvlab.experiment.harness import Reference, RequestResult
    from kvlab.instrument.attention import AttentionCapture, AttentionRecord

    exp = Experiment(load_model("mini"), default_passphrases())
    cap = AttentionCapture()
    same, other = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    for name in ("A", "B"):
        for step in range(2):  # two decode steps each, every head on key 0
            cap.records[name].append(AttentionRecord(step, exp.layer, [5 + step], same.expand(4, 1, 2).clone()))
    res = RequestResult("A", "a", "contaminated", [1, 2, 3], [1, 2, 4], 2, None, polluter="B")
    # Alone: alike for the two steps the trial ran, opposite after (the continuations went apart).
    refs = {
        "A": Reference([1, 2, 4, 4], None, [same, same, same]),
        "B": Reference([7, 8, 9, 9], None, [same, same, other]),
    }
    exp._attention_similarity(cap, [res], refs)
    assert res.attention_similarity == pytest.approx(1.0)
    assert res.attention_similarity_reference == pytest.approx(1.0)  # not (1 + 1 + 0) / 3


def test_same_seed_same_results() -> None:
    torch.set_num_threads(1)
    lm = load_model("mini")
    cfg = ExperimentConfig(trials=8, seed=3)
    a = Experiment(lm, default_passphrases(), cfg).run_strategy(BUILTIN_STRATEGIES["shared-no-cow"])
    b = Experiment(lm, default_passphrases(), cfg).run_strategy(BUILTIN_STRATEGIES["shared-no-cow"])
    assert [trial_to_dict(t) for t in a] == [trial_to_dict(t) for t in b]
    other = plan_trials(default_passphrases(), ExperimentConfig(trials=8, seed=4))
    assert plan_trials(default_passphrases(), cfg) != other


def test_record_trial_reproduces_a_trial_with_its_trace_and_capture() -> None:
    torch.set_num_threads(1)
    kept: dict[tuple[str, int], list[TraceEvent]] = {}
    exp = Experiment(
        load_model("mini"),
        default_passphrases(),
        ExperimentConfig(trials=3),
        trace_sink=lambda s, i, tr: kept.__setitem__((s, i), list(tr.events)),
    )
    strategy = BUILTIN_STRATEGIES["shared-no-cow"]
    ran = exp.run_strategy(strategy)
    rec = exp.record_trial(strategy, exp.plans(strategy)[2])
    assert trial_to_dict(rec.result) == trial_to_dict(ran[2])
    assert rec.events == kept[(strategy.name, 2)]
    assert len(kept) == 3  # a recording is the caller's: it does not go to the sink a second time
    assert set(rec.capture.records) == {r.name for r in ran[2].requests}


def test_prompt_ids_apply_the_chat_template_only_when_the_group_asks() -> None:
    lm = load_model("mini")
    exp = Experiment(lm, default_passphrases())
    plain = PassphraseGroup("g", ("hello",))
    chat = PassphraseGroup("c", ("hello",), chat_template=True)
    assert exp.prompt_ids(plain, "hello") == lm.tokenizer.encode("hello")
    wrapped = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert exp.prompt_ids(chat, "hello") == lm.tokenizer.encode(wrapped)


def test_trial_plans_agree_across_strategies() -> None:
    cfg = ExperimentConfig(trials=10)
    plain = plan_trials(default_passphrases(), cfg)
    with_empty = plan_trials(default_passphrases(), cfg, inject_empty=True)
    for p, q in zip(plain, with_empty, strict=True):
        assert [r for r in q.requests if r.name != "E"] == list(p.requests)


def test_cli_json_trace_and_check(tmp_path: Path) -> None:
    out, trace = tmp_path / "r.json", tmp_path / "t.jsonl"
    res = CliRunner().invoke(
        app,
        [
            "experiment",
            "--trials",
            "6",
            "--strategies",
            "shared-cow,shared-no-cow",
            "--json",
            str(out),
            "--trace",
            str(trace),
            "--check",
            "--seed",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "shared-no-cow" in res.output and "check passed" in res.output
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"shared-cow", "shared-no-cow"}
    assert len(data["trials"]["shared-no-cow"]) == 6
    assert data["summary"]["shared-cow"]["contaminated_trials"] == 0
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {e["strategy"] for e in events} == {"shared-cow", "shared-no-cow"}
    assert {"alloc", "hit", "write", "cow", "free"} <= {e["op"] for e in events}


def test_check_fails_when_a_strategy_does_not_behave_as_declared(tmp_path: Path) -> None:
    # A strategy that claims to be unsafe but is not, and one that claims to be safe but is not:
    # --check must fail for both (the harness can fail).
    spec = tmp_path / "p.yaml"
    spec.write_text(
        "groups:\n  - name: g\n    prompts:\n"
        "      - '请把以下内容翻译成英文：今天天气很好'\n      - '请把以下内容翻译成英文：今天天气很差'\n"
        "strategies:\n"
        "  - name: claims-unsafe\n    expect: unsafe\n    cache: {share_prefix: true}\n"
        "  - name: claims-safe\n    expect: safe\n"
        "    cache: {copy_on_write: false, reference_counting: false, unsafe: true}\n",
        encoding="utf-8",
    )
    runner = CliRunner()
    for name, needle in [("claims-unsafe", "never contaminated"), ("claims-safe", "safe strategy contaminated")]:
        res = runner.invoke(
            app, ["experiment", "--trials", "4", "--passphrases", str(spec), "--strategies", name, "--check"]
        )
        assert res.exit_code == 1, res.output
        assert needle in res.output


def test_cli_rejects_unknown_strategy_and_bad_file(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["experiment", "--strategies", "nope"])
    assert res.exit_code == 2 and "expected comma-separated strategies from isolated," in words(res.output)
    assert "got 'nope'" in words(res.output)
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups:\n  - name: x\n    prompts: [a, b\n", encoding="utf-8")
    res = runner.invoke(app, ["experiment", "--passphrases", str(bad)], env={"COLUMNS": "400"})  # paths unbroken
    assert res.exit_code == 2 and "bad.yaml" in words(res.output) and "line" in words(res.output)


def test_bf16_rounding_drift_is_not_counted_as_a_leak_and_no_leak_is_missed() -> None:
    """In bf16 a batched request drifts from its alone run by rounding alone. The experiment must call that
    drift (no foreign read) and still count every real leak (a sanitizer-caught foreign read)."""
    exp = Experiment(load_model("mini", dtype=torch.bfloat16), default_passphrases(), ExperimentConfig(trials=24))
    runs = {n: exp.run_strategy(BUILTIN_STRATEGIES[n]) for n in ("isolated", "shared-cow", "shared-no-cow")}
    safe = [summarize(BUILTIN_STRATEGIES[n], runs[n]) for n in ("isolated", "shared-cow")]
    assert all(s.contaminated_trials == 0 and s.caught_trials == 0 for s in safe)
    assert sum(s.drift_trials for s in safe) > 0, "bf16 batching should drift somewhere, or this test shows nothing"
    unsafe = summarize(BUILTIN_STRATEGIES["shared-no-cow"], runs["shared-no-cow"])
    assert unsafe.contaminated_trials > 0 and unsafe.missed_trials == 0


def test_a_trial_that_drifts_over_an_fp8_cache_is_drift_not_contamination() -> None:
    """Trial 96 of the default plan (mini, isolated): over an fp8 cache one request's batch run parts from its lone
    run, its K/V having rounded to other fp8 codes, with no foreign read: drift, never contamination. In fp32 the
    same trial is correct, so it is the cache's rounding that the verdict forgives, and only because the config
    says the cache rounds (a check of the model's dtype and quantisation alone would call it contaminated)."""
    lm = load_model("mini")
    isolated = BUILTIN_STRATEGIES["isolated"]
    results = {}
    for kv in ("fp8", "auto"):
        exp = Experiment(lm, default_passphrases(), ExperimentConfig(trials=97, kv_cache_dtype=kv))
        results[kv] = exp.run_trial(isolated, exp.plans(isolated)[96])
    fp8 = [(r.outcome, r.foreign_read) for r in results["fp8"].requests]
    assert ("drift", False) in fp8 and all(outcome != "contaminated" for outcome, _ in fp8)
    assert all(r.outcome == "correct" for r in results["auto"].requests)
