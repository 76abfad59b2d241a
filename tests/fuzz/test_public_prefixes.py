"""Public prefixes in the fuzzer: drawn last (a seed's earlier draws are as they were, old cases replay), run
on every trial, and judged by the same rule as the KV tests: no read of another salt's K/V outside the
blocks both requests declared public."""

from __future__ import annotations

import dataclasses

import pytest
from fuzz_rig import runner

from kvlab.config import ConfigError
from kvlab.fuzz import CaseMeta, FuzzCase, FuzzConfig, FuzzRequest, draw_case
from kvlab.fuzz import generate as gen
from kvlab.kv import hashing
from kvlab.kv.prefix import PrefixIndex

SYSTEM = (97, 98, 99, 97, 98, 99, 97, 98)  # two blocks of 4


def _stripped(case: FuzzCase) -> FuzzCase:
    return dataclasses.replace(
        case, requests=tuple(dataclasses.replace(r, public_prefix_tokens=0) for r in case.requests)
    )


def test_public_prefixes_are_drawn_last(monkeypatch):
    """Every other draw of a seed is what the builder drew before public prefixes existed: without their
    draws (the builder as it was) the same cases come out, public prefixes aside."""
    monkeypatch.setattr(gen, "_promotion", lambda c: None)  # drawn after them: see the next test
    monkeypatch.setattr(gen, "_speculation", lambda c, always: 0)  # and speculation after promotion
    monkeypatch.setattr(gen, "_cache_dtype", lambda c: "auto")  # and the cache's dtype after speculation
    monkeypatch.setattr(gen, "_precision", lambda c: "fp32")  # and the precision after it
    drawn = [draw_case(CaseMeta(), 4, i) for i in range(30)]
    monkeypatch.setattr(gen, "_public_prefix", lambda c, r, bs: 0)  # draws nothing: the old builder
    for i, d in enumerate(drawn):
        old = draw_case(CaseMeta(), 4, i)
        assert _stripped(d.case) == old.case
        assert d.choices[: len(old.choices)] == old.choices


def test_promotion_is_drawn_last_and_a_case_without_it_reads_as_before(monkeypatch):
    monkeypatch.setattr(gen, "_speculation", lambda c, always: 0)  # drawn after it: see the next test
    monkeypatch.setattr(gen, "_cache_dtype", lambda c: "auto")  # and the cache's dtype after speculation
    monkeypatch.setattr(gen, "_precision", lambda c: "fp32")  # and the precision after it
    drawn = [draw_case(CaseMeta(), 4, i) for i in range(40)]
    assert {d.case.config.promote_after for d in drawn} == {None, 2}
    monkeypatch.setattr(gen, "_promotion", lambda c: None)
    for i, d in enumerate(drawn):
        old = draw_case(CaseMeta(), 4, i)
        assert dataclasses.replace(d.case.config, promote_after=None) == old.case.config
        assert d.choices[: len(old.choices)] == old.choices and len(d.choices) == len(old.choices) + 1
        for new, was in zip(d.case.requests, old.case.requests, strict=True):
            # With promotion every request has a salt (the unsalted take turns): nothing else changes.
            assert dataclasses.replace(new, salt=was.salt) == was
            assert new.salt == was.salt if d.case.config.promote_after is None or was.salt else new.salt
    plain = FuzzCase(FuzzConfig(), (FuzzRequest(SYSTEM, salt="tenant-1"),))
    assert "promote_after" not in plain.to_dict()["config"]  # the JSON (and the digest) of an old case
    promoted = FuzzCase(FuzzConfig(promote_after=2), plain.requests)
    assert FuzzCase.from_dict(promoted.to_dict()) == promoted and promoted.digest() != plain.digest()


def test_speculation_is_drawn_last_and_a_case_without_it_reads_as_before(monkeypatch):
    monkeypatch.setattr(gen, "_cache_dtype", lambda c: "auto")  # drawn after it: see the next test
    monkeypatch.setattr(gen, "_precision", lambda c: "fp32")  # and the precision after that (test_precision.py)
    drawn = [draw_case(CaseMeta(), 4, i) for i in range(40)]
    assert {d.case.config.speculative_tokens for d in drawn} == {0, 2, 4}
    unsafe = [draw_case(CaseMeta(commit_rejected_drafts=True), 4, i).case.config for i in range(10)]
    assert all(c.speculative_tokens in (2, 4) and c.commit_rejected_drafts for c in unsafe)
    monkeypatch.setattr(gen, "_speculation", lambda c, always: 0)
    for i, d in enumerate(drawn):
        old = draw_case(CaseMeta(), 4, i)
        assert dataclasses.replace(d.case, config=dataclasses.replace(d.case.config, speculative_tokens=0)) == old.case
        assert d.choices[: len(old.choices)] == old.choices and len(d.choices) == len(old.choices) + 1
    plain = FuzzCase(FuzzConfig(), (FuzzRequest(SYSTEM),))
    config = plain.to_dict()["config"]
    assert "speculative_tokens" not in config and "commit_rejected_drafts" not in config  # an old case's JSON
    spec = FuzzCase(FuzzConfig(speculative_tokens=2, commit_rejected_drafts=True), plain.requests)
    assert FuzzCase.from_dict(spec.to_dict()) == spec and spec.digest() != plain.digest()
    with pytest.raises(ConfigError, match="needs speculative_tokens > 0"):
        FuzzConfig(commit_rejected_drafts=True)


