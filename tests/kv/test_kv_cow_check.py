"""``CacheConfig.cow_check``: copy-on-write decided at the write (the default) or at allocation.

"allocate" copies, at allocate() or fork(), every shared block the request will write into: the partial last
block of a prefix hit, or the frontier block a fork shares. The copy is made whether the write comes or not,
and a copy whose request is freed before writing into it is counted as not needed.
"""

from __future__ import annotations

import pytest
from kv_rig import BS, NUM_LAYERS, Rig, cfg, clean

from kvlab.config import CacheConfig, ConfigError
from kvlab.kv import AllocFailure, KVCacheManager

A = [10, 11, 12, 13, 14, 15]  # block 0 full, block 1 holds [14, 15]
MODES = ["write", "allocate"]


def test_cow_check_is_validated_like_the_other_choices() -> None:
    assert CacheConfig().cow_check == "write"
    with pytest.raises(ConfigError, match=r"CacheConfig.cow_check must be one of \['write', 'allocate'\], got 'read'"):
        CacheConfig(cow_check="read")


def test_an_aborted_requests_eager_copy_counts_as_not_needed() -> None:
    rig = Rig(cfg(cow_check="allocate"))
    rig.prefill("A", A)
    shared = rig.m.block_table("A")[1]
    alloc = rig.m.allocate("B", [*A, 60], num_tokens=0)  # admitted, no slot handed out yet
    own = rig.m.block_table("B")[1]
    assert alloc.copies == [(shared, own)] and own != shared
    rig.storage.copy_blocks(alloc.copies)
    rig.san.copy_blocks(alloc.copies)
    rig.tokens["B"] = list(A)
    assert rig.m.refcount(shared) == 1 and rig.m.refcount(own) == 1
    assert rig.m.cow_reserve() == {}  # nothing is left for a write to copy
    clean(rig, "A", "B")
    rig.free("B")  # aborted before its first write
    s = rig.m.stats
    assert (s.cow_copies, s.cow_copies_eager, s.cow_copies_unneeded) == (1, 1, 1)
    clean(rig, "A")


def test_under_write_the_same_abort_copies_nothing() -> None:
    rig = Rig(cfg())
    rig.prefill("A", A)
    assert rig.admit("B", [*A, 60]) == 6
    assert rig.m.block_table("B")[1] == rig.m.block_table("A")[1]  # still shared, a target set aside
    rig.free("B")
    assert (rig.m.stats.cow_copies, rig.m.stats.cow_copies_unneeded) == (0, 0)
    assert rig.m.cow_reserve() == {}
    clean(rig, "A")


@pytest.mark.parametrize("mode", MODES)
def test_a_prefix_hit_on_a_partial_block_copies_at_admission_under_allocate_at_the_write_under_write(mode) -> None:
    rig = Rig(cfg(cow_check=mode))
    rig.prefill("A", A)
    shared = rig.m.block_table("A")[1]
    assert rig.admit("B", [*A, 60]) == 6
    at_admission = rig.m.stats.cow_copies
    write = rig.feed("B", [60])
    own = rig.m.block_table("B")[1]
    assert own != shared
    assert write.slots == [own * BS + 2]  # B writes after the 2 slots it keeps, in its own block
    if mode == "allocate":
        assert at_admission == 1 and write.copies == []
    else:
        assert at_admission == 0 and write.copies == [(shared, own)]
    assert rig.feed("A", [16]).copies == []  # the owner is alone in its block: in place
    clean(rig, "A", "B")
    rig.free("B")
    s = rig.m.stats
    assert (s.cow_copies, s.cow_copies_eager, s.cow_copies_unneeded) == (1, int(mode == "allocate"), 0)
    clean(rig, "A")


def test_a_fork_copies_the_shared_partial_block_at_fork_time() -> None:
    rig = Rig(cfg(cow_check="allocate"))
    rig.prefill("P", [1, 2, 3, 4, 5, 6])
    parent = rig.m.block_table("P")
    copies = rig.fork("P", "C")
    child = rig.m.block_table("C")
    assert copies == [(parent[1], child[1])]
    assert child[0] == parent[0] and rig.m.refcount(parent[0]) == 2  # the full block stays shared
    assert rig.m.refcount(parent[1]) == 1 and rig.m.refcount(child[1]) == 1
    assert rig.feed("P", [7]).copies == []
    assert rig.feed("C", [8]).copies == []
    assert rig.feed("C", [9, 10]).copies == []  # into a new block of its own
    clean(rig, "P", "C")
    rig.free("P")
    rig.free("C")
    s = rig.m.stats
    assert (s.cow_copies, s.cow_copies_eager, s.cow_copies_unneeded) == (1, 1, 0)


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_whose_child_finishes_first_copies_for_nothing_only_under_allocate(mode) -> None:
    rig = Rig(cfg(cow_check=mode))
    rig.prefill("P", [1, 2, 3, 4, 5, 6])
    rig.fork("P", "C")
    rig.free("C")  # e.g. it sampled a stop token at the fork step
    assert rig.feed("P", [7]).copies == []  # alone again: in place
    s = rig.m.stats
    expect = (1, 1, 1) if mode == "allocate" else (0, 0, 0)
    assert (s.cow_copies, s.cow_copies_eager, s.cow_copies_unneeded) == expect
    clean(rig, "P")


