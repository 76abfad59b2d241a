"""Prefix-caching scenarios of the kind vLLM's prefix-caching tests check, written for kvlab's rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_rig import BS, Rig, cfg, clean

from kvlab.instrument.trace import Trace
from kvlab.kv import check_invariants
from kvlab.kv import prefix as prefix_mod
from kvlab.kv.hashing import hash_block
from kvlab.kv.prefix import edge_key, edge_of


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_shared_prefix_raises_refcounts_and_frees_in_documented_order(granularity):
    rig = Rig(cfg(prefix_granularity=granularity))
    a = list(range(10))  # blocks 0, 1 full; block 2 holds [8, 9]
    b = [*a[:8], 50, 51, 52]
    assert rig.prefill("A", a) == 0
    assert rig.m.block_table("A") == [0, 1, 2]
    assert rig.prefill("B", b) == 8
    assert rig.m.block_table("B") == [0, 1, 3]
    assert [rig.m.refcount(x) for x in range(4)] == [2, 2, 1, 1]
    assert rig.m.stats.peak_refcount == 2
    clean(rig, "A", "B")

    rig.free("A")
    assert [rig.m.refcount(x) for x in range(4)] == [1, 1, 0, 1]
    rig.free("B")
    # Tail first: each request's last block is released first, so the shared prefix [0, 1] ends up at the
    # back of the queue (evicted last). A partial block is findable only with token granularity; with
    # block granularity it holds nothing findable and goes to the front (reused first).
    if granularity == "block":
        assert rig.m.pool.free_order() == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    else:
        assert rig.m.pool.free_order() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    check_invariants(rig.m)


def test_later_long_request_evicts_the_common_prefix_last():
    trace = Trace()
    rig = Rig(cfg(), trace)
    a = list(range(10))
    rig.prefill("A", a)
    rig.prefill("B", [*a[:8], 50, 51, 52])
    rig.free("A")
    rig.free("B")
    # Free queue: [4..9, 2, 3, 1, 0]. Seven blocks of unrelated tokens take the six never-used blocks and
    # evict one suffix block.
    assert rig.m.pool.free_order() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert rig.prefill("C", list(range(100, 128))) == 0
    assert [e.block for e in trace.select(op="evict")] == [2]
    # The common prefix survived: a new request still finds it; its one new block evicts the other suffix.
    assert rig.prefill("D", [*a[:8], 70]) == 8
    assert [e.block for e in trace.select(op="evict")] == [2, 3]
    assert rig.m.stats.evictions == 2
    assert rig.m.block_table("D")[:2] == [0, 1]
    clean(rig, "C", "D")


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_partial_block_never_hits_by_hash(granularity):
    trace = Trace()
    rig = Rig(cfg(prefix_granularity=granularity), trace)
    rig.prefill("A", list(range(6)))  # block 0 full, block 1 holds [4, 5]
    assert list(rig.m.index.keys().values()) == [0]  # only the full block has a key
    cached = rig.prefill("B", [0, 1, 2, 3, 4, 5, 6, 7])
    assert 1 not in rig.m.index.keys().values()  # A's partial block still has no key
    if granularity == "block":
        assert cached == 4
        assert rig.m.block_table("B")[:1] == [0] and 1 not in rig.m.block_table("B")
    else:
        assert cached == 6  # found by token match, not by a key
        hits = trace.select(op="hit", request="B")
        assert [(e.block, e.detail["tokens"], e.detail["partial"]) for e in hits] == [(0, 4, False), (1, 2, True)]
    clean(rig, "A", "B")


def test_reused_block_loses_its_old_key():
    rig = Rig(cfg(prefix_granularity="block"))
    a = list(range(8))
    rig.prefill("A", [*a, 99])
    old_keys = {k for k, b in rig.m.index.keys().items() if b in (0, 1)}
    assert len(old_keys) == 2
    rig.free("A")
    assert rig.prefill("X", list(range(100, 140))) == 0  # all ten blocks: A's are evicted and rewritten
    assert old_keys.isdisjoint(rig.m.index.keys())
    assert rig.m.stats.evictions == 2
    rig.free("X")
    assert rig.prefill("A2", [*a, 99]) == 0
    clean(rig, "A2")


def test_own_hit_blocks_are_never_evicted_for_its_own_new_blocks():
    rig = Rig(cfg())
    a = list(range(8))
    rig.prefill("A", a)  # blocks 0, 1 (prompt computed fully, both full)
    rig.free("A")
    rig.prefill("X", list(range(100, 132)))  # blocks 2..9
    rig.free("X")
    # A's prefix is now at the FRONT of the free queue: taking new blocks first would evict it.
    assert rig.m.pool.free_order()[:2] == [1, 0]
    b = [*a, *range(300, 330)]  # 38 tokens = 10 blocks: 2 hits + 8 new = the whole pool
    assert rig.prefill("B", b) == 8
    table = rig.m.block_table("B")
    assert table[:2] == [0, 1]
    assert sorted(table) == list(range(10))
    clean(rig, "B")


def test_failed_allocation_leaves_every_refcount_and_the_lru_order_unchanged():
    trace = Trace()
    rig = Rig(cfg(), trace)
    a = list(range(10))
    rig.prefill("A", a)  # blocks 0, 1, 2 in use
    rig.prefill("Y", list(range(100, 108)))
    rig.free("Y")  # blocks 3, 4 cached but free
    before, events = rig.snapshot(), len(trace.events)
    # Hits A's in-use prefix and Y's free cached blocks, but needs more blocks than the pool has.
    too_big = [*range(100, 108), *range(500, 540)]
    assert rig.admit("Z", too_big) is None
    assert rig.admit("Z", [*a[:8], *range(600, 640)]) is None
    assert rig.snapshot() == before
    assert len(trace.events) == events
    assert not rig.m.has_request("Z")
    # It fits once the pool has room: the failure was about capacity, not the prompt.
    rig.free("A")
    assert rig.admit("Z", [*range(100, 108), *range(500, 520)]) == 8


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_fully_cached_prompt_still_recomputes_its_last_token(granularity):
    rig = Rig(cfg(prefix_granularity=granularity))
    a = list(range(8))  # exactly two full blocks
    rig.prefill("A", a)
    cached = rig.prefill("B", a)
    # Block granularity must drop the whole last block; token granularity shares 3 of its 4 slots
    # and copies them before writing the last token (A still holds the block).
    assert cached == (4 if granularity == "block" else 7)
    assert rig.m.num_computed_tokens("B") == 8
    if granularity == "token":
        assert rig.m.stats.cow_copies == 1
    clean(rig, "A", "B")
    assert rig.prefill("C", [42]) == 0  # a one-token prompt never hits


def test_same_salt_hits_other_salt_or_none_misses():
    rig = Rig(cfg(num_blocks=16))
    p = list(range(9))
    assert rig.prefill("A", p, salt="tenant-1") == 0
    assert rig.prefill("B", p, salt="tenant-1") == 8  # caching is on and works
    assert rig.prefill("C", p, salt="tenant-2") == 0
    assert rig.prefill("D", p) == 0
    assert rig.prefill("E", p) == 8  # unsalted requests share among themselves
    # The salt enters block 0's key only, yet every later key differs through the chain.
    salted = {b for b in rig.m.block_table("A")[:2]}
    unsalted = {b for b in rig.m.block_table("D")[:2]}
    assert salted.isdisjoint(unsalted)
    clean(rig, "A", "B", "C", "D", "E")


def test_salt_also_separates_partial_blocks():
    rig = Rig(cfg())
    rig.prefill("A", [1, 2, 3], salt="s")  # a single partial block
    assert rig.prefill("B", [1, 2, 3, 4], salt="s") == 3
    assert rig.prefill("C", [1, 2, 3, 4]) == 0
    clean(rig, "A", "B", "C")


def test_reset_fails_while_in_use_and_clears_every_key_after():
    trace = Trace()
    rig = Rig(cfg(), trace)
    rig.prefill("A", list(range(10)))
    keys = rig.m.index.keys()
    assert keys
    assert rig.m.reset_prefix_cache() is False
    assert rig.m.index.keys() == keys and not trace.select(op="reset")
    rig.free("A")
    assert rig.m.reset_prefix_cache() is True
    assert rig.m.index.keys() == {} and rig.m.index.contents() == {}
    assert len(trace.select(op="reset")) == 1
    assert rig.prefill("B", list(range(10))) == 0
    clean(rig, "B")


def test_uncommitted_writes_are_not_findable():
    """A lookup in the same step as a write must not share (or copy) slots the forward has not filled."""
    rig = Rig(cfg())
    a = list(range(10))
    rig.admit("A", a)
    rig.feed("A", a[:6], commit=False)  # scheduled, not yet computed
    assert rig.admit("B", [*a, 77]) == 0
    rig.m.free("B")
    rig.m.commit_writes()
    assert rig.admit("C", [*a, 77]) == 6
    clean(rig, "A", "C")


def test_a_request_preempted_before_its_forward_leaves_nothing_findable():
    rig = Rig(cfg())
    rig.prefill("A", list(range(6)))  # committed: block 0 full, block 1 holds [4, 5]
    rig.m.append_slots("A", [6, 7, 8])  # scheduled, then preempted before the forward pass
    rig.m.free("A")
    rig.m.commit_writes()  # the end of that step: whatever other requests wrote is published
    check_invariants(rig.m)
    assert rig.admit("B", list(range(12))) == 6  # only what was really written is found
    rig.m.free("B")
    assert rig.m.reset_prefix_cache()


@pytest.mark.parametrize("algo", ["sha256", "xxh64"])
def test_lookup_hashes_each_block_once(monkeypatch, algo):
    """Linear lookup: a prompt of n blocks costs n block hashes, not a rehash of every prefix."""
    rig = Rig(cfg(num_blocks=64, hash_algo=algo))
    prompt = list(range(200))
    rig.prefill("A", prompt)
    calls = []
    real = prefix_mod.hash_block

    def counting(*args, **kw):
        calls.append(len(args[1]))
        return real(*args, **kw)

    monkeypatch.setattr(prefix_mod, "hash_block", counting)
    for n_blocks in (5, 10, 40):
        calls.clear()
        rid = f"B{n_blocks}"
        assert rig.admit(rid, [*prompt[: n_blocks * BS], 999]) == n_blocks * BS
        assert calls == [BS] * n_blocks
        rig.m.free(rid)


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_rerunning_a_shorter_prefix_keeps_the_longer_cached_context_findable(granularity):
    """Regression: with token granularity, B = A[:15] recomputed its last token into A's cached block 3
    (the same token, so the same K/V); the index took that for new content and gave the block a new id,
    orphaning A's blocks 4 and 5. A then found 15 cached tokens instead of 20, with no eviction."""
    rig = Rig(cfg(num_blocks=12, prefix_granularity=granularity))
    a = list(range(100, 121))  # 21 tokens: 5 full blocks of 4 and one partial
    assert rig.prefill("A", a) == 0
    rig.free("A")
    assert rig.m.lookup(a) == 20  # at most len - 1: 5 full blocks
    b = a[:15]
    assert rig.prefill("B", b) == (14 if granularity == "token" else 12)
    clean(rig, "B")
    rig.free("B")
    assert rig.m.stats.evictions == 0
    assert rig.m.lookup(a) == 20
    assert rig.prefill("A2", a) == 20
    clean(rig, "A2")
    check_invariants(rig.m)


