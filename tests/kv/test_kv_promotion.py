"""Promotion by popularity (CacheConfig.promote_after = K): a chain K distinct tenants computed becomes public.

Before promotion nothing changes for anyone (a lookup under another salt finds nothing); after it, the leading
promoted blocks of any salt's prompt are keyed without salt and shared; the sanitizer counts the tenants that
wrote each content on its own and allows a read across salts only where it saw K of them. The parties are
tenants, never salts: a tenant chooses its salts freely, so its salts together are one party. (The rig's
requests are each their salt's tenant unless a test names the tenant.)
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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


def test_counting_distinct_tenants_discarding_and_forgetting():
    pop = Popularity(3, 2, BS)
    k1, k2, k3 = pop.public_keys(COMMON)
    for tenant in ("a", "a", "b"):  # one tenant twice is one party
        pop.note("r", tenant, k1)
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


def test_the_sanitizer_counts_the_writers_tenants_itself():
    """A read across salts is allowed where the shadow saw K tenants write that content, caught below K; two
    salts of one tenant are one writer."""
    toks = [5, 6, 7, 8]
    ctx = prefix_digests(toks)
    cases = (
        (2, [("a", "A")], True),
        (2, [("a", "A"), ("b", "B")], False),
        (3, [("a", "A"), ("b", "B")], True),
        (2, [("a1", "A"), ("a2", "A")], True),  # one tenant under two salts
        (2, [("a1", "A"), ("a2", "A"), ("b", "B")], False),
        (2, [("a", None), ("b", None)], True),  # the default tenant is one tenant too
    )
    for k, writers, caught in cases:
        san = KVSanitizer(num_blocks=4, block_size=4, promote_after=k)
        for block, (salt, tenant) in enumerate(writers):
            slots = [block * 4 + j for j in range(4)]
            san.record_write(salt, slots, toks, range(4), 1, ctx, Namespace(salt, 0, tenant))
        found = san.check_read("c", [0, 1, 2, 3], toks, range(4), 2, ctx, Namespace("c", 0, "C"))
        assert bool(found) == caught and all(v.kind == "cross-tenant" for v in found), (k, writers)


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


# -- the parties are tenants -------------------------------------------------------------------------------
SECRET = COMMON + [20, 21, 22, 23, 24]  # alice's private prompt: three full blocks and a tail
WRONG = [13, 12, 11, 10] + COMMON[4:] + [20, 21, 22, 23, 24]  # a guess that differs in the first block


def guess_under_salts(guess: list[int], k: int, alice_sent: bool) -> list[int | None]:
    """The issue's reproducer at the manager: alice maybe sends her prompt, then bob (one tenant) sends a
    guess under K - 1 salts and the first one again (s1, s2, s1 for K = 3): counted as salts, alice and bob's
    salts would be K parties. What bob reads is the cached tokens of each send."""
    rig = Rig(cfg(num_blocks=64, promote_after=k))
    if alice_sent:
        served(rig, "alice", SECRET, "alice")
    seen = []
    for i, salt in enumerate([f"bob/s{j}" for j in range(1, k)] + ["bob/s1"]):
        seen.append(rig.prefill(f"bob{i}", guess, salt, tenant="bob"))
        assert rig.check(f"bob{i}") == [] and rig.crossed(f"bob{i}") == {}
        rig.free(f"bob{i}")
    check_invariants(rig.m)
    assert rig.m.stats.promotions == 0  # bob's salts are one party: with alice, two of K
    return seen


@pytest.mark.parametrize("k", [3, 5])
def test_one_tenant_under_many_salts_learns_nothing_of_a_guess(k):
    """Defect (issue: promotion counted salts): bob, one API key, sending a guess under salts s1, s2, s1 (K = 3)
    read 0/0/0 when alice had sent it (promoted by alice + two of bob's salts) and 0/0/16 when not; K = 5 with
    four salts likewise."""
    right = guess_under_salts(SECRET, k, alice_sent=True)
    assert right == guess_under_salts(SECRET, k, alice_sent=False) == [0] * (k - 1) + [16]  # bob's own s1 copy
    assert guess_under_salts(WRONG, k, alice_sent=True) == right


def test_one_tenant_alone_promotes_nothing_whatever_its_salts():
    """Planting: a tenant cannot make a guess public on its own and then watch for someone else's send of it."""
    rig = Rig(cfg(num_blocks=64, promote_after=2))
    for i in range(6):
        rig.prefill(f"m{i}", SECRET, f"mallory/{i}", tenant="mallory")
        rig.free(f"m{i}")
    assert rig.m.stats.promotions == 0 and rig.m.keying_of(SECRET, "victim").public_blocks == 0
    assert rig.prefill("victim", SECRET, "victim") == 0  # nothing of mallory's is findable by the victim


def test_the_default_tenant_is_one_party():
    """Requests added without a tenant (the library's default, a key-less server's anonymous clients) are one
    tenant, whatever salts they carry."""
    rig = Rig(cfg(num_blocks=64, promote_after=2))
    for salt in ("x", "y", "z"):
        rig.prefill(salt, SECRET, salt, tenant=None)
        rig.free(salt)
    assert rig.m.stats.promotions == 0
    rig.prefill("other", SECRET, "w", tenant="w")
    rig.free("other")
    assert rig.m.stats.promotions == 4  # its four full blocks: the default tenant and "w" are two parties


def test_a_fork_keeps_its_parents_tenant():
    rig = Rig(cfg(num_blocks=64, promote_after=2))
    rig.admit("p", SECRET, "s", tenant="T")
    rig.fork("p", "c")
    rig.feed("c", SECRET)  # the child computes the prompt: still tenant T, one party
    rig.free("c")
    rig.free("p")
    rig.prefill("T2", SECRET, "s2", tenant="T")
    rig.free("T2")
    assert rig.m.stats.promotions == 0


GUESSES = [SECRET, WRONG, SECRET[:8] + [30, 31, 32], [*SECRET, 40, 41, 42, 43]]
DECOY = [50, 51, 52, 53] * 4 + [54]  # what the victim sends in the other world: shares nothing with a guess


def attacker_view(k: int, granularity: str, sends: list[tuple[int, int, int]], victim_at: int, victim: list[int]):
    """What the attacker's tenants read (cached tokens of each send) when the victim, one tenant under two
    salts, sends ``victim`` twice before send ``victim_at``."""
    rig = Rig(cfg(num_blocks=256, prefix_granularity=granularity, promote_after=k))
    seen = []
    for i, (who, salt, guess) in enumerate(sends):
        if i == victim_at:
            for j in range(2):
                rig.prefill(f"v{j}", victim, f"v/{j}", tenant="v")
                rig.free(f"v{j}")
        rid = f"a{i}"
        seen.append(rig.prefill(rid, GUESSES[guess], f"att{who}/{salt}", tenant=f"att{who}"))
        assert rig.check(rid) == [] and rig.crossed(rid) == {}
        rig.free(rid)
    assert rig.m.stats.evictions == 0  # the pool holds everything: eviction is another channel (pool fairness)
    return seen


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(3, 5),
    granularity=st.sampled_from(["block", "token"]),
    data=st.data(),
)
def test_fewer_than_k_minus_one_tenants_learn_nothing_from_any_sends(k, granularity, data):
    """The README's guarantee: an attacker holding a < K - 1 tenants (API keys), sending guesses under any
    salts in any order, reads the same cached tokens whether the victim sent the right guess or not."""
    a = data.draw(st.integers(1, k - 2), label="attacker tenants")
    sends = data.draw(
        st.lists(
            st.tuples(st.integers(0, a - 1), st.integers(0, 3), st.integers(0, len(GUESSES) - 1)),
            min_size=1,
            max_size=12,
        ),
        label="sends (tenant, salt, guess)",
    )
    victim_at = data.draw(st.integers(0, len(sends) - 1), label="victim sends before")
    assert attacker_view(k, granularity, sends, victim_at, SECRET) == attacker_view(
        k, granularity, sends, victim_at, DECOY
    )


