"""Copy-on-write: a block held by several tables is copied before anyone writes into it."""

from __future__ import annotations

import pytest
from kv_rig import BS, Rig, cfg, clean

from kvlab.config import CacheConfig
from kvlab.instrument.trace import Trace


def test_second_requests_write_copies_the_shared_partial_block_and_both_stay_intact():
    trace = Trace()
    rig = Rig(cfg(), trace)
    a = [10, 11, 12, 13, 14, 15]  # block 0 full, block 1 holds [14, 15]
    rig.prefill("A", a)
    assert rig.admit("B", [*a, 60]) == 6
    shared = rig.m.block_table("A")[1]
    assert rig.m.block_table("B")[1] == shared
    assert rig.m.refcount(shared) == 2
    alloc = rig.feed("B", [60])
    new = rig.m.block_table("B")[1]
    assert new != shared
    assert alloc.copies == [(shared, new)]
    assert alloc.slots == [new * BS + 2]
    assert rig.m.refcount(shared) == 1 and rig.m.refcount(new) == 1
    [cow] = trace.select(op="cow")
    assert (cow.request, cow.block, cow.detail) == ("B", new, {"src": shared, "slots": 2})
    # The owner keeps writing into its block in place: it is the only holder now.
    assert rig.feed("A", [16]).copies == []
    assert rig.m.block_table("A")[1] == shared
    clean(rig, "A", "B")

    rig.free("A")  # the first owner leaves first
    rig.feed("B", [61, 62])
    clean(rig, "B")
    assert rig.m.stats.cow_copies == 1


def test_when_the_owner_writes_first_the_owner_copies():
    rig = Rig(cfg())
    a = [10, 11, 12, 13, 14, 15]
    rig.prefill("A", a)
    rig.admit("B", [*a, 60])
    shared = rig.m.block_table("A")[1]
    alloc = rig.feed("A", [16])
    assert alloc.copies == [(shared, rig.m.block_table("A")[1])]
    assert rig.feed("B", [60]).copies == []  # B is alone in the block now and writes in place
    assert rig.m.block_table("B")[1] == shared
    clean(rig, "A", "B")


@pytest.mark.parametrize("first_writer", ["A", "B"])
def test_an_admitted_prompt_gets_its_copy_on_write_block_even_when_the_pool_is_full(first_writer):
    rig = Rig(cfg(num_blocks=6))
    a = [10, 11, 12, 13, 14, 15]
    rig.prefill("A", a)  # 2 blocks
    assert rig.admit("B", [*a, 60, 61]) == 6  # shares both; one block is set aside for the copy
    assert sum(len(s) for s in rig.m.cow_reserve().values()) == 1
    assert rig.prefill("C", list(range(100, 112))) == 0  # takes the 3 remaining blocks
    assert rig.m.num_free_blocks() == 0
    first, second = (["A", [16]], ["B", [60, 61]]) if first_writer == "A" else (["B", [60, 61]], ["A", [16]])
    assert rig.feed(*first) is not None
    assert rig.feed(*second) is not None
    assert rig.m.cow_reserve() == {}
    clean(rig, "A", "B", "C")
    # Decode past the block boundary has nothing reserved: it waits for a free block.
    assert not rig.m.append_slots("A", [17, 18]).ok


def test_a_later_full_block_hit_sets_aside_the_copy_an_earlier_partial_viewer_will_need():
    rig = Rig(cfg(num_blocks=6))
    a = list(range(8))
    rig.prefill("A", a)  # two full blocks
    rig.free("A")
    assert rig.admit("B", [0, 1, 2, 3, 4, 5]) == 5  # revives block 1, viewing 1 of its slots
    assert rig.m.cow_reserve() == {}
    assert rig.admit("C", [*a, 9]) == 8  # reads all of block 1, which B is about to write into
    assert rig.m.cow_reserve() == {1: [rig.m.cow_reserve()[1][0]]}
    assert rig.prefill("D", list(range(100, 108))) == 0  # the pool is now full
    assert rig.m.num_free_blocks() == 0
    assert rig.feed("B", [5]).copies == [(1, rig.m.block_table("B")[1])]
    assert rig.feed("C", [9]) is not None
    clean(rig, "B", "C", "D")