def test_the_cache_dtype_is_drawn_last(monkeypatch):
    """Every other draw of a seed is what the builder drew before the cache's dtype was drawn (a saved seed's
    trials are the same workloads), and a case over the model's own dtype reads as before (test_case_and_generate)."""
    monkeypatch.setattr(gen, "_precision", lambda c: "fp32")  # drawn after it (test_precision.py)
    drawn = [draw_case(CaseMeta(), 4, i) for i in range(40)]
    assert {d.case.config.kv_cache_dtype for d in drawn} == {"auto", "bfloat16", "fp8", "fp8_e5m2"}
    monkeypatch.setattr(gen, "_cache_dtype", lambda c: "auto")
    for i, d in enumerate(drawn):
        old = draw_case(CaseMeta(), 4, i)
        assert dataclasses.replace(d.case, config=dataclasses.replace(d.case.config, kv_cache_dtype="auto")) == old.case
        assert d.choices[: len(old.choices)] == old.choices and len(d.choices) == len(old.choices) + 1


def test_a_trial_with_promotion_shares_what_both_salts_computed_and_passes():
    prompt = (*SYSTEM, 99, 99, 98, 97, 97)
    reqs = tuple(
        FuzzRequest(prompt, arrival=4 * i, max_tokens=2, salt=salt)
        for i, salt in enumerate(["tenant-1", "tenant-2", "tenant-1", "tenant-2"])
    )
    verdict = runner().run_case(FuzzCase(FuzzConfig(block_size=4, num_blocks=24, promote_after=2), reqs))
    assert verdict.ok, [str(f) for f in verdict.failures]
    assert "promotion" in verdict.coverage


def test_public_prefixes_of_every_kind_are_drawn_and_fit_their_prompt():
    kinds: set[str] = set()
    for i in range(150):
        case = draw_case(CaseMeta(), 0, i).case
        bs = case.config.block_size
        for r in case.requests:
            p = r.public_prefix_tokens
            assert 0 <= p <= len(r.prompt)
            kinds.add(
                "none" if p == 0 else "whole prompt" if p == len(r.prompt) else "blocks" if p % bs == 0 else "partial"
            )
            if r.salt and p >= bs:
                kinds.add("salted")
    assert kinds >= {"none", "whole prompt", "blocks", "partial", "salted"}


def test_cases_without_public_prefixes_read_as_before_and_old_files_replay(tmp_path):
    case = FuzzCase(FuzzConfig(), (FuzzRequest(SYSTEM, salt="tenant-1"),))
    d = case.to_dict()
    assert "public_prefix_tokens" not in d["requests"][0]  # the JSON (and the digest) of an old case
    assert FuzzCase.from_dict(d) == case
    public = FuzzCase(FuzzConfig(), (FuzzRequest(SYSTEM, salt="tenant-1", public_prefix_tokens=5),))
    back = FuzzCase.load(public.save(tmp_path / "p.json"))
    assert back == public and back.digest() == public.digest() != case.digest()
    with pytest.raises(ConfigError, match="public_prefix_tokens"):
        FuzzRequest(SYSTEM, public_prefix_tokens=9)


def _cross_tenant_case() -> FuzzCase:
    # Tenant 2 arrives after tenant 1's request is computed and sends tenant 1's very prompt: it may share the
    # two public blocks (8 tokens), never the private rest.
    prompt = (*SYSTEM, 99, 99, 98, 97, 97)
    reqs = (
        FuzzRequest(prompt, arrival=0, max_tokens=2, salt="tenant-1", public_prefix_tokens=8),
        FuzzRequest(prompt, arrival=4, max_tokens=2, salt="tenant-2", public_prefix_tokens=8),
        FuzzRequest(prompt, arrival=8, max_tokens=2, salt="tenant-2", public_prefix_tokens=13),
    )
    return FuzzCase(FuzzConfig(block_size=4, num_blocks=24), reqs)


def test_a_trial_shares_public_blocks_across_salts_and_passes():
    verdict = runner().run_case(_cross_tenant_case())
    assert verdict.ok, [str(f) for f in verdict.failures]
    assert {"public-hit", "prefix-hit", "salt"} <= verdict.coverage


@pytest.mark.parametrize(
    ("owner", "name", "mutant"),
    [
        # `global` sharing behind per-tenant keys: no block carries a salt.
        pytest.param(hashing.Keying, "extra", lambda self, i: (), id="no-salt-anywhere"),
        # The token-granular path grouping blocks by parent alone: a partial match ignores the salt.
        pytest.param(PrefixIndex, "group_key", lambda self, link: (link.parent_cid, ()), id="trie-ignores-salt"),
    ],
)
def test_a_trial_catches_a_cache_that_shares_private_blocks(monkeypatch, owner, name, mutant):
    monkeypatch.setattr(owner, name, mutant)
    verdict = runner().run_case(_cross_tenant_case())
    assert "cross-tenant" in verdict.kinds, [str(f) for f in verdict.failures]