@pytest.mark.parametrize("k", [2, 3, 4])
def test_k_minus_one_tenants_can_tell_as_the_readme_says(k):
    """The control: with K - 1 tenants the same kind of sends does tell (the threat model's membership test),
    so the property above is not true for want of a channel."""
    sends = [(who, 0, 0) for who in range(k - 1)] + [(0, 0, 0)]
    right = attacker_view(k, "token", sends, 0, SECRET)
    wrong = attacker_view(k, "token", sends, 0, DECOY)
    assert right != wrong and right[-1] == 0 and wrong[-1] == 16  # promoted: the last send misses its own copy


def test_popularity_is_validated_and_counts_its_promotions():
    for k, capacity in ((1, 1), (2, 0), (0, 5)):
        with pytest.raises(ValueError, match=f"promote_after >= 2 and capacity >= 1, got {k}, {capacity}"):
            Popularity(k, capacity, BS)
    pop = Popularity(2, 1, BS)  # the smallest table
    assert pop.promotions == 0 and pop.promoted_prefix(COMMON) == 0  # nothing promoted: 0, from block 0
    k1, k2, _ = pop.public_keys(COMMON)
    for tenant in ("a", "b"):
        pop.note("r", tenant, k1)
    assert pop.commit() == 1 and pop.promotions == 1
    pop.note("r", "a", k1)  # a note for a promoted key refreshes it and does not stop the request's other notes
    pop.note("r", "a", k2)
    pop.note("s", "b", k2)
    assert pop.commit() == 1 and pop.promotions == 2  # counted over commits
    assert pop.is_promoted(k2) and not pop.is_promoted(k1)  # capacity 1: k1, less recently used, forgotten


def test_a_promoted_key_noted_again_is_kept_over_a_less_recent_one():
    pop = Popularity(2, 2, BS)
    k1, k2, k3 = pop.public_keys(COMMON)
    for key in (k1, k2):
        for tenant in ("a", "b"):
            pop.note("r", tenant, key)
    pop.commit()  # both promoted; k1 noted first, so less recently counted
    pop.note("r", "c", k1)  # k1 computed again by someone: most recently counted now
    pop.commit()
    pop.note("r", "a", k3)  # a third key: the least recently counted one goes
    pop.commit()
    assert pop.is_promoted(k1) and not pop.is_promoted(k2)
