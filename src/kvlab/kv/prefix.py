"""The prefix index: which block holds which prefix, and the lookup of a prompt's longest cached prefix.

Each block that holds part of some request's context has a :class:`BlockContent`: its tokens and its
:class:`ChainLink` (what precedes it). Content becomes *findable* only after :meth:`PrefixIndex.commit`,
i.e. once the engine says the K/V of every slot handed out so far has been written. Until then it is
pending: a same-step lookup must not share (and copy-on-write must not copy) slots not yet written, and
a request preempted before the forward pass must leave nothing findable behind.

Findable content is reached two ways:

* full blocks through the hash chain (``_by_hash``), as in vLLM;
* with token granularity, any block by a per-position token trie: all blocks that follow the same
  parent are grouped, and the longest common token prefix with the prompt is one walk of at most
  ``block_size`` steps however many candidates the group has.

Keys follow the request's :class:`~kvlab.kv.hashing.Keying`: block ``i`` is looked up (and grouped in the trie)
with the keying's extra keys of index ``i``, so a public block (no salt on its chain) is found under any salt,
and a private one only under the keying of its own salt. Each content records that namespace.

Verification: a hash hit is accepted only if the block's tokens and extra keys equal the prompt's *and*
its parent is the block matched just before (compared by content id, ``cid``). Comparing tokens alone is
not enough: with a colliding H the block can hold the right tokens computed after a different prefix,
whose K/V differ. Content ids are never reused, so equal ids mean the whole chain of tokens is equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvlab.kv.hashing import Extra, Keying, hash_block

ROOT_CID = 0  # the "parent" of block 0


class ChainLink(NamedTuple):  # a tuple: built for every write, so it must be cheap
    """What precedes a block in its request: the previous full block's key and content id, and extras."""

    parent_hash: int | None  # None for block 0
    parent_cid: int | None  # ROOT_CID for block 0; None when the parent has no identity (nothing findable)
    extra: Extra = ()


@dataclass
class BlockContent:
    """What one block holds, as far as the index knows."""

    link: ChainLink
    group: tuple  # the trie this block belongs to (see PrefixIndex.group_key)
    tokens: list[int]
    committed: int = 0  # tokens[:committed] are written and findable
    hash: int | None = None  # chain key once full
    cid: int | None = None  # content id once full
    # The trie node of tokens[:committed], so that committing a decode token is one step, not a walk.
    tip: int | None = field(default=None, repr=False, compare=False)
    namespace: str | None = None  # the salt the block is private to; None: public (no salt on its chain)


