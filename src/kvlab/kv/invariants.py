"""Whole-state consistency check of a KVCacheManager, for tests and debugging.

Each failure names the block or key and the rule it broke. With ``reference_counting=False`` refcounts no
longer match the tables by design (free releases blocks others still hold); only the rules the pool itself
must keep then are checked.

Isolation between namespaces (cache salts) is checked wherever the configuration promises it (tokens verified,
copy-on-write and reference counting on): every block a live request holds under its computed tokens is in the
namespace the request's keying gives that index -- public, or private to the request's own salt. A request
holding another salt's private block (a cross-tenant hit outside public blocks) breaks it.
"""

from __future__ import annotations

from collections import Counter
from typing import NoReturn

from kvlab.config import blocks_for
from kvlab.kv.hashing import hash_block
from kvlab.kv.manager import KVCacheManager


class InvariantError(AssertionError):
    """The cache manager's state is inconsistent."""


def _fail(msg: str) -> NoReturn:
    raise InvariantError(msg)


def check_invariants(manager: KVCacheManager) -> None:
    _check_pool(manager)
    if manager.config.reference_counting:
        _check_refcounts(manager)
    _check_requests(manager)
    if manager.index is not None:
        _check_index(manager)
        if isolation_promised(manager):
            _check_namespaces(manager)
    if manager.stats.peak_refcount < max(map(manager.refcount, range(manager.num_blocks))):
        _fail(f"stats.peak_refcount {manager.stats.peak_refcount} is below a current refcount")


def isolation_promised(m: KVCacheManager) -> bool:
    """Whether the configuration promises that no request reads another namespace's private blocks: the unsafe
    knobs that break isolation on purpose (unverified hits, writes into shared blocks, frees of held blocks) are off."""
    c = m.config
    return c.verify_tokens and c.copy_on_write and c.reference_counting


def _check_namespaces(m: KVCacheManager) -> None:
    index = m.index
    assert index is not None
    bs = m.block_size
    for rid in m.request_ids():
        keying = m.keying(rid)
        table = m.block_table(rid)
        for i in range(blocks_for(m.num_computed_tokens(rid), bs)):
            c = index.content(table[i])
            if c is None:  # no identity (its parent lost one): nobody can find it, nobody shares it
                continue
            want = keying.namespace(i)
            if c.namespace != want:
                held = "public" if c.namespace is None else f"private to salt {c.namespace!r}"
                wanted = "public" if want is None else f"private to salt {want!r}"
                _fail(
                    f"request {rid!r} holds block {table[i]} at index {i}, which is {held}; its keying makes "
                    f"index {i} {wanted} (a read across namespaces outside public blocks)"
                )


def _check_pool(m: KVCacheManager) -> None:
    pool = m.pool
    free = pool.free_order()
    if len(free) != len(set(free)):
        _fail(f"free queue lists a block twice: {sorted(b for b, n in Counter(free).items() if n > 1)}")
    used = [b for b in range(m.num_blocks) if pool.refcount(b) > 0]
    if len(free) + len(used) != m.num_blocks:
        _fail(f"free ({len(free)}) + used ({len(used)}) != total ({m.num_blocks})")
    for b in free:
        if pool.refcount(b) != 0:
            _fail(f"block {b} is in the free queue with refcount {pool.refcount(b)}")
    for b in range(m.num_blocks):
        if pool.refcount(b) < 0:
            _fail(f"block {b} has negative refcount {pool.refcount(b)}")


def _check_refcounts(m: KVCacheManager) -> None:
    holders: Counter[int] = Counter()
    for rid in m.request_ids():
        holders.update(m.block_table(rid))
    reserve = m.cow_reserve()
    for block, spares in reserve.items():
        holders.update(spares)
        if len(spares) > m.copies_due(block):
            _fail(f"block {block} has {len(spares)} CoW reserve blocks, more than the {m.copies_due(block)} due")
    for b in range(m.num_blocks):
        if m.refcount(b) != holders[b]:
            _fail(f"block {b} has refcount {m.refcount(b)} but {holders[b]} tables/reserves hold it")
        if holders[b] and m.pool.is_free(b):
            _fail(f"block {b} is free and referenced")


def _check_requests(m: KVCacheManager) -> None:
    bs = m.block_size
    writers: Counter[int] = Counter()
    for rid in m.request_ids():
        table = m.block_table(rid)
        n = m.num_computed_tokens(rid)
        if len(table) < blocks_for(n, bs):
            _fail(f"request {rid!r} computed {n} tokens but its table has only {len(table)} blocks")
        bad = [b for b in table if not 0 <= b < m.num_blocks]
        if bad:
            _fail(f"request {rid!r} holds out-of-range blocks {bad}")
        writers.update(table[n // bs :])
    for b in range(m.num_blocks):
        if m.writers(b) != writers[b]:
            _fail(f"block {b} is counted with {m.writers(b)} writers, tables say {writers[b]}")


def _check_index(m: KVCacheManager) -> None:
    index = m.index
    assert index is not None
    bs, algo = m.block_size, m.config.hash_algo
    contents = index.contents()
    for key, block in index.keys().items():
        c = contents.get(block)
        if c is None:
            _fail(f"key {key:#x} maps to block {block}, which holds no content")
        if c.hash != key or len(c.tokens) != bs or c.committed != bs:
            _fail(f"key {key:#x} maps to block {block}, whose content is not that full committed block")
        if hash_block(c.link.parent_hash, c.tokens, c.link.extra, algo) != key:
            _fail(f"key {key:#x} maps to block {block}, whose tokens hash to another key")
    pending = index.pending()
    for block, c in contents.items():
        if not 0 < len(c.tokens) <= bs or not 0 <= c.committed <= len(c.tokens):
            _fail(f"block {block} content has {len(c.tokens)} tokens, {c.committed} committed")
        if (block in pending) != (c.committed < len(c.tokens)):
            _fail(f"block {block} pending={block in pending} but {c.committed}/{len(c.tokens)} committed")
        if c.group != index.group_key(c.link):
            _fail(f"block {block} is grouped under {c.group}, its link says {index.group_key(c.link)}")
        if (c.cid is None) != (len(c.tokens) < bs):
            _fail(f"block {block} has {len(c.tokens)} tokens and content id {c.cid}")
    for block in pending:
        if block not in contents:
            _fail(f"block {block} is pending but holds no content")
    if index.token_granularity:
        paths = index.trie_paths()
        for block in set(paths) | set(contents):
            c = contents.get(block)
            want = [] if c is None else [(c.group, tuple(c.tokens[:k])) for k in range(1, c.committed + 1)]
            if sorted(paths.get(block, [])) != sorted(want):
                _fail(f"block {block} is in the token trie at {paths.get(block, [])}, expected {want}")
