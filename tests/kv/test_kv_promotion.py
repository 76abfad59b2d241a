"""Promotion by popularity (CacheConfig.promote_after = K): a chain K distinct salts computed becomes public.

Before promotion nothing changes for anyone (a lookup under another salt finds nothing); after it, the leading
promoted blocks of any salt's prompt are keyed without salt and shared; the sanitizer counts the salts that wrote
each content on its own and allows a read across salts only where it saw K of them.
"""

from __future__ import annotations

import pytest
from kv_rig import BS, Rig, cfg

from kvlab.config import CacheConfig, ConfigError
from kvlab.instrument.sanitizer import KVSanitizer, Namespace, prefix_digests
from kvlab.kv import Keying, check_invariants
from kvlab.kv.hashing import hash_block
from kvlab.kv.promotion import Popularity

COMMON = list(range(100, 112))  # three full blocks of 4 that several tenants send (not declared public)


def served(rig: Rig, rid: str, prompt: list[int], salt: str) -> int | None:
    """Admit, compute the whole prompt, read it back clean, free: one request as the engine serves it."""
    cached = rig.prefill(rid, prompt, salt)
    assert rig.check(rid) == [] and rig.foreign(rid) == {}
    check_invariants(rig.m)
    rig.free(rid)
    return cached


def test_config_takes_k_of_at_least_two():
    assert CacheConfig().promote_after is None
    assert CacheConfig(promote_after=2).promote_after == 2
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ConfigError, match="promote_after"):
            CacheConfig(promote_after=bad)  # type: ignore[arg-type]


def test_public_keys_are_the_salt_free_chain():
    pop = Popularity(2, 16, BS)
    keys = pop.public_keys(COMMON + [1, 2])  # the partial last block has no key
    want, parent = [], None
    for i in range(3):
        parent = hash_block(parent, COMMON[i * BS : (i + 1) * BS], (), "sha256")
        want.append(parent)
    assert keys == want


def test_counting_distinct_salts_discarding_and_forgetting():
    pop = Popularity(3, 2, BS)
    k1, k2, k3 = pop.public_keys(COMMON)
    for salt in ("a", "a", "b"):  # one salt twice is one tenant
        pop.note("r", salt, k1)
    assert pop.commit() == 0 and not pop.is_promoted(k1)
    pop.note("gone", "c", k1)
    pop.discard("gone")  # freed before the commit: its write never happened
    assert pop.commit() == 0 and not pop.is_promoted(k1)
    pop.note("r", "c", k1)
    assert pop.commit() == 1 and pop.promoted_blocks([k1, k2]) == 1
    pop.note("r", "a", k2)
    pop.note("r", "a", k3)
    pop.commit()  # capacity 2: k1, least recently counted, is forgotten (its blocks private again)
    assert pop.num_tracked() == 2 and not pop.is_promoted(k1) and pop.promoted_blocks([k1, k2]) == 0
    pop.reset()
    assert pop.num_tracked() == 0


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_a_chain_two_salts_computed_is_shared_with_a_third(granularity):
    rig = Rig(cfg(prefix_granularity=granularity, num_blocks=16, promote_after=2))
    m = rig.m
    assert served(rig, "A", COMMON + [1, 2, 3], "a") == 0
    assert m.lookup(COMMON + [9], "b") == 0  # one salt: nothing public, b finds nothing of a's
    assert m.keying_of(COMMON + [9], "b") == Keying("b")
    assert served(rig, "B", COMMON + [4, 5], "b") == 0  # the second salt computes it too: promoted at the commit
    assert m.stats.promotions == 3
    assert m.keying_of(COMMON + [9], "c") == Keying("c", 3)
    assert m.lookup(COMMON + [9], "c") == 0  # a's and b's copies stay private: the next one computes the public one
    assert served(rig, "C", COMMON + [6], "c") == 0
    for rid, salt in (("D", "d"), ("A2", "a")):  # anyone, the first tenant too, now hits the public copy
        assert rig.prefill(rid, COMMON + [7, 8], salt) == 12
    assert m.block_table("D")[:3] == m.block_table("A2")[:3]
    assert [m.index.content(b).namespace for b in m.block_table("D")[:4]] == [None, None, None, "d"]
    assert rig.check("D") == [] and rig.check("A2") == [] and rig.foreign("D") == {}
    assert m.stats.prefix_cache_hits_public == 24
    check_invariants(m)


