"""Prefix index guarantees pinned down by mutation testing (issue 40): lost hits, evictions and memory.

Every hit the verified index gives is checked against the block's tokens, extra keys and parent identity, so the
mutants of kvlab.kv.prefix these tests were written against never share a wrong block. They lose something else:
a cached prefix a lookup no longer finds, a free block counted (and placed in the free queue) as cached when no
lookup can find it, or trie nodes kept after every block under them is gone. Each test says which, with exact
values.
"""

from __future__ import annotations

import gc

import pytest
from kv_rig import Rig, cfg, clean

from kvlab.config import CacheConfig
from kvlab.instrument.trace import Trace
from kvlab.kv import KVCacheManager, check_invariants
from kvlab.kv.hashing import hash_block
from kvlab.kv.prefix import PrefixIndex

X0, X1, X2 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]  # three full blocks of 4


def _key(rig: Rig, *blocks: list[int]) -> int:
    """The chain key of the last of these salt-free blocks, each following the ones before it."""
    key = None
    for block in blocks:
        key = hash_block(key, block, (), rig.m.config.hash_algo)
    assert key is not None
    return key


def _recompute_block_0_and_go_on(rig: Rig) -> None:
    """A caches X0 (block 0, keyed) and holds it; B's prompt is X0 exactly, so B computes a second copy of X0
    (a copy-on-write of A's block with token granularity, a block of its own with block granularity: its last
    token is always recomputed), then decodes X1 and X2 into blocks chained under its own copy."""
    assert rig.prefill("A", [*X0, 99]) == 0
    assert rig.m.block_table("A") == [0, 1]
    rig.prefill("B", X0)
    rig.feed("B", X1)
    rig.feed("B", X2)
    assert rig.m.block_table("B") == [2, 3, 4]
    assert rig.m.index.keys()[_key(rig, X0)] == 0  # the hash map keys A's copy of X0, not B's


# -- _content_id: a recomputed copy of a cached block takes its identity ------------------------------------
@pytest.mark.parametrize("granularity", ["block", "token"])
def test_blocks_chained_under_a_recomputed_copy_are_found_from_the_keyed_copy(granularity: str) -> None:
    """B's copy of X0 holds exactly the content of A's committed copy, so it gets the same content id: X1 and X2,
    chained under B's copy, follow A's too. A lookup reaches block 0 through the hash map (A's copy) and must go
    on to find all three blocks; with an identity of its own, B's X1 follows another parent and only X0 is found."""
    rig = Rig(cfg(prefix_granularity=granularity))
    _recompute_block_0_and_go_on(rig)
    assert rig.m.index.cid_of(2) == rig.m.index.cid_of(0)
    assert rig.m.lookup([*X0, *X1, *X2, 0]) == 12
    assert rig.m.lookup([*X0, *X1, 0]) == 8
    clean(rig, "A", "B")


# -- match: a full block found in the trie hands on its chain key --------------------------------------------
def test_a_request_that_hit_a_block_through_the_trie_extends_the_next_block_without_orphaning_its_chain() -> None:
    """Once A's keyed copy of X0 is evicted, block 0 is found in the trie (B's copy), and the lookup must hand on
    that block's chain key like a hash hit does. C = X0 + X1 hits B's X1 block for 3 tokens and recomputes its
    last token in place: the same token after the same parent, so the block keeps its identity and X2, chained
    after it, stays findable. Handed on without a key, C's link to X1 names no parent key, the block takes a new
    identity and X2 is lost (a lookup finds 8 tokens instead of 12) with no eviction."""
    rig = Rig(cfg(prefix_granularity="token"))
    _recompute_block_0_and_go_on(rig)
    rig.free("A")
    rig.free("B")
    assert rig.m.free_order() == [5, 6, 7, 8, 9, 1, 0, 4, 3, 2]
    assert rig.prefill("U", list(range(100, 128))) == 0  # seven blocks: evicts A's [99] block, then A's X0
    assert rig.m.stats.evictions == 2
    assert rig.m.index.keys().get(_key(rig, X0)) is None  # no block holds X0's key: it is found in the trie only
    rig.free("U")
    assert rig.m.lookup([*X0, *X1, *X2, 0]) == 12  # X0 from the trie, then X1 and X2
    found = rig.m.index.match([*X0, *X1, *X2, 0], rig.m.keying_of(X0), 12)
    assert found.blocks == [2, 3, 4]
    assert found.hashes == [_key(rig, X0), _key(rig, X0, X1), _key(rig, X0, X1, X2)]  # the chain keys, as by hash
    assert rig.prefill("C", [*X0, *X1]) == 7
    assert rig.m.block_table("C") == [2, 3]
    clean(rig, "C")
    rig.free("C")
    assert rig.m.stats.evictions == 2
    assert rig.m.lookup([*X0, *X1, *X2, 0]) == 12
    assert rig.prefill("D", [*X0, *X1, *X2, 0]) == 12
    clean(rig, "D")