def test_lookup_changes_nothing():
    rig = Rig(cfg(num_blocks=6))
    rig.prefill("A", list(range(10)))
    rig.free("A")
    before = rig.snapshot()
    assert rig.m.lookup([*range(10), 99]) == 10
    assert rig.m.lookup(list(range(10)), cache_salt="other") == 0
    assert rig.snapshot() == before


def test_a_colliding_key_under_another_parent_is_refused():
    """Sibling chains that differ only above the block: with the weak (order-blind) hash, Y0 + B keys block 1
    like X0 + B when Y0 is a permutation of X0. Y0 itself is cached (by Y0 + C; at token granularity its trie
    finds it, though X0 holds its key), so the lookup reaches block 1 and finds X's block under the same key:
    only the parent check tells that its K/V follows X0, not Y0."""
    x0, y0, b, c = [1, 2, 3, 4], [4, 3, 2, 1], [5, 6, 7, 8], [9, 9, 9, 9]
    rig = Rig(cfg(hash_algo="weak", unsafe=True, prefix_granularity="token", num_blocks=16))
    for rid, prompt in (("x", x0 + b + [0]), ("y", y0 + c + [0])):
        rig.prefill(rid, prompt)
        rig.free(rid)
    assert rig.prefill("z", y0 + b + [0]) == BS  # Y0 only: X's block 1 follows another parent
    clean(rig, "z")
    check_invariants(rig.m)