def test_only_the_blocks_both_computed_are_promoted():
    rig = Rig(cfg(num_blocks=16, promote_after=2))
    served(rig, "A", COMMON + [1], "a")
    served(rig, "B", COMMON[:8] + [50, 51, 52, 53, 2], "b")  # agrees with a on two blocks only
    assert rig.m.keying_of(COMMON + [3], "c") == Keying("c", 2)
    served(rig, "C", COMMON + [3], "c")
    assert rig.prefill("D", COMMON + [4], "d") == 8  # two public blocks; block 2 is d's own
    assert rig.check("D") == []


def test_promotion_goes_on_after_a_declared_public_prefix():
    """Declared public blocks are not counted (public already); the private blocks after them that K salts
    computed are promoted, so they extend the public prefix."""
    rig = Rig(cfg(num_blocks=16, promote_after=2))
    for rid, salt in (("A", "a"), ("B", "b")):
        rig.prefill(rid, COMMON + [1], salt, public=4)
        rig.free(rid)
    assert rig.m.keying_of(COMMON + [1], "c", 4) == Keying("c", 3)
    assert rig.m.keying_of(COMMON + [1], "c") == Keying("c")  # block 0 was never promoted: it was public


def test_generated_and_declared_public_blocks_do_not_count():
    rig = Rig(cfg(num_blocks=16, promote_after=2))
    served(rig, "A", COMMON[:4] + [1], "a")
    rig.prefill("B", COMMON[:4] + [2], "b")
    rig.feed("B", [3, 4, 5])  # fills block 1 with generated tokens: not a prompt block, never counted
    rig.free("B")
    assert rig.m.stats.promotions == 1  # block 0 only
    rig2 = Rig(cfg(num_blocks=16, promote_after=2))
    rig2.prefill("A", COMMON + [1], "a", public=12)  # declared public: computed in the public namespace
    rig2.free("A")
    rig2.prefill("B", COMMON + [1], "b", public=12)
    rig2.free("B")
    assert rig2.m.stats.promotions == 0


def test_a_request_freed_before_its_commit_does_not_count():
    rig = Rig(cfg(num_blocks=16, promote_after=2))
    served(rig, "A", COMMON + [1], "a")
    assert rig.m.allocate("B", COMMON + [1], "b").ok  # its slots handed out, K/V not yet written
    rig.m.free("B")  # a failed forward: the engine frees the batch's requests before the step's commit
    rig.m.commit_writes()
    assert rig.m.stats.promotions == 0


def test_reset_forgets_the_counts():
    rig = Rig(cfg(num_blocks=16, promote_after=2))
    served(rig, "A", COMMON + [1], "a")
    served(rig, "B", COMMON + [1], "b")
    assert rig.m.keying_of(COMMON, "c").public_blocks == 3
    assert rig.m.reset_prefix_cache()
    assert rig.m.keying_of(COMMON, "c") == Keying("c")


def test_the_sanitizer_counts_the_writers_salts_itself():
    """A read across salts is allowed where the shadow saw K salts write that content, caught below K."""
    toks = [5, 6, 7, 8]
    ctx = prefix_digests(toks)
    for k, writers, caught in ((2, ["a"], True), (2, ["a", "b"], False), (3, ["a", "b"], True)):
        san = KVSanitizer(num_blocks=4, block_size=4, promote_after=k)
        for block, salt in enumerate(writers):
            slots = [block * 4 + j for j in range(4)]
            san.record_write(salt, slots, toks, range(4), 1, ctx, Namespace(salt))
        found = san.check_read("c", [0, 1, 2, 3], toks, range(4), 2, ctx, Namespace("c"))
        assert bool(found) == caught and all(v.kind == "cross-tenant" for v in found)


def test_a_lookups_promoted_prefix_equals_the_full_count_and_hashes_less(monkeypatch):
    """promoted_prefix (what a lookup uses) gives promoted_blocks(public_keys(...)) for every start, and stops
    hashing after the first block that is not promoted."""
    import kvlab.kv.promotion as promotion

    pop = Popularity(2, 64, BS)
    prompt = COMMON + [1, 2, 3, 4, 5, 6, 7, 8]  # five full blocks
    keys = pop.public_keys(prompt)
    for salt in ("a", "b"):
        for k in keys[:2]:
            pop.note("r", salt, k)
    pop.commit()  # blocks 0 and 1 promoted
    for start in range(6):
        assert pop.promoted_prefix(prompt, start) == pop.promoted_blocks(keys, start), start
    calls = []
    monkeypatch.setattr(promotion, "hash_block", lambda *a: calls.append(a) or hash_block(*a))
    assert pop.promoted_prefix(prompt) == 2 and len(calls) == 3  # blocks 0, 1 and the first one not promoted