def test_a_fork_at_a_block_boundary_copies_nothing() -> None:
    rig = Rig(cfg(cow_check="allocate"))
    rig.prefill("P", list(range(8)))
    assert rig.fork("P", "C") == []
    assert rig.m.block_table("C") == rig.m.block_table("P")
    assert rig.feed("P", [100]).copies == [] and rig.feed("C", [200]).copies == []
    assert rig.m.stats.cow_copies == 0
    clean(rig, "P", "C")


def test_a_fork_mid_prefill_copies_the_frontier_and_swaps_the_reserved_blocks() -> None:
    rig = Rig(cfg(cow_check="allocate"))
    prompt = list(range(10))
    rig.admit("P", prompt)
    rig.feed("P", prompt[:3])  # block 0 holds 3 tokens, blocks 1 and 2 are reserved and empty
    copies = rig.fork("P", "C")
    assert len(copies) == 1  # block 0 (3 slots kept); the reserved blocks are replaced, nothing to copy
    assert set(rig.m.block_table("C")).isdisjoint(rig.m.block_table("P"))
    assert rig.feed("C", prompt[3:10]).copies == []
    assert rig.feed("P", prompt[3:10]).copies == []
    assert rig.m.stats.cow_copies == rig.m.stats.cow_copies_eager == 1
    clean(rig, "P", "C")


def test_full_block_hits_are_never_copied() -> None:
    rig = Rig(cfg(cow_check="allocate", prefix_granularity="block"))
    a = list(range(8))
    rig.prefill("A", a)
    alloc = rig.m.allocate("B", [*a, 9, 10])
    assert alloc.num_cached_tokens == 8 and alloc.copies == []
    assert rig.m.block_table("B")[:2] == rig.m.block_table("A")
    assert rig.m.stats.cow_copies == 0


def test_a_block_another_request_still_writes_stays_that_requests_write_time_copy() -> None:
    """The one copy left to the write: B reached block 1 through a partial hit and still writes into it; C's
    later hit reads the whole block. C never writes it, and B's copy is made at B's next write."""
    rig = Rig(cfg(num_blocks=6, cow_check="allocate"))
    a = list(range(8))
    rig.prefill("A", a)
    rig.free("A")
    assert rig.admit("B", [0, 1, 2, 3, 4, 5]) == 5  # revives block 1 (free, so not shared), views 1 slot
    assert rig.m.stats.cow_copies == 0
    assert rig.admit("C", [*a, 9]) == 8
    assert rig.m.stats.cow_copies == 0
    assert list(rig.m.cow_reserve()) == [1]  # B's copy target, set aside as under "write"
    assert rig.feed("B", [5]).copies == [(1, rig.m.block_table("B")[1])]
    assert rig.m.stats.cow_copies_eager == 0
    rig.feed("C", [9])
    clean(rig, "B", "C")


@pytest.mark.parametrize("mode", MODES)
def test_no_room_for_the_copy_refuses_the_admission_and_changes_nothing(mode) -> None:
    rig = Rig(cfg(num_blocks=6, cow_check=mode))
    rig.prefill("A", A)  # 2 blocks
    rig.prefill("C", list(range(100, 116)))  # the other 4
    before = rig.snapshot()
    alloc = rig.m.allocate("B", [*A, 60], num_tokens=0)
    assert alloc.failure is AllocFailure.COW_SPARES
    assert rig.snapshot() == before


def test_without_reference_counting_the_eager_copy_takes_a_free_block_or_refuses() -> None:
    rig = Rig(cfg(num_blocks=6, cow_check="allocate", reference_counting=False, unsafe=True))
    rig.prefill("A", A)
    assert rig.m.cow_reserve() == {}  # no reserve without reference counts
    rig.prefill("C", list(range(100, 116)))
    assert rig.m.allocate("B", [*A, 60], num_tokens=0).failure is AllocFailure.COW_SPARES
    rig.free("C")
    assert rig.admit("B", [*A, 60]) == 6
    assert rig.m.block_table("B")[1] != rig.m.block_table("A")[1]
    assert rig.m.stats.cow_copies_eager == 1


def test_a_fork_in_a_full_pool_leaves_the_copy_to_the_write() -> None:
    rig = Rig(cfg(num_blocks=6, cow_check="allocate"))
    rig.prefill("P", A)
    rig.prefill("Q", list(range(100, 116)))  # the pool is full
    assert rig.fork("P", "C") == []  # a fork must not fail
    rig.free("Q")
    parent = rig.m.block_table("P")[1]
    assert rig.feed("C", [8]).copies == [(parent, rig.m.block_table("C")[1])]
    s = rig.m.stats
    assert (s.cow_copies, s.cow_copies_eager) == (1, 0)
    clean(rig, "P", "C")


def test_bytes_copied_are_blocks_copied_times_the_storages_block_bytes() -> None:
    rig = Rig(cfg(cow_check="allocate"))
    assert rig.storage.block_nbytes == NUM_LAYERS * 2 * BS * 2 * 4 * 8  # K and V, float64, 2 heads of 4
    rig.prefill("P", A)
    rig.fork("P", "C")
    rig.prefill("B", [*A, 60, 61])  # a partial hit on P's block 1, which C does not hold
    s = rig.m.stats
    assert s.cow_copies == 2 and rig.storage.blocks_copied == 2
    assert s.cow_bytes == rig.storage.bytes_copied == 2 * rig.storage.block_nbytes
    # A manager driven without storage knows no block size: it counts copies, not bytes.
    bare = KVCacheManager(cfg(cow_check="allocate"))
    bare.allocate("P", A)
    bare.commit_writes()
    bare.fork("P", "C")
    assert (bare.stats.cow_copies, bare.stats.cow_bytes) == (1, 0)