# -- discard_pending: a full block that loses a pending rewrite keeps its key and identity -------------------
def test_a_full_block_rewritten_by_a_request_preempted_before_its_forward_keeps_its_chain() -> None:
    """B = A[:15] recomputes its last token into A's cached, full block 3 (the same token: the block keeps its
    identity, and the write adds nothing to publish, so nothing is pending), then is preempted before the forward
    pass. The block keeps its committed tokens, all four of them: it is still full, so it keeps its key and content
    id and A's blocks 4 and 5, chained after it, stay findable (20 tokens, not 16)."""
    rig = Rig(cfg(num_blocks=12, prefix_granularity="token"))
    a = list(range(100, 121))  # 21 tokens: 5 full blocks of 4 and one partial
    rig.prefill("A", a)
    rig.free("A")
    keys, cids = rig.m.index.keys(), [rig.m.index.cid_of(b) for b in range(6)]
    assert rig.admit("B", a[:15]) == 14
    assert rig.m.block_table("B") == [0, 1, 2, 3]
    assert rig.m.append_slots("B", a[14:15]).ok  # scheduled: block 3 holds what it held, all of it published
    assert rig.m.index.pending() == set()
    check_invariants(rig.m)  # between the schedule and the forward too
    rig.m.free("B")  # preempted before the forward pass
    rig.m.commit_writes()
    assert rig.m.index.pending() == set()
    assert rig.m.index.keys() == keys
    assert [rig.m.index.cid_of(b) for b in range(6)] == cids
    assert rig.m.lookup(a) == 20
    assert rig.m.stats.evictions == 0
    check_invariants(rig.m)
    assert rig.prefill("A2", a) == 20
    clean(rig, "A2")


# -- is_cached: only what a lookup can find counts as cached --------------------------------------------------
def test_an_unkeyed_copy_is_plain_free_memory_with_block_granularity() -> None:
    """With block granularity a block is found only through the hash map, which keys the first committed copy of
    a content. B's copy of X0 is never keyed, so it is not cached: freed, it goes to the front of the free queue
    (reused first, nothing evictable), and taking it evicts nothing; A's keyed copy is kept to the last."""
    rig = Rig(cfg(prefix_granularity="block"))
    assert rig.prefill("A", [*X0, 99]) == 0
    assert rig.prefill("B", X0) == 0  # block granularity: the last token's block is computed again
    assert rig.m.block_table("B") == [2]
    assert rig.m.index.keys() == {_key(rig, X0): 0}
    assert [rig.m.is_cached(b) for b in range(3)] == [True, False, False]
    rig.free("B")
    assert rig.m.num_evictable_blocks() == 0
    assert rig.m.free_order() == [2, 3, 4, 5, 6, 7, 8, 9]
    rig.free("A")
    assert rig.m.num_evictable_blocks() == 1
    assert rig.m.free_order() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    assert rig.prefill("U", list(range(100, 136))) == 0  # nine blocks: every free block but A's X0
    assert rig.m.block_table("U") == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert rig.m.stats.evictions == 0
    assert rig.m.lookup([*X0, 0]) == 4
    clean(rig, "U")


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_a_block_written_this_step_is_not_cached_until_the_commit(granularity: str) -> None:
    """is_cached answers whether a lookup can find the block right now: a block whose slots were handed out this
    step (a full one with its key, a partial one) is not, until the step's commit."""
    rig = Rig(cfg(prefix_granularity=granularity))
    prompt = [*X0, *X1, 9, 10]
    rig.admit("A", prompt)
    assert rig.m.append_slots("A", prompt).ok
    assert rig.m.block_table("A") == [0, 1, 2]
    assert [rig.m.is_cached(b) for b in range(3)] == [False, False, False]
    assert rig.m.lookup([*prompt, 0]) == 0
    rig.m.commit_writes()
    assert [rig.m.is_cached(b) for b in range(3)] == [True, True, granularity == "token"]
    assert rig.m.lookup([*prompt, 0]) == (10 if granularity == "token" else 8)


