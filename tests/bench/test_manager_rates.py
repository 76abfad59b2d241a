"""``kvlab bench manager`` and ``kvlab.bench.studies.manager_rates`` on tiny sizes: every count follows from the sizes
(timings are printed, never checked)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlab.bench.studies.manager_rates import lookup_scaling, many_live, step_rates
from kvlab.cli import app

runner = CliRunner()
BS = 16


def _blocks(tokens: int) -> int:
    return -(-tokens // BS)


@pytest.mark.parametrize("shared", [0, 32, 40])  # none, two full blocks, two full blocks and a partial one
def test_step_rates_counts_follow_from_the_sizes(shared: int) -> None:
    n, prompt, decode = 12, 64, 5
    r = step_rates(n, shared, prompt, decode, block_size=BS, num_blocks=64, repeats=2)
    assert (r.requests, r.repeats, r.shared_prefix) == (n, 2, shared)
    # Request i arrives at step i, appends at steps i+1 .. i+decode and leaves at the end of step i+decode.
    assert r.steps == n + decode
    assert r.decode_appends == n * decode
    assert r.peak_live == decode + 1
    # Every request but the first finds the shared prefix (token granularity: its partial block too).
    assert r.hit_tokens == (n - 1) * shared
    assert r.queried_tokens == n * prompt
    assert r.hit_rate == pytest.approx((n - 1) * shared / (n * prompt))
    # Each takes the blocks of its prompt and decoded tokens but the shared full blocks (a partial hit is copied
    # to a block of its own, since the cached block goes on with the first prompt's tokens).
    assert r.blocks_allocated == n * _blocks(prompt + decode) - (n - 1) * (shared // BS)
    for phase in ("lookup", "allocate", "decode", "commit", "free"):
        assert getattr(r, f"{phase}_seconds") > 0
    d = r.as_dict()
    assert d["blocks_allocated"] == r.blocks_allocated and d["hit_rate"] == round(r.hit_rate, 4)
    assert set(r.rates()) <= set(d)


def test_step_rates_refuses_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="shared_prefix"):
        step_rates(4, shared_prefix=64, prompt_tokens=64, repeats=1)
    with pytest.raises(ValueError, match="blocks"):
        step_rates(4, prompt_tokens=64, decode_tokens=4, num_blocks=8, repeats=1)


def test_lookup_hashes_grow_linearly_with_the_prompt() -> None:
    lengths = [16, 64, 256, 40]
    rows = lookup_scaling(lengths, block_size=BS, repeats=3)
    assert [r.tokens for r in rows] == lengths
    for r in rows:
        assert r.hit_tokens == r.tokens  # the whole prefix is found
        assert r.blocks == _blocks(r.tokens)
        assert r.hashes == r.tokens // BS  # one chain key per full block; the partial one is a trie walk
        assert r.repeats == 3 and 0 < r.best_us <= r.median_us
        assert r.as_dict()["us_per_block"] == round(r.us_per_block, 3)


@pytest.mark.parametrize("system", [32, 40])
def test_many_live_requests(system: int) -> None:
    n, own, decode, per_step = 20, 16, 8, 8
    per_request = _blocks(system + own + decode)
    rows = {g: many_live(n, g, system, own, decode, per_step, block_size=BS, repeats=2) for g in ("token", "block")}
    for g, r in rows.items():
        assert (r.granularity, r.live_requests, r.repeats) == (g, n, 2)
        assert r.num_blocks == n * per_request + 16
        # The first step's requests find nothing (nothing is committed yet): each holds its own copy of the system
        # prompt; every later one shares the full blocks of one of them.
        assert r.blocks_in_use == n * per_request - (n - per_step) * (system // BS)
        assert r.peak_refcount == 1 + n - per_step
        assert r.gc_objects > 0 and r.invariants_seconds > 0
        assert r.as_dict()["decode_step_ms"] == round(r.decode_step_ms, 3)
    # Token granularity also shares the system prompt's partial block; block granularity only its full blocks.
    assert rows["token"].hit_tokens == (n - per_step) * system
    assert rows["block"].hit_tokens == (n - per_step) * (system // BS) * BS
    # The token trie keeps a node per cached token: more objects for the GC to track.
    assert rows["token"].gc_objects > rows["block"].gc_objects


TINY = [
    *("--num-requests", "6", "--prompt-tokens", "48", "--shared-prefixes", "0,32", "--decode-tokens", "3"),
    *("--num-blocks", "32", "--repeats", "1", "--lengths", "16,64", "--lookup-repeats", "2"),
    *("--live-requests", "10", "--admit-per-step", "4", "--live-repeats", "1"),
]


def test_bench_manager_json_on_stdout() -> None:
    res = runner.invoke(app, ["bench", "manager", *TINY, "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # the tables went to stderr
    assert list(data) == ["steps", "lookup", "live"]
    assert [r["shared_prefix"] for r in data["steps"]] == [0, 32]
    assert [r["hit_tokens"] for r in data["steps"]] == [0, 5 * 32]
    assert [(r["tokens"], r["hashes"]) for r in data["lookup"]] == [(16, 1), (64, 4)]
    assert [(r["granularity"], r["live_requests"]) for r in data["live"]] == [("token", 10), ("block", 10)]
    assert [r["hit_tokens"] for r in data["live"]] == [6 * 32, 6 * 32]
    assert "manager steps" in res.stderr and "prefix lookup" in res.stderr and "10 live requests" in res.stderr


def test_bench_manager_tables(tmp_path) -> None:
    out = tmp_path / "manager.json"
    res = runner.invoke(app, ["bench", "manager", *TINY, "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "manager steps: 6 requests of 48 prompt + 3 decoded tokens" in res.stdout and f"wrote {out}" in res.stdout
    assert json.loads(out.read_text())["steps"][1]["blocks_allocated"] == 6 * 4 - 5 * 2


def test_bench_manager_rejects_a_shared_prefix_as_long_as_the_prompt() -> None:
    res = runner.invoke(app, ["bench", "manager", "--prompt-tokens", "32", "--shared-prefixes", "32"])
    assert res.exit_code == 2
    assert "--shared-prefixes" in res.output