def test_no_content_takes_the_roots_identity():
    """Block 0 of every chain follows the root (ROOT_CID); a block further on follows its parent's content id. If
    a content could take the root's id, a block following it would be found as block 0 of a prompt that starts
    with its tokens: K/V computed at positions 8-11 read at 0-3. The first contents' ids are never the root's."""
    from kvlab.kv.prefix import ROOT_CID

    rig = Rig(cfg(num_blocks=16))
    x, y = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]
    rig.prefill("a", x + [0])
    rig.free("a")
    rig.prefill("b", x + y + [0])
    rig.free("b")
    cids = {rig.m.index.cid_of(b) for b in range(16)} - {None}
    assert ROOT_CID not in cids and len(cids) >= 3
    assert rig.prefill("c", y + [0]) == 0  # y's block follows x, never the root
    clean(rig, "c")


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_a_block_freed_before_any_write_is_never_published(granularity):
    """A request admitted with its slots handed out, then freed before the forward pass: its blocks held no
    committed token, so the step's commit must publish none of them (a later hit would read K/V never written)."""
    rig = Rig(cfg(prefix_granularity=granularity))
    prompt = list(range(9))
    alloc = rig.m.allocate("A", prompt)
    assert alloc.ok and len(alloc.slots) == 9
    rig.m.free("A")
    rig.m.commit_writes()
    assert rig.m.lookup(prompt + [0]) == 0
    assert rig.m.num_evictable_blocks() == 0
    check_invariants(rig.m)


