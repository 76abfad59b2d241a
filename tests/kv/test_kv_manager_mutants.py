"""KV manager guarantees pinned down by mutation testing (issue 40).

These tests were written against mutants of kvlab.kv.manager that survived the suite: each says what it holds
(a lookup's answer under a salt, the keying a request gets, a fork's table, refcounts and trace events, what a
free leaves cached and whose it is for fair eviction, reset's answer, the stats counters), with exact values.
"""

from __future__ import annotations

import pytest
from kv_rig import Rig, cfg

from kvlab.instrument.trace import Trace, TraceEvent
from kvlab.kv import Keying, KVCacheManager

COMMON = list(range(100, 112))  # three full blocks of 4


# -- lookup and keying ---------------------------------------------------------------------------------------
def test_a_salted_lookup_without_a_declared_public_prefix_is_private_from_block_0() -> None:
    """With one-token blocks, the default public prefix (0 tokens) still makes block 0 the salt's: a salted
    lookup finds nothing of what a salt-free request cached, and its keying has no public block."""
    rig = Rig(cfg(block_size=1))
    rig.prefill("A", [1, 2, 3])  # salt-free: public
    assert rig.m.lookup([1, 2, 3, 4]) == 3
    assert rig.m.lookup([1, 2, 3, 4], "b") == 0
    assert rig.m.keying_of([1, 2, 3, 4], "b") == Keying("b", 0)
    assert rig.m.lookup([1, 2, 3, 4], "b", 2) == 2  # declared: the two public blocks are found


def test_lookup_and_keying_of_an_empty_prompt() -> None:
    m = KVCacheManager(cfg())
    assert m.lookup([]) == 0
    assert m.lookup([], "s") == 0
    assert m.keying_of([], "s") == Keying("s", 0)


def test_an_admission_extends_its_declared_public_prefix_by_the_promoted_blocks_after_it() -> None:
    """Promotion goes on after the declared public blocks at allocate too (not only in keying_of): block 0 is
    declared public (never counted, so never promoted), blocks 1 and 2 were computed by two tenants under their
    salts, so a third tenant declaring block 0 public gets blocks 0 to 2 public."""
    rig = Rig(cfg(num_blocks=16, promote_after=2))
    for rid, salt in (("A", "a"), ("B", "b")):
        rig.prefill(rid, COMMON + [1], salt, public=4)
        rig.free(rid)
    assert rig.m.keying_of(COMMON + [1], "c", 4) == Keying("c", 3)
    assert rig.m.allocate("C", COMMON + [1], "c", num_tokens=0, public_prefix_tokens=4, tenant="c").ok
    assert rig.m.keying("C") == Keying("c", 3)
    assert rig.m.allocate("D", COMMON + [1], "d", num_tokens=0, public_prefix_tokens=0, tenant="d").ok
    assert rig.m.keying("D") == Keying("d", 0)  # block 0 is not promoted: nothing after it is public either


# -- fork ----------------------------------------------------------------------------------------------------
def test_a_fork_shares_every_block_and_traces_each_under_the_child_with_its_parent() -> None:
    trace = Trace()
    rig = Rig(cfg(), trace)
    rig.prefill("A", [1, 2, 3, 4, 5, 6])  # block 0 full, block 1 holds [5, 6]
    trace.step = 7
    assert rig.fork("A", "B") == []  # cow_check="write": nothing copied yet
    assert rig.m.block_table("B") == [0, 1]
    assert [rig.m.refcount(b) for b in (0, 1, 2)] == [2, 2, 1]
    assert rig.m.cow_reserve() == {1: [2]}  # one copy of the shared partial block is due
    assert trace.events[-3:] == [
        TraceEvent(7, "fork", "B", 0, 2, {"parent": "A"}),
        TraceEvent(7, "fork", "B", 1, 2, {"parent": "A"}),
        TraceEvent(7, "alloc", "B", 2, 1, {"purpose": "cow-reserve"}),  # the child's copy target
    ]
    rig.fork("A", "C")
    assert rig.m.stats.forks == 2


