"""``kvlab bench tenants`` on a tiny workload: what each policy may share follows from its rules (nothing across
tenants per-tenant, only declared or promoted blocks with public prefixes, everything globally), every policy's
greedy tokens equal the cache-less run's, and the KV sanitizer finds no read across tenants outside public
blocks. Timings are printed, never checked."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlab.bench.studies.tenants import POLICIES, TenantWorkload, bench_tenants, tenant_requests
from kvlab.cli import app
from kvlab.config import ConfigError
from kvlab.model import load_model

W = TenantWorkload(
    tenants=4,
    requests_per_tenant=3,
    system_tokens=(40, 60),
    document_tokens=(20, 30),
    question_tokens=(4, 8),
    max_tokens=4,
    rate=2.0,
    seed=3,  # every tenant uses the undeclared prompt at least once: promotion has something to promote
)


@pytest.fixture(scope="module")
def bench():
    return bench_tenants(load_model("mini"), W, block_size=8, max_num_batched_tokens=64, sanitize=True)


def test_the_workload_is_seeded_and_declares_only_its_declared_prompts():
    reqs = tenant_requests(W, 256)
    assert reqs == tenant_requests(W, 256) and len(reqs) == 12
    assert [r.arrival_step for r in reqs] == sorted(r.arrival_step for r in reqs)
    assert {r.tenant for r in reqs} == {"t0", "t1", "t2", "t3"}
    for r in reqs:
        assert (40 <= r.public_tokens <= 60) if r.system < W.declared else r.public_tokens == 0
        assert r.prompt[: r.public_tokens] == reqs[0].prompt[: r.public_tokens] or r.system != reqs[0].system
    with pytest.raises(ConfigError, match="tenants"):
        TenantWorkload(tenants=1)
    with pytest.raises(ConfigError, match="exceed max_model_len"):
        W.sized(30)
    assert TenantWorkload().sized(512).system_tokens == (200, 512 - 128 - 32 - 16)


def test_each_policy_shares_only_what_its_rules_allow(bench):
    runs = {r.policy: r for r in bench.runs}
    assert tuple(runs) == POLICIES
    reqs = tenant_requests(bench.workload, load_model("mini").config.vocab_size)
    declared_blocks = sum(r.public_tokens // 8 * 8 for r in reqs)
    assert runs["off"].hit_tokens == 0
    assert runs["per-tenant"].public_hit_tokens == 0 and runs["per-tenant"].hit_tokens > 0
    # Public hits lie in declared prompts' full blocks (at most every request's, the first computes them).
    assert 0 < runs["public-prefixes"].public_hit_tokens < declared_blocks
    assert len({r.tenant for r in reqs if r.system >= W.declared}) >= W.promote_after
    assert runs["public+promotion"].promotions > 0
    assert runs["public+promotion"].public_hit_tokens > runs["public-prefixes"].public_hit_tokens
    assert runs["global"].public_hit_tokens == runs["global"].hit_tokens >= runs["public+promotion"].hit_tokens
    assert all(r.promotions == 0 for r in bench.runs if r.policy != "public+promotion")
    for r in bench.runs:
        assert r.violations == 0, r.policy
        assert r.differing_outputs in (None, 0), r.policy
        assert r.hit_tokens + r.computed_tokens == r.prompt_tokens
        assert r.output_tokens == 12 * 4
    rec = bench.recovery("public+promotion")
    assert rec["hit_tokens"] is not None and 0 < rec["hit_tokens"] <= 1


def test_the_command_prints_json_alone_with_json_dash():
    res = CliRunner().invoke(
        app,
        [
            "bench", "tenants", "--tenants", "3", "--requests-per-tenant", "2", "--system-tokens", "20,30",
            "--document-tokens", "8,16", "--question-tokens", "2,4", "--max-tokens", "2",
            "--policies", "per-tenant,public-prefixes", "--json", "-",
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [r["policy"] for r in data["runs"]] == ["per-tenant", "public-prefixes"]
    assert data["recovery"]["public-prefixes"]["hit_tokens"] is None  # no global run to measure against


def test_a_bad_policy_fails_before_the_model_loads(monkeypatch):
    import kvlab.model

    def no_load(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(kvlab.model, "load_model", no_load)
    res = CliRunner().invoke(app, ["bench", "tenants", "--policies", "per-tenant,everyone"])
    assert res.exit_code == 2 and "everyone" in res.output
