"""The KV-cache sweeps of ``kvlab bench sweep --block-sizes / --cliff``: small workloads on the mini model, checked
on counts (slots, tokens, preemptions, steps), never on wall-clock time."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlab.bench.studies.blocksize import block_workload, sweep_block_sizes
from kvlab.bench.studies.cliff import CliffWorkload, by_strategy, find_cliff, sweep_cliff
from kvlab.bench.studies.stepmeter import StepMeter
from kvlab.cli import app
from kvlab.config import CacheConfig, SchedulerConfig
from kvlab.engine.engine import Engine
from kvlab.engine.sampling import SamplingParams
from oracle_cache import mini

runner = CliRunner()


@pytest.fixture(scope="module")
def block_points():
    w = block_workload("short", mini().config.max_position_embeddings, requests=32)
    return sweep_block_sizes(mini(), [w], [8, 16, 32], ["token", "block"])


def test_short_workload_is_short_and_seats_come_in_waves() -> None:
    w = block_workload("short", 512, requests=32)
    lengths = [len(p) + m for p, m in w.requests_of(259)]
    assert max(lengths) < 32 and w.max_num_seqs == 8  # 4 waves, as the 256-request workload's 64 seats
    long = block_workload("long", 512)
    assert long.longest <= 512 and min(len(p) + m for p, m in long.requests_of(259)) > 400
    assert min(len(p) + m for p, m in block_workload("long", 8192).requests_of(49152)) > 512


def test_fragmentation_grows_with_block_size_on_short_sequences(block_points) -> None:
    for g in ("token", "block"):
        pts = sorted((p for p in block_points if p.granularity == g), key=lambda p: p.block_size)
        frags = [p.fragmentation_pct for p in pts]
        assert frags[0] < frags[1] < frags[2], frags
        # The same pool bytes for each block size, nothing preempted or evicted: only the block size differs.
        assert len({p.num_blocks * p.block_size for p in pts}) == 1
        assert all(p.preemptions == 0 and p.evictions == 0 for p in pts)
        assert all(p.output_tokens == pts[0].output_tokens for p in pts)
        # Fewer, larger blocks: fewer handed out and fewer table entries for the runner to walk.
        assert pts[0].block_allocations > pts[1].block_allocations > pts[2].block_allocations
        assert pts[0].table_entries_per_step > pts[1].table_entries_per_step > pts[2].table_entries_per_step


def test_prefix_hits_are_lost_only_to_block_granularity(block_points) -> None:
    token = {p.block_size: p for p in block_points if p.granularity == "token"}
    block = {p.block_size: p for p in block_points if p.granularity == "block"}
    for p in token.values():
        assert p.lost_hit_tokens == 0 and p.prefix_hit_tokens == p.prefix_hit_potential
    assert token[8].prefix_hit_potential > 0
    # The shared instruction is 12 tokens: 8-token blocks keep one whole block of it, 16 and 32 none.
    assert 0 < block[8].lost_hit_tokens < block[8].prefix_hit_potential
    assert block[8].prefix_hit_tokens % 8 == 0
    for bs in (16, 32):
        assert block[bs].prefix_hit_tokens == 0 and block[bs].lost_hit_tokens == block[bs].prefix_hit_potential


def test_step_meter_accounts_for_every_slot_and_token() -> None:
    eng = Engine(mini(), CacheConfig(block_size=8, num_blocks=64), SchedulerConfig(max_num_batched_tokens=16))
    meter = StepMeter(eng, fragmentation=True, prefix_potential=True)
    prompts = [list(range(1, 30)), list(range(1, 20)) + [7, 7, 7]]
    for i, p in enumerate(prompts):
        meter.add(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), f"r{i}")
    while eng.has_unfinished_requests():
        meter.advance()
    for r in meter.records:
        assert r.filled_slots + r.partial_waste_slots + r.reserved_slots == r.allocated_slots
        assert r.decode_tokens + r.prefill_tokens + r.recompute_tokens == r.tokens
    # A 16-token budget chunks the 29-token prompt: its later blocks are held empty for a step.
    assert any(r.reserved_slots for r in meter.records)
    assert meter.total("prefill_tokens") == sum(len(p) for p in prompts) - eng.kv.stats.prefix_cache_hits
    assert meter.total("decode_tokens") == 2 * 4  # 5 outputs each; the last one is never fed back
    assert meter.recomputed_tokens == 0 and meter.total("preemptions") == 0
    t = meter.timings["r0"]
    assert t.output_tokens == 5 and t.ttft_steps == 2 and t.tpot_steps == 1.0  # two prefill chunks, then 1/step


CLIFF = CliffWorkload(shared=32, distinct=(8, 16), output=(16, 24), rounds=2, num_blocks=20)


@pytest.fixture(scope="module")
def cliff_points():
    return sweep_cliff(mini(), CLIFF, [2, 4, 8], ["isolated", "shared-cow"])


def test_preemptions_appear_once_concurrency_passes_what_the_pool_holds(cliff_points) -> None:
    assert CLIFF.pool_holds(False) == 4 and CLIFF.pool_holds(True) == 6
    off = {p.concurrency: p for p in by_strategy(cliff_points)["isolated"]}
    for c in (2, 4):  # the pool holds them all: no preemption, one step per token
        assert off[c].preemptions == 0 and off[c].recomputed_tokens == 0 and off[c].tpot_steps_p99 == 1.0
    assert off[8].preemptions > 0 and off[8].preempted_requests > 0
    assert off[8].recomputed_tokens > 0
    assert off[8].tpot_steps_p99 >= 1.5 and off[8].kv_usage_peak_pct == 100.0
    cliff = find_cliff(list(off.values()))
    assert cliff is not None and cliff.concurrency == 8
    # Per-step attribution adds up to the totals.
    assert sum(r.preemptions for r in off[8].timeline) == off[8].preemptions
    assert sum(r.recompute_tokens for r in off[8].timeline) == off[8].recomputed_tokens


def test_sharing_needs_fewer_preemptions_at_the_same_concurrency(cliff_points) -> None:
    off = {p.concurrency: p for p in by_strategy(cliff_points)["isolated"]}
    on = {p.concurrency: p for p in by_strategy(cliff_points)["shared-cow"]}
    assert on[8].preemptions < off[8].preemptions
    assert on[8].prefix_hit_tokens > 0 and off[8].prefix_hit_tokens == 0
    # Safe strategies give the same greedy tokens, preempted and recomputed or not.
    assert all(p.differing_outputs == 0 for p in on.values())
    assert all(p.requests == c * CLIFF.rounds for c, p in on.items())


def test_unknown_or_batch_changing_strategies_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown strategy"):
        sweep_cliff(mini(), CLIFF, [1], ["nope"])
    with pytest.raises(ValueError, match="not a cliff strategy"):
        sweep_cliff(mini(), CLIFF, [1], ["empty-request"])


def test_sweep_block_sizes_and_cliff_from_the_cli(tmp_path) -> None:
    png, out = tmp_path / "kv.png", tmp_path / "kv.json"
    res = runner.invoke(
        app,
        ["bench", "sweep", "--model", "mini", "--block-sizes", "8,16", "--workload", "short", "--block-requests", "16",
         "--cliff", "--concurrency", "1,2", "--kv-blocks", "20", "--rounds", "1",
         "--strategies", "isolated,shared-cow,shared-no-cow", "--threads", "1", "--plot", str(png), "--json", str(out)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert set(data) == {"block_sizes", "cliff"}
    pts = data["block_sizes"]["points"]
    assert [(p["block_size"], p["granularity"]) for p in pts] == [(b, g) for g in ("token", "block") for b in (8, 16)]
    for key in ("fragmentation_pct", "kv_us_per_step", "prepare_us_per_step", "lost_hit_tokens", "throughput"):
        assert all(key in p for p in pts)
    assert data["block_sizes"]["verdicts"][0].startswith("short")
    cliff = data["cliff"]
    assert set(cliff) >= {"points", "knee", "cliff", "pool_holds", "timeline_at_cliff"}
    assert [(p["strategy"], p["concurrency"]) for p in cliff["points"]] == [
        (s, c) for s in ("isolated", "shared-cow", "shared-no-cow") for c in (1, 2)
    ]
    for key in ("preemptions", "recomputed_tokens", "cow_copies", "evictions", "kv_usage_mean_pct", "tpot_steps_p99"):
        assert all(key in p for p in cliff["points"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--block-sizes", "8,2048"], "block sizes must be in [1, 1024]"),
        (["--block-sizes", "8", "--workload", "medium"], "expected comma-separated workloads"),
        (["--cliff", "--strategies", "isolated,empty-request"], "expected comma-separated strategies"),
    ],
)
def test_bad_sweep_flags_are_refused_before_any_model_loads(args: list[str], error: str) -> None:
    res = runner.invoke(app, ["bench", "sweep", *args])
    assert res.exit_code == 2 and error in " ".join(res.output.split())
