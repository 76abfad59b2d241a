from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from kvlab.analysis.diversity import head_diversity, js_divergence, measure_diversity
from kvlab.cli import app
from kvlab.instrument.attention import AttentionRecord
from kvlab.model import load_model

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "passphrase: orange-kite-42; repeat it back"]
VARIANTS = {"mini": 4, "mini-gqa": 2, "mini-mqa": 1}
SEEDS = range(4)


def test_js_divergence_bounds() -> None:
    p = torch.tensor([0.5, 0.5, 0.0])
    assert float(js_divergence(p, p)) == 0.0
    assert abs(float(js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))) - 1.0) < 1e-9
    q = torch.tensor([0.1, 0.3, 0.6])
    assert abs(float(js_divergence(p, q)) - float(js_divergence(q, p))) < 1e-12


def test_identical_heads_have_zero_diversity_and_single_key_rows_are_skipped() -> None:
    row = torch.tensor([[1.0, 0.0, 0.0], [0.3, 0.7, 0.0], [0.2, 0.2, 0.6]])
    same = AttentionRecord(0, 0, [0, 1, 2], row.expand(4, 3, 3).clone())
    assert head_diversity([same]) == 0.0
    probs = same.probs.clone()
    probs[1, 1] = torch.tensor([0.7, 0.3, 0.0])
    # Only row 1 differs, in one pair of heads out of 6; row 0 (one visible key) is left out.
    expected = float(js_divergence(row[1], probs[1, 1])) * 3 / 6 / 2
    assert abs(head_diversity([AttentionRecord(0, 0, [0, 1, 2], probs)]) - expected) < 1e-9


def _measure() -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for name in VARIANTS:
        out[name] = {}
        for s in SEEDS:
            lm = load_model(name, seed=s)
            vals = [measure_diversity(lm, lm.tokenizer.encode(p), max_tokens=4)[0].mean for p in PROMPTS]
            out[name][s] = sum(vals) / len(vals)
    return out


def test_kv_head_diversity_ordering_is_not_stable_across_seeds_as_measured() -> None:
    # Measured (4 seeds x 2 prompts, all layers): every variant lands at 0.22-0.25 bits and the ranking of
    # MHA / GQA / MQA changes from seed to seed. The minis have random weights: heads differ through their
    # independent query projections even when they share one K/V head, so sharing K/V does not by itself
    # make heads alike; the "MQA heads all look alike" picture needs trained weights.
    d = _measure()
    orderings = {tuple(sorted(VARIANTS, key=lambda n: -d[n][s])) for s in SEEDS}
    assert len(orderings) >= 2, f"ordering became stable: {orderings} ({d})"
    for name in VARIANTS:
        for s in SEEDS:
            assert 0.15 < d[name][s] < 0.32, (name, s, d[name][s])
    means = {n: sum(d[n].values()) / len(SEEDS) for n in VARIANTS}
    spread_between = max(means.values()) - min(means.values())
    spread_within = max(max(d[n].values()) - min(d[n].values()) for n in VARIANTS)
    assert spread_between < spread_within, (means, d)


def test_attention_cli_writes_heatmaps_and_comparison(tmp_path: Path) -> None:
    out = tmp_path / "heads.png"
    cmp_out = tmp_path / "cmp.png"
    res = CliRunner().invoke(
        app,
        [
            "attention",
            "--prompt",
            PROMPTS[0],
            "--layer",
            "1",
            "--out",
            str(out),
            "--compare-kv-heads",
            "4,2,1",
            "--compare-out",
            str(cmp_out),
            "--max-tokens",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    for p in (out, cmp_out):
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "layer 1:" in res.output
    for name in VARIANTS:
        assert f"{name} " in res.output


def test_attention_cli_rejects_bad_arguments(tmp_path: Path) -> None:
    runner = CliRunner()
    bad_layer = runner.invoke(
        app, ["attention", "--prompt", "hello there", "--layer", "9", "--out", str(tmp_path / "a.png")]
    )
    assert bad_layer.exit_code == 2
    bad_kv = runner.invoke(
        app, ["attention", "--prompt", "hello there", "--out", str(tmp_path / "b.png"), "--compare-kv-heads", "3"]
    )
    assert bad_kv.exit_code == 2
    assert not (tmp_path / "a.png").exists()