def test_fork_without_copy_on_write_is_refused_with_its_reason() -> None:
    m = KVCacheManager(cfg(share_prefix=False, copy_on_write=False))
    assert m.allocate("A", [1, 2, 3]).ok
    with pytest.raises(ValueError) as refused:
        m.fork("A", "B")
    assert str(refused.value) == ("fork without copy_on_write makes both requests write one block; needs unsafe=True")
    assert not m.has_request("B") and m.request_ids() == ["A"]


def test_an_eager_fork_copies_into_its_spare_when_the_pool_is_otherwise_full() -> None:
    """cow_check="allocate": the fork sets the last free block aside as the copy target of the shared partial
    block, then copies into it at once, though no other block is free."""
    rig = Rig(cfg(num_blocks=3, cow_check="allocate"))
    rig.prefill("A", [1, 2, 3, 4, 5, 6])
    assert rig.fork("A", "B") == [(1, 2)]
    assert rig.m.block_table("B") == [0, 2]
    assert [rig.m.refcount(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert rig.m.num_free_blocks() == 0 and rig.m.cow_reserve() == {}
    assert rig.m.stats.cow_copies_eager == 1
    assert rig.feed("B", [7]) is not None and rig.m.block_table("B") == [0, 2]


def test_unneeded_eager_copies_add_up_over_frees() -> None:
    rig = Rig(cfg(cow_check="allocate"))
    rig.prefill("A", [1, 2, 3, 4, 5, 6])
    assert len(rig.fork("A", "B")) == 1
    assert len(rig.fork("A", "C")) == 1
    rig.free("B")
    assert rig.m.stats.cow_copies_unneeded == 1
    rig.free("C")
    assert rig.m.stats.cow_copies_unneeded == 2
    rig.free("A")  # A made no eager copy
    assert rig.m.stats.cow_copies_unneeded == 2
    assert rig.m.stats.cow_copies_eager == 2


# -- free: what stays cached, and whose it is ---------------------------------------------------------------
def test_a_freed_cached_block_belongs_to_the_tenant_that_let_go_of_it() -> None:
    """Fair eviction weighs owners: the blocks a request frees are its tenant's, and the busiest owner's
    least recently freed block is evicted first."""
    rig = Rig(cfg(num_blocks=3, eviction="fair"))
    rig.prefill("B", [9, 9, 9, 9], "sb", tenant="b")
    rig.prefill("A", [1, 2, 3, 4, 5, 6, 7, 8], "sa", tenant="a")
    assert rig.m.block_table("A") == [1, 2]
    rig.free("B")
    rig.free("A")
    assert rig.m.pool.owners() == {"a": 2, "b": 1}
    assert rig.m.num_evictable_blocks() == 3
    # a holds the most: its least recently freed block (its last, freed first) goes first; then a tie, and b's
    # block is the older. With one owner it would be the LRU order [0, 2, 1].
    assert rig.m.free_order() == [2, 0, 1]


def test_a_fork_belongs_to_its_parents_tenant() -> None:
    rig = Rig(cfg(eviction="fair"))
    rig.prefill("A", [1, 2, 3, 4, 5, 6, 7, 8], "s", tenant="t")
    rig.fork("A", "B")
    rig.free("A")
    rig.free("B")  # the child lets go of the blocks last
    assert rig.m.pool.owners() == {"t": 2}


def test_free_of_an_unknown_request_names_it() -> None:
    m = KVCacheManager(cfg())
    with pytest.raises(KeyError, match="unknown request 'nobody'"):
        m.free("nobody")
    with pytest.raises(KeyError, match="unknown request 'nobody'"):
        m.block_table("nobody")


def test_without_a_prefix_cache_a_freed_block_is_handed_out_next() -> None:
    m = KVCacheManager(cfg(share_prefix=False))
    assert m.allocate("A", [1, 2, 3, 4, 5, 6]).ok
    assert m.allocate("B", [7]).ok
    assert m.block_table("A") == [0, 1] and m.block_table("B") == [2]
    m.free("A")
    assert m.free_order() == [0, 1, 3, 4, 5, 6, 7, 8, 9]
    assert m.num_evictable_blocks() == 0
    assert m.allocate("C", [1, 2, 3, 4, 5]).ok
    assert m.block_table("C") == [0, 1]


def test_free_keeps_the_prompt_findable_and_counts_it_evictable() -> None:
    rig = Rig(cfg())
    rig.prefill("A", list(range(10)))  # two full blocks and [8, 9]
    rig.free("A")
    assert rig.m.num_free_blocks() == 10
    assert rig.m.num_evictable_blocks() == 3
    assert [rig.m.is_cached(b) for b in range(4)] == [True, True, True, False]
    assert rig.m.lookup(list(range(12))) == 10
    assert rig.m.stats.frees == 1


# -- unsafe reference_counting=False: the copy-on-write release --------------------------------------------
def test_without_reference_counts_a_copy_on_write_still_lets_go_of_the_shared_block() -> None:
    rig = Rig(cfg(reference_counting=False, unsafe=True))
    rig.prefill("A", [1, 2, 3, 4, 5, 6])
    rig.fork("A", "B")
    assert [rig.m.refcount(b) for b in (0, 1)] == [2, 2]
    assert rig.m.cow_reserve() == {}  # no copy is promised without reference counts: nothing set aside
    alloc = rig.feed("B", [7])
    assert alloc is not None and alloc.copies == [(1, 2)]
    assert rig.m.block_table("B") == [0, 2]
    assert [rig.m.refcount(b) for b in (0, 1, 2)] == [2, 1, 1]


def test_without_reference_counts_a_stale_table_copying_away_from_a_released_block_is_tolerated() -> None:
    """A's free releases the block B and C still hold (reference_counting=False); B writes into it in place,
    and C, whose next token differs, copies its slots away from it: letting go of a block that is free already
    is tolerated like a second free."""
    rig = Rig(cfg(reference_counting=False, unsafe=True))
    rig.prefill("A", [1, 2])
    assert rig.m.allocate("E", [9], num_tokens=0).ok  # block 1, never written
    rig.fork("A", "B")
    rig.fork("A", "C")
    rig.free("A")
    rig.m.free("E")
    assert rig.m.refcount(0) == 0 and rig.m.free_order()[:2] == [1, 0]
    rig.feed("B", [3])  # in place, into the free block 0
    alloc = rig.feed("C", [4])
    assert alloc is not None and alloc.copies == [(0, 1)]
    assert rig.m.block_table("B") == [0] and rig.m.block_table("C") == [1]
    assert [rig.m.refcount(b) for b in (0, 1)] == [0, 1]


# -- reset ---------------------------------------------------------------------------------------------------
def test_reset_is_refused_while_blocks_are_held_and_counts_each_reset() -> None:
    trace = Trace()
    rig = Rig(cfg(), trace)
    rig.prefill("A", list(range(9)))
    assert rig.m.reset_prefix_cache() is False
    assert rig.m.stats.resets == 0 and trace.select(op="reset") == []
    rig.free("A")
    assert rig.m.reset_prefix_cache() is True
    assert rig.m.lookup(list(range(9))) == 0 and rig.m.num_evictable_blocks() == 0
    assert rig.m.reset_prefix_cache() is True
    assert rig.m.stats.resets == 2
    assert len(trace.select(op="reset")) == 2


# -- the trace and the stats of taking blocks ----------------------------------------------------------------
def test_a_block_taken_from_the_cache_is_traced_as_evicted_then_allocated_to_the_taker() -> None:
    trace = Trace()
    rig = Rig(cfg(num_blocks=2), trace)
    rig.prefill("A", [1, 2, 3, 4, 5])
    assert [e for e in trace.events if e.op == "alloc"] == [
        TraceEvent(0, "alloc", "A", 0, 1, {"purpose": "table"}),
        TraceEvent(0, "alloc", "A", 1, 1, {"purpose": "table"}),
    ]
    rig.free("A")
    trace.step = 2
    rig.prefill("B", [7, 7, 7, 7, 7, 7, 7, 7])
    assert [e for e in trace.events if e.op in ("alloc", "evict")][2:] == [
        TraceEvent(2, "evict", "B", 1, 0, {}),  # A's tail was freed first: the least recently used
        TraceEvent(2, "alloc", "B", 1, 1, {"purpose": "table"}),
        TraceEvent(2, "evict", "B", 0, 0, {}),
        TraceEvent(2, "alloc", "B", 0, 1, {"purpose": "table"}),
    ]
    s = rig.m.stats
    assert (s.allocations, s.evictions, s.peak_refcount) == (4, 2, 1)  # nothing was ever shared


def test_copy_bytes_are_the_storages_block_bytes_and_zero_without_storage() -> None:
    m = KVCacheManager(cfg())
    assert m.allocate("A", [1, 2, 3, 4, 5, 6]).ok
    m.commit_writes()
    m.fork("A", "B")
    assert m.append_slots("B", [7]).copies == [(1, 2)]
    assert (m.stats.cow_copies, m.stats.cow_bytes) == (1, 0)
    rig = Rig(cfg())
    rig.prefill("A", [1, 2, 3, 4, 5, 6])
    rig.fork("A", "B")
    rig.feed("B", [7])
    assert rig.storage.block_nbytes > 0
    assert (rig.m.stats.cow_copies, rig.m.stats.cow_bytes) == (1, rig.storage.block_nbytes)


def test_a_colliding_key_is_verified_against_the_tokens_unless_told_not_to() -> None:
    """hash_algo="weak" is order-blind: [2, 1, 3, 4] has the key of [1, 2, 3, 4]. verify_tokens (the default)
    compares the tokens, so the collision finds nothing; only verify_tokens=False trusts the key."""
    for verify, hit in ((True, 0), (False, 4)):
        rig = Rig(cfg(hash_algo="weak", verify_tokens=verify, unsafe=True))
        assert (rig.m.num_blocks, rig.m.block_size) == (10, 4)
        rig.prefill("A", [1, 2, 3, 4, 5])
        assert rig.m.lookup([1, 2, 3, 4, 5]) == 4
        assert rig.m.lookup([2, 1, 3, 4, 5]) == hit, verify


def test_promotion_hashes_a_lookup_only_up_to_the_first_block_not_promoted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler looks a waiting prompt up several times per admission, so a lookup (and keying_of) hashes
    the public chain only as far as the promoted prefix reaches; an admission hashes each full block's public
    key once (it notes them all) and counts the promoted ones from those keys."""
    import kvlab.kv.promotion as promotion

    rig = Rig(cfg(num_blocks=32, promote_after=2))
    for rid, salt in (("A", "a"), ("B", "b")):
        rig.prefill(rid, COMMON + [1], salt)
        rig.free(rid)
    prompt = COMMON[:8] + list(range(200, 216)) + [1]  # six full blocks: 0 and 1 promoted, 2 not
    calls: list[tuple] = []
    real = promotion.hash_block
    monkeypatch.setattr(promotion, "hash_block", lambda *a: calls.append(a) or real(*a))
    assert rig.m.lookup(prompt, "c") == 0  # promoted, but nobody has computed the public copy yet
    assert len(calls) == 3  # blocks 0, 1 and the first one not promoted
    assert rig.m.keying_of(prompt, "c") == Keying("c", 2)
    assert len(calls) == 6
    calls.clear()
    assert rig.m.allocate("C", prompt, "c", num_tokens=0, tenant="c").ok
    assert rig.m.keying("C") == Keying("c", 2)
    assert len(calls) == 6  # one public key per full block, none hashed twice