@dataclass
class Match:
    """Result of a prefix lookup: the blocks to share and how many prompt tokens they cover."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # keys of the fully matched blocks
    num_tokens: int = 0


def edge_key(node: int, token: int) -> int:
    """The trie's edge from ``node`` by ``token`` as one int: Szudzik's pairing of the node id and the token folded onto
    the naturals (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...), a different int for every pair of ints."""
    t = 2 * token if token >= 0 else -2 * token - 1
    return node * node + node + t if node >= t else node + t * t


def edge_of(key: int) -> tuple[int, int]:
    """(node, token) of an edge's key (``edge_key``'s inverse)."""
    s = math.isqrt(key)
    r = key - s * s
    node, t = (r, s) if r < s else (s, r - s)
    return node, t // 2 if t % 2 == 0 else -(t + 1) // 2


class PrefixIndex:
    def __init__(self, block_size: int, algo: str, verify: bool, token_granularity: bool) -> None:
        self.block_size = block_size
        self.algo = algo
        self.verify = verify
        self.token_granularity = token_granularity
        self._content: dict[int, BlockContent] = {}
        self._by_hash: dict[int, int] = {}
        # The token tries, in ints only: a node is an id, an edge a key (edge_key), a node's blocks one in _first
        # and the others, where there are others, in _more. An object per node (with its dict of children and set of
        # blocks) made every cached token objects the cyclic collector walks at each full collection; ints it never
        # walks, nor a dict that holds only ints (docs/performance.md, "The collector").
        self._roots: dict[tuple, int] = {}  # group -> its root (whose blocks are every block of the group)
        self._edges: dict[int, int] = {}  # edge_key(node, token) -> the child
        self._first: dict[int, int] = {}  # node -> a block whose committed tokens pass through it (every node has one)
        self._more: dict[int, set[int]] = {}  # node -> the other such blocks
        self._next_node = 0
        self._pending: set[int] = set()
        self._next_cid = ROOT_CID + 1

    def group_key(self, link: ChainLink) -> tuple:
        # Verified lookups group by the exact parent content; unverified ones trust the (maybe colliding) key.
        return (link.parent_cid if self.verify else link.parent_hash, link.extra)

    # -- lookup ----------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], keying: Keying, limit: int) -> Match:
        """Longest findable prefix of ``tokens[:limit]``; block ``i`` is looked up with ``keying.extra(i)``, the
        partial (token-granular) match of the last block in the trie group of that same keying."""
        tokens = list(tokens[:limit])
        bs = self.block_size
        result = Match()
        link = ChainLink(None, ROOT_CID, keying.extra(0))
        while True:
            i = len(result.blocks)
            start = i * bs
            want = tokens[start : start + bs]
            if not want:
                return result
            key = None
            if len(want) == bs:
                key = hash_block(link.parent_hash, want, link.extra, self.algo)
                block = self._by_hash.get(key)
                if block is not None and self._accept(block, want, link):
                    link = self._advance(result, block, key, keying.extra(i + 1))
                    continue
            if not self.token_granularity:
                return result
            block, depth = self._longest(self.group_key(link), want)
            if depth == bs:  # a full copy whose key an earlier copy already took
                assert key is not None
                link = self._advance(result, block, key, keying.extra(i + 1))
                continue
            if depth:
                result.blocks.append(block)
                result.num_tokens += depth
            return result

    def _accept(self, block: int, want: list[int], link: ChainLink) -> bool:
        if not self.verify:
            return True  # the unsafe "trust the key" mode
        c = self._content[block]
        return c.tokens == want and c.link.extra == link.extra and c.link.parent_cid == link.parent_cid

    def _advance(self, result: Match, block: int, key: int, extra: Extra) -> ChainLink:
        """Take a fully matched block; returns the link of the next one (whose extra keys are ``extra``)."""
        result.blocks.append(block)
        result.hashes.append(key)
        result.num_tokens += self.block_size
        return ChainLink(key, self._content[block].cid, extra)

    def _longest(self, group: tuple, want: list[int]) -> tuple[int, int]:
        node = self._roots.get(group)
        depth = 0
        while node is not None and depth < len(want):
            child = self._edges.get(edge_key(node, want[depth]))
            if child is None:
                break
            node, depth = child, depth + 1
        if depth == 0 or node is None:
            return -1, 0
        return self._first[node], depth

    # -- updates ---------------------------------------------------------------------------------------
    def record_write(
        self,
        block: int,
        link: ChainLink,
        view: Sequence[int],
        kept: int,
        full_hash: int | None,
        namespace: str | None = None,
    ) -> None:
        """A request wrote ``view[kept:]`` into ``block`` after the ``kept`` slots it shares with it.

        ``view`` is the writer's whole view of the block after the write. If the block's content and the
        view agree wherever both have a token, under the same parent, the block still holds the same prefix:
        it keeps its identity and grows by whatever the view adds. (A writer that recomputes a token the
        block already holds, e.g. the last token of a prompt that is a prefix of a cached one, rewrites the
        same K/V; treating that as new content would orphan every block chained after this one.) Otherwise
        it was overwritten or reused and its old identity is gone. ``full_hash`` is the writer's chain key
        for this block when the write fills it; ``namespace`` the salt its keying makes the block private to
        (None: public). A block that keeps its identity keeps its namespace: the same link means the same chain.
        """
        c = self._content.get(block)
        common = min(len(view), len(c.tokens)) if c is not None else 0
        if c is not None and c.link == link and len(c.tokens) >= kept and c.tokens[:common] == list(view[:common]):
            c.tokens.extend(view[len(c.tokens) :])
        else:
            self.forget(block)
            if link.parent_cid is None:
                return  # the parent lost its identity, so nothing can prove what this block follows
            c = BlockContent(link, self.group_key(link), list(view), namespace=namespace)
            self._content[block] = c
        if len(c.tokens) == self.block_size and c.cid is None:
            c.hash = full_hash
            c.cid = self._content_id(c)
        # Pending: tokens the next commit publishes. A rewrite of tokens the block holds and has published adds
        # none, and may come after the step's commit (a draft accepted in a block a hit shared).
        if c.committed < len(c.tokens):
            self._pending.add(block)

    def _content_id(self, c: BlockContent) -> int:
        # A block filled with exactly the content of a committed one shares its id, so chains continued
        # from either copy remain findable from the copy the hash map points at.
        other = self._by_hash.get(c.hash) if c.hash is not None else None
        if other is not None:
            o = self._content[other]
            if o.tokens == c.tokens and o.link.extra == c.link.extra and o.link.parent_cid == c.link.parent_cid:
                assert o.cid is not None
                return o.cid
        self._next_cid += 1
        return self._next_cid - 1

    def commit(self) -> int:
        """Everything written so far is now in the pool: make it findable. Returns blocks published."""
        published = len(self._pending)
        for block in self._pending:
            c = self._content[block]
            if self.token_granularity:
                self._trie_insert(block, c, len(c.tokens))
            c.committed = len(c.tokens)
            if c.hash is not None and c.hash not in self._by_hash:
                self._by_hash[c.hash] = block
        self._pending.clear()
        return published

    def discard_pending(self, block: int) -> None:
        """The block's last holder left before its pending writes happened: keep only committed tokens."""
        if block not in self._pending:
            return
        c = self._content[block]
        if c.committed == 0:
            self.forget(block)
            return
        self._pending.discard(block)
        del c.tokens[c.committed :]
        c.hash = c.cid = None  # pending means tokens past the committed ones: what is left is not full

    def forget(self, block: int) -> bool:
        """Drop the block's identity (evicted, overwritten or reset). Returns whether it was findable."""
        was_cached = self.is_cached(block)
        c = self._content.pop(block, None)
        if c is None:
            return False
        self._pending.discard(block)
        if c.hash is not None and self._by_hash.get(c.hash) == block:
            del self._by_hash[c.hash]
        if self.token_granularity and c.committed:
            self._trie_remove(block, c)
        return was_cached

    def reset(self) -> None:
        self._content.clear()
        self._by_hash.clear()
        self._roots.clear()
        self._edges.clear()
        self._first.clear()
        self._more.clear()
        self._pending.clear()

    # -- trie ------------------------------------------------------------------------------------------
    def _trie_insert(self, block: int, c: BlockContent, upto: int) -> None:
        node = c.tip
        if node is None:
            node = self._roots.get(c.group)
            if node is None:
                node = self._roots[c.group] = self._new_node()
            self._add(node, block)
        for token in c.tokens[c.committed : upto]:
            key = edge_key(node, token)
            child = self._edges.get(key)
            if child is None:
                child = self._edges[key] = self._new_node()
            self._add(child, block)
            node = child
        c.tip = node

    def _trie_remove(self, block: int, c: BlockContent) -> None:
        root = node = self._roots[c.group]
        self._discard(root, block)
        for token in c.tokens[: c.committed]:
            key = edge_key(node, token)
            node = self._edges[key]
            if self._discard(node, block):  # nothing else passes through here, nor through the rest of the path
                del self._edges[key]
        if root not in self._first:
            del self._roots[c.group]

    def _new_node(self) -> int:
        self._next_node += 1
        return self._next_node - 1

    def _add(self, node: int, block: int) -> None:
        first = self._first.setdefault(node, block)
        if first != block:
            self._more.setdefault(node, set()).add(block)

    def _discard(self, node: int, block: int) -> bool:
        """``block`` no longer passes through ``node``; whether nothing does now."""
        more = self._more.get(node)
        if self._first.get(node) == block:
            if not more:
                del self._first[node]
                return True
            self._first[node] = more.pop()
        elif more is not None:
            more.discard(block)
        if more is not None and not more:
            del self._more[node]
        return node not in self._first

    # -- read-only views (for invariants, tests and the trace) ----------------------------------------
    def is_cached(self, block: int) -> bool:
        """Whether a lookup can find this block right now."""
        c = self._content.get(block)
        if c is None:
            return False
        if c.hash is not None and self._by_hash.get(c.hash) == block:
            return True
        return self.token_granularity and c.committed > 0

    def findable(self) -> list[tuple[int, int]]:
        """(block, committed tokens) of every block a lookup can find now."""
        return [(b, c.committed) for b, c in self._content.items() if c.committed and self.is_cached(b)]

    def cid_of(self, block: int) -> int | None:
        c = self._content.get(block)
        return None if c is None else c.cid

    def content(self, block: int) -> BlockContent | None:
        return self._content.get(block)

    def keys(self) -> dict[int, int]:
        """Hash key -> block, for every findable full block."""
        return dict(self._by_hash)

    def pending(self) -> set[int]:
        return set(self._pending)

    def contents(self) -> dict[int, BlockContent]:
        return dict(self._content)

    def trie_nodes(self) -> int:
        """Every trie node kept, each group's root included: the tries' memory (a node but a root is one edge)."""
        return len(self._roots) + len(self._edges)

    def trie_paths(self) -> dict[int, list[tuple[tuple, tuple[int, ...]]]]:
        """For every block in a trie, each (group, path) of a node that lists it (roots aside)."""
        children = self._children()
        out: dict[int, list[tuple[tuple, tuple[int, ...]]]] = {}
        for group, root in self._roots.items():
            stack: list[tuple[int, tuple[int, ...]]] = [(root, ())]
            while stack:
                node, path = stack.pop()
                for token, child in children.get(node, ()):
                    child_path = (*path, token)
                    for block in (self._first[child], *self._more.get(child, ())):
                        out.setdefault(block, []).append((group, child_path))
                    stack.append((child, child_path))
        return out

    def _children(self) -> dict[int, list[tuple[int, int]]]:
        out: dict[int, list[tuple[int, int]]] = {}
        for key, child in self._edges.items():
            node, token = edge_of(key)
            out.setdefault(node, []).append((token, child))
        return out
