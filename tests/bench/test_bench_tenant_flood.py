"""``kvlab bench tenants --flood`` on a small pool: a flooding tenant evicts the victim's cached document under
LRU eviction and its own stale prompts under fair eviction; the victim's greedy tokens are the same alone and
beside the flood under both; the watcher's verdict is computed from its own hit counts. Counts only (engine steps,
cached tokens), never time."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlab.bench.studies.tenant_flood import FloodWorkload, WatchRun, bench_flood
from kvlab.cli import app
from kvlab.config import ConfigError
from kvlab.model import load_model

W = FloodWorkload(victim_requests=6, rounds=12, attacker_shares=(1.0,))


@pytest.fixture(scope="module")
def bench():
    return bench_flood(load_model("mini"), W)


def test_a_flood_evicts_the_victims_cache_under_lru_and_not_under_fair(bench):
    alone, lru, fair = bench.floods
    assert (alone.eviction, lru.eviction, fair.eviction) == ("alone", "lru", "fair")
    whole = W.document_tokens // W.block_size * W.block_size * (W.victim_requests - 1)
    assert alone.reusable_tokens == whole and alone.victim_hit_tokens >= whole  # alone: every document hits
    assert lru.victim_hit_tokens < whole // 2  # the flood takes the victim's document before it comes back
    assert fair.victim_hit_tokens == alone.victim_hit_tokens  # the flooder pays for its own flood
    assert lru.flood_requests > 0 and fair.flood_requests > 0 and lru.evictions > 0
    assert bench.differing() == []  # eviction changes what is recomputed, never a token


def test_the_watcher_tells_the_victims_activity_under_lru_at_a_full_pool(bench):
    lru, fair = bench.watches
    assert (lru.eviction, fair.eviction) == ("lru", "fair")
    assert sum(lru.active) not in (0, len(lru.active))  # both kinds of round were drawn
    assert lru.auc == 1.0  # every active round evicted some of the watcher's oldest prompt, no idle one did
    assert fair.auc is not None and fair.auc < 0.8  # it is the biggest holder: its own flush evicts itself


def test_the_auc_counts_ties_half():
    assert WatchRun("lru", 1.0, (True, False), (0, 175)).auc == 1.0
    assert WatchRun("lru", 1.0, (True, False, True, False), (5, 5, 5, 5)).auc == 0.5
    assert WatchRun("lru", 1.0, (True, True), (1, 2)).auc is None  # no idle round: nothing to compare


def test_a_workload_that_does_not_fit_is_refused():
    with pytest.raises(ConfigError, match="attacker_shares"):
        FloodWorkload(attacker_shares=(1.5,))
    with pytest.raises(ConfigError, match="does not fit"):
        bench_flood(load_model("mini"), FloodWorkload(flood_prompt_tokens=600))


def test_the_command_prints_json_alone_with_json_dash(monkeypatch):
    import kvlab.bench.studies.tenant_flood as flood

    real = flood.FloodWorkload
    monkeypatch.setattr(
        flood, "FloodWorkload", lambda seed: real(victim_requests=3, rounds=4, attacker_shares=(1.0,), seed=seed)
    )
    res = CliRunner().invoke(app, ["bench", "tenants", "--flood", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [f["eviction"] for f in data["floods"]] == ["alone", "lru", "fair"] and data["differing_outputs"] == []