def test_taking_a_free_block_whose_write_is_not_committed_evicts_nothing() -> None:
    """Unsafe reference_counting=False: A's free releases the block its fork B still holds, and B's next token
    lands in that free block in place, as new content not yet committed. A request that takes the block in the
    same step finds nothing cached in it: no eviction is counted or traced."""
    trace = Trace()
    rig = Rig(cfg(reference_counting=False, unsafe=True), trace)
    rig.prefill("A", [1, 2])
    rig.fork("A", "B")
    rig.free("A")
    assert rig.m.free_order()[0] == 0 and rig.m.index.content(0) is None
    assert rig.feed("B", [3], commit=False) is not None  # in place: block 0 is free, its content pending
    assert rig.m.block_table("B") == [0] and rig.m.index.pending() == {0}
    assert rig.m.is_cached(0) is False
    assert rig.m.allocate("C", [7, 7, 7], num_tokens=0).ok
    assert rig.m.block_table("C") == [0]
    assert rig.m.stats.evictions == 0
    assert trace.select(op="evict") == []


# -- _trie_remove: no trie group outlives its last block ------------------------------------------------------
def _nodes_that_lead_to_a_block(index: PrefixIndex) -> int:
    """One node per (group, token path) listed by trie_paths, and a root per group: nothing else is needed."""
    paths = {gp for gps in index.trie_paths().values() for gp in gps}
    return len(paths) + len({group for group, _ in paths})


def test_evicted_chains_leave_no_trie_group_behind() -> None:
    """Every block chained after another is grouped in the trie under its parent's content id, which is never
    reused: once the last block of a group is evicted, the group must go, or a long-running cache keeps an empty
    group per chain link it ever evicted. Churning 30 distinct prompts through a 10-block pool, the index holds only
    the trie nodes that lead to a findable block: 38 at the end, where keeping empty groups would hold 92 (two
    empty groups for each of the 27 chains evicted)."""
    rig = Rig(cfg(prefix_granularity="token"))
    index = rig.m.index
    for n in range(30):
        prompt = list(range(1000 * n + 1, 1000 * n + 10))  # 2 full blocks and one token
        rig.prefill(f"R{n}", prompt)
        rig.free(f"R{n}")
        assert index.trie_nodes() == _nodes_that_lead_to_a_block(index), n
    assert rig.m.stats.evictions == 30 * 3 - 10  # every block taken once the pool's ten are all cached
    assert index.trie_nodes() == _nodes_that_lead_to_a_block(index) == 38
    check_invariants(rig.m)


# -- the tries in ints: a cached token is nothing the cyclic collector walks -------------------------------------
@pytest.mark.parametrize("shared", [0, 40])
def test_cached_tokens_add_no_objects_the_collector_walks(shared: int) -> None:
    """The token tries are ints only (docs/performance.md, "The collector"): caching 8,000 tokens adds each block's
    own record to what the collector walks (its content and token list), not objects per token. A node object per
    token with its dict of children and its set of blocks added 3.3 a token, and a full collection walked them all.
    ``shared``: the prompts' common start, so that the nodes of a shared partial block list several blocks."""
    m = KVCacheManager(CacheConfig(num_blocks=600, block_size=16, prefix_granularity="token"))
    gc.collect()
    before = len(gc.get_objects())
    for n in range(100):
        prompt = [*range(1, shared + 1), *(n * 1_000 + k for k in range(80 - shared))]
        cached = m.allocate(f"R{n}", prompt, num_tokens=0).num_cached_tokens
        assert m.append_slots(f"R{n}", prompt[cached:]).ok
        m.commit_writes()
        m.free(f"R{n}")
    gc.collect()
    cached_tokens = sum(committed for _, committed in m.index.findable())
    assert cached_tokens >= 100 * (80 - shared)
    assert len(gc.get_objects()) - before < cached_tokens / 4
    check_invariants(m)