def test_after_a_block_found_in_the_trie_the_next_block_keeps_its_own_extra_keys():
    """Two copies of block 0 hold one content (a request recomputed a block another had cached: it gets the same
    identity); the hash map keys the first. Once that one is evicted, block 0 is found in the trie, and the
    lookup of block 1 must go on with block 1's own extra keys: at a public prefix of one block that is the salt
    (block 0 is public, block 1 the first private one). With another block's extras it would miss block 1."""
    from kvlab.kv.hashing import Keying, salt_extra
    from kvlab.kv.prefix import ROOT_CID, ChainLink, PrefixIndex

    x0, x1 = [1, 2, 3, 4], [5, 6, 7, 8]
    keying = Keying("s", 1)
    assert keying.extra(0) == () and keying.extra(1) == salt_extra("s")
    idx = PrefixIndex(4, "sha256", verify=True, token_granularity=True)
    h0 = hash_block(None, x0, keying.extra(0))
    for copy in (10, 11):
        idx.record_write(copy, ChainLink(None, ROOT_CID, keying.extra(0)), x0, 0, h0, keying.namespace(0))
        idx.commit()
    assert idx.cid_of(10) == idx.cid_of(11)  # one content, so a block after either follows both
    h1 = hash_block(h0, x1, keying.extra(1))
    idx.record_write(20, ChainLink(h0, idx.cid_of(10), keying.extra(1)), x1, 0, h1, keying.namespace(1))
    idx.commit()
    assert idx.match(x0 + x1 + [9], keying, 9).blocks == [10, 20]
    idx.forget(10)  # the keyed copy evicted: block 0 is found in the trie now
    found = idx.match(x0 + x1 + [9], keying, 9)
    assert found.blocks == [11, 20] and found.num_tokens == 8


# A trie edge's key must differ for every (node, token) pair: two edges on one key would let a lookup walk from a
# node by a token it does not hold, into another prompt's blocks.
PAIRS = st.tuples(st.integers(0, 2**80), st.integers(-(2**80), 2**80))


@given(PAIRS)
def test_an_edge_key_gives_back_its_node_and_token(pair: tuple[int, int]) -> None:
    assert edge_of(edge_key(*pair)) == pair


@given(PAIRS, PAIRS)
def test_two_edges_share_a_key_only_if_they_are_one_edge(a: tuple[int, int], b: tuple[int, int]) -> None:
    assert (edge_key(*a) == edge_key(*b)) == (a == b)


def test_an_accepted_draft_the_block_already_holds_leaves_nothing_pending():
    """Regression (``kvlab fuzz --model mini-mqa --seed 77``, trial 2850): A's continuation stays cached in its
    partial block; B, the same prompt, finds that block (token granularity: block granularity shares no partial
    block, so B's draft would land in a block of its own) and drafts A's next tokens. The engine accepts a draft
    after the step's commit, and recording tokens the block already held marked it pending with nothing
    uncommitted ("block 0 pending=True but 11/11 committed"): the index's own bookkeeping broken, no harm done
    (those tokens were committed and findable already; discarding the block's pending part would keep them all)."""
    rig = Rig(cfg(block_size=8, prefix_granularity="token"))
    prompt = [7, 7, 7]
    assert rig.prefill("A", prompt) == 0
    for tok in (9, 9, 9):
        assert rig.feed("A", [tok]) is not None
    (block,) = rig.m.table("A").blocks  # [7, 7, 7, 9, 9, 9]: 6 of 8 slots
    rig.free("A")
    assert rig.prefill("B", prompt) == 2  # the prompt's last token is computed again
    assert rig.m.table("B").blocks == [block]
    assert rig.feed("B", [9]) is not None  # A's first token, where A wrote it
    assert rig.m.append_slots("B", [9, 9], num_draft=1).ok  # the next token, and a one-token draft: A's again
    rig.m.commit_writes()  # the step's commit; verification comes after it
    rig.m.accept_drafts("B", [9])
    check_invariants(rig.m)
    assert rig.m.index is not None and rig.m.index.pending() == set()
