"""Where two prompts part inside a block decides what a cache without copy-on-write can pollute."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.experiment.divergence import divergence_pairs, sweep
from kvlab.experiment.harness import ExperimentConfig
from kvlab.experiment.strategies import BUILTIN_STRATEGIES
from kvlab.model import load_model


def test_pairs_reach_every_offset_and_part_where_they_say() -> None:
    tok = load_model("mini").tokenizer
    pairs = divergence_pairs(tok.encode, 16, max_prompt_tokens=112)
    assert [p.offset for p in pairs] == list(range(16))
    for p in pairs:
        a, b = (tok.encode(x) for x in p.prompts)
        assert a[: p.common_tokens] == b[: p.common_tokens] and a[p.common_tokens] != b[p.common_tokens]
        assert p.common_tokens % 16 == p.offset and p.common_tokens >= 16 and max(len(a), len(b)) <= 112


def test_a_boundary_divergence_shares_only_full_blocks_and_stays_clean() -> None:
    """shared-no-cow on the mini model: prompts parting on a block boundary are never read foreign; parting
    anywhere else, every trial is (the second request writes into the shared partial block)."""
    loaded = load_model("mini")
    pairs = divergence_pairs(loaded.tokenizer.encode, 16, max_prompt_tokens=112)
    points = sweep(loaded, BUILTIN_STRATEGIES["shared-no-cow"], pairs, ExperimentConfig(trials=2))
    by_offset = {p.offset: p for p in points}
    assert (by_offset[0].foreign_read, by_offset[0].output_changed) == (0, 0)
    assert all(p.foreign_read == p.trials == 2 for p in points if p.offset)
    assert sum(p.output_changed for p in points if p.offset) > 0
    safe = sweep(loaded, BUILTIN_STRATEGIES["shared-cow"], pairs[:3], ExperimentConfig(trials=2))
    assert all(p.foreign_read == p.output_changed == 0 for p in safe)


def test_divergence_cli_writes_json_and_plot(tmp_path) -> None:
    out, png = tmp_path / "div.json", tmp_path / "div.png"
    res = CliRunner().invoke(app, ["divergence", "--trials", "1", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["strategy"] == "shared-no-cow" and len(data["points"]) == 16
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = CliRunner().invoke(app, ["divergence", "--strategy", "nope"])
    assert bad.exit_code == 2 and "'nope' is not one of" in bad.output  # refused while parsing, before any load