def test_a_partial_hit_that_goes_on_differently_is_copied_at_admission_and_the_cache_survives():
    rig = Rig(cfg(num_blocks=6))
    a = list(range(8))
    rig.prefill("A", a)  # two full blocks
    rig.free("A")
    alloc = rig.m.allocate("B", [0, 1, 2, 3, 4, 5, 70, 71], num_tokens=0)
    assert alloc.num_cached_tokens == 6
    assert alloc.copies == [(1, rig.m.block_table("B")[1])]  # block 1 is copied, not written in place
    rig.storage.copy_blocks(alloc.copies)
    rig.san.copy_blocks(alloc.copies)
    rig.tokens["B"] = [0, 1, 2, 3, 4, 5]
    assert rig.m.refcount(1) == 0 and rig.m.is_cached(1)
    assert rig.feed("B", [70, 71]).copies == []
    clean(rig, "B")
    assert rig.m.lookup([*a, 9]) == 8  # A's whole context is still findable
    assert rig.prefill("C", [*a, 9]) == 8
    clean(rig, "B", "C")


def test_reserve_is_returned_when_no_copy_is_needed():
    rig = Rig(cfg())
    a = [10, 11, 12, 13, 14, 15]
    rig.prefill("A", a)
    rig.admit("B", [*a, 60])
    free_before = rig.m.num_free_blocks()
    rig.free("A")  # B is now the block's only holder: the reserved copy target goes back at once
    assert rig.m.cow_reserve() == {}
    assert rig.m.num_free_blocks() == free_before + 1  # the spare; A's own blocks are still shared
    assert rig.feed("B", [60]).copies == []
    clean(rig, "B")


def test_fork_shares_every_block_including_the_partial_one():
    trace = Trace()
    rig = Rig(cfg(), trace)
    rig.prefill("P", [1, 2, 3, 4, 5, 6])
    rig.fork("P", "C")
    assert rig.m.block_table("C") == rig.m.block_table("P")
    assert [rig.m.refcount(b) for b in rig.m.block_table("P")] == [2, 2]
    assert [e.refcount for e in trace.select(op="fork")] == [2, 2]
    assert rig.m.num_computed_tokens("C") == 6
    rig.feed("P", [7])
    rig.feed("C", [8])
    rig.feed("C", [9, 10])  # crosses into a new block of its own
    rig.feed("P", [11])
    assert rig.m.stats.cow_copies == 1
    assert rig.m.refcount(rig.m.block_table("P")[0]) == 2  # the full block stays shared
    clean(rig, "P", "C")
    rig.free("P")
    clean(rig, "C")


def test_fork_at_a_block_boundary_needs_no_copy():
    rig = Rig(cfg())
    rig.prefill("P", list(range(8)))
    rig.fork("P", "C")
    assert rig.feed("P", [100]).copies == []
    assert rig.feed("C", [200]).copies == []
    assert rig.m.stats.cow_copies == 0
    clean(rig, "P", "C")


def test_fork_of_reserved_blocks_swaps_without_copying():
    rig = Rig(cfg())
    prompt = list(range(10))
    rig.admit("P", prompt)
    rig.feed("P", prompt[:3])  # mid-prefill: block 0 partial, blocks 1 and 2 reserved
    rig.fork("P", "C")
    alloc = rig.feed("C", prompt[3:10])
    # block 0 is copied (3 slots kept); reserved blocks 1 and 2 are empty, so they are replaced, not copied
    assert len(alloc.copies) == 1
    assert set(rig.m.block_table("C")).isdisjoint(rig.m.block_table("P"))
    rig.feed("P", prompt[3:10])
    clean(rig, "P", "C")


def test_fork_without_copy_on_write_is_refused_in_a_safe_config():
    rig = Rig(CacheConfig(block_size=BS, num_blocks=10, share_prefix=False, copy_on_write=False))
    rig.prefill("P", [1, 2, 3])
    with pytest.raises(ValueError, match="copy_on_write"):
        rig.m.fork("P", "C")
