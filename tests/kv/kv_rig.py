"""A miniature engine for KV cache tests: manager + storage + sanitizer, driven as the engine drives them.

Every write stores synthetic K/V that encodes (token, position, prefix digest, writer, layer), so a read
can be checked twice over: by the sanitizer's shadow and by decoding what the storage really returned. Each
request's namespace (its salt and public blocks) is remembered too, so both can tell a read of another salt's
private K/V from a read of a public block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvlab.config import CacheConfig
from kvlab.instrument.sanitizer import KVSanitizer, Namespace, Violation, prefix_digests
from kvlab.instrument.trace import Trace
from kvlab.kv import Allocation, KVCacheManager, KVStorage, check_invariants

# The rig's default tenant of a request: its salt (a sentinel, since None is a tenant: the engine's default one).
SAME: str | None = "\x00same-as-salt"
CTX_BITS = 40  # the digest is stored modulo 2**40: exact in float64
NUM_LAYERS = 2


class Rig:
    def __init__(self, config: CacheConfig, trace: Trace | None = None, num_kv_heads: int = 2) -> None:
        self.config = config
        self.storage = KVStorage(
            NUM_LAYERS,
            config.num_blocks,
            config.block_size,
            num_kv_heads,
            4,
            layout=config.layout,
            dtype=torch.float64,
        )
        self.m = KVCacheManager(config, trace, block_nbytes=self.storage.block_nbytes)
        self.san = KVSanitizer(config.num_blocks, config.block_size, config.promote_after)
        self.step = 0
        self.tokens: dict[str, list[int]] = {}  # each live request's own tokens, position order
        # Every request's namespace, kept after it is freed: its writes outlive it in cached blocks.
        self.namespaces: dict[str, Namespace] = {}
        self._writer_code: dict[str, int] = {}
        # promote_after: (position, prefix digest) -> the tenants whose requests wrote that content under a salt (the
        # rig's own count, from what it wrote, for crossed())
        self._tenants_of: dict[tuple[int, int], set[str | None]] = {}

    # -- driving ---------------------------------------------------------------------------------------
    def admit(
        self, rid: str, prompt: Sequence[int], salt: str | None = None, public: int = 0, tenant: str | None = SAME
    ) -> int | None:
        """Admission alone (no slots yet): the number of cached tokens, or None if refused. ``public``: the
        request's public prefix, in tokens; ``tenant``: the party promotion counts it as (default: its salt, a
        tenant of its own, as the server's per-tenant salts are until a client adds a ``cache_salt``)."""
        tenant = salt if tenant is SAME else tenant
        alloc = self.m.allocate(rid, prompt, salt, num_tokens=0, public_prefix_tokens=public, tenant=tenant)
        if not alloc.ok:
            return None
        self.namespaces[rid] = Namespace(salt, public // self.config.block_size, tenant)
        self.storage.copy_blocks(alloc.copies)  # a partial hit may be copied at admission
        self.san.copy_blocks(alloc.copies)
        self.tokens[rid] = list(prompt[: alloc.num_cached_tokens])
        return alloc.num_cached_tokens

    def feed(self, rid: str, tokens: Sequence[int], commit: bool = True) -> Allocation | None:
        """One engine step of one request: slots, copies, K/V writes, commit."""
        self.step += 1
        alloc = self.m.append_slots(rid, tokens)
        if not alloc.ok:
            return None
        self.apply(rid, tokens, alloc)
        if commit:
            self.m.commit_writes()
        return alloc

    def apply(self, rid: str, tokens: Sequence[int], alloc: Allocation) -> None:
        """What the runner does with an allocation: copies first, then the writes."""
        self.storage.copy_blocks(alloc.copies)
        self.san.copy_blocks(alloc.copies)
        start = len(self.tokens[rid])
        self.tokens[rid] += list(tokens)
        positions = list(range(start, start + len(tokens)))
        ctx = prefix_digests(self.tokens[rid])[start:]
        slots = torch.tensor(alloc.slots, dtype=torch.long)
        for layer in range(NUM_LAYERS):
            k = self._encode(rid, tokens, positions, ctx, layer)
            self.storage.write(layer, slots, k, -k)
        self.san.record_write(rid, alloc.slots, list(tokens), positions, self.step, ctx, self.namespace(rid))
        ns = self.namespace(rid)
        if ns.salt is not None:  # salt-free writes are public already
            for p, c in zip(positions, ctx, strict=True):
                self._tenants_of.setdefault((p, c), set()).add(ns.tenant)

    def prefill(
        self, rid: str, prompt: Sequence[int], salt: str | None = None, public: int = 0, tenant: str | None = SAME
    ) -> int | None:
        """One step that admits the request and computes its whole prompt, as the engine does (``tenant`` as in
        :meth:`admit`)."""
        self.step += 1
        tenant = salt if tenant is SAME else tenant
        alloc = self.m.allocate(rid, prompt, salt, public_prefix_tokens=public, tenant=tenant)
        if not alloc.ok:
            return None
        self.namespaces[rid] = Namespace(salt, public // self.config.block_size, tenant)
        self.tokens[rid] = list(prompt[: alloc.num_cached_tokens])
        self.apply(rid, prompt[alloc.num_cached_tokens :], alloc)
        self.m.commit_writes()
        return alloc.num_cached_tokens

    def fork(self, parent: str, child: str) -> list[tuple[int, int]]:
        """Fork, and apply the copies it returns (cow_check="allocate" copies the shared partial block now)."""
        copies = self.m.fork(parent, child)
        self.storage.copy_blocks(copies)
        self.san.copy_blocks(copies)
        self.tokens[child] = list(self.tokens[parent])
        if parent in self.namespaces:
            self.namespaces[child] = self.namespaces[parent]
        return copies

    def free(self, rid: str) -> None:
        self.m.free(rid)
        del self.tokens[rid]

    # -- reading ---------------------------------------------------------------------------------------
    def check(self, rid: str) -> list[Violation]:
        """Sanitizer verdict on reading the request's whole context."""
        toks = self.tokens[rid]
        assert self.m.num_computed_tokens(rid) == len(toks)
        slots = self.storage.context_slots(self.m.block_table(rid), len(toks)).tolist()
        ns = self.namespace(rid)
        return self.san.check_read(rid, slots, toks, list(range(len(toks))), self.step, prefix_digests(toks), ns)

    def namespace(self, rid: str) -> Namespace:
        """The request's namespace as the rig admitted it (a test that admitted it by hand: the manager's)."""
        if rid not in self.namespaces:
            keying = self.m.keying(rid)
            self.namespaces[rid] = Namespace(keying.salt, keying.public_blocks, keying.salt)
        return self.namespaces[rid]

    def tenants_that_wrote(self, tokens: Sequence[int]) -> set[str | None]:
        """The tenants whose requests wrote, under a salt, the last of ``tokens`` after the rest (with promotion)."""
        return self._tenants_of.get((len(tokens) - 1, prefix_digests(tokens)[-1]), set())

    def foreign(self, rid: str) -> dict[int, str]:
        """Positions whose K/V, as the storage returns it, is not the request's own -> who wrote it."""
        toks = self.tokens[rid]
        ctx = prefix_digests(toks)
        bad: dict[int, str] = {}
        for layer in range(NUM_LAYERS):
            k, v = self.storage.gather_context(layer, self.m.block_table(rid), len(toks))
            want = self._encode(rid, toks, range(len(toks)), ctx, layer)
            same = (k[..., :3] == want[..., :3]).all(-1).all(-1) & (k[..., 3] % 16 == layer).all(-1)
            same &= (v == -k).flatten(1).all(-1)
            for p in torch.nonzero(~same).flatten().tolist():
                bad[p] = self._writer_name(int(k[p, 0, 3].item()) // 16)
        return bad

    def crossed(self, rid: str) -> dict[int, str]:
        """Positions whose K/V, as the storage returns it, was written under another salt outside the blocks
        both requests declared public (and, with promote_after = K, not written by K tenants) -> who wrote it (the
        storage's own word, apart from the sanitizer's)."""
        mine = self.namespace(rid)
        bs = self.config.block_size
        k_promote = self.config.promote_after
        ctx = prefix_digests(self.tokens[rid])

        def public(ns: Namespace, pos: int) -> bool:
            return ns.salt is None or pos // bs < ns.public_blocks

        toks = self.tokens[rid]
        k, _ = self.storage.gather_context(0, self.m.block_table(rid), len(toks))
        bad: dict[int, str] = {}
        for p in range(len(toks)):
            writer = self._writer_name(int(k[p, 0, 3].item()) // 16)
            theirs = self.namespaces.get(writer)
            if theirs is None or theirs.salt == mine.salt:
                continue
            if k_promote is not None and len(self._tenants_of.get((p, ctx[p]), ())) >= k_promote:
                continue  # content K tenants computed: promoted, public
            if not (public(theirs, p) and public(mine, p)):
                bad[p] = writer
        return bad

    def snapshot(self) -> tuple:
        """Everything a failed call must leave unchanged."""
        m = self.m
        index = m.index
        return (
            [m.refcount(b) for b in range(m.num_blocks)],
            m.pool.free_order(),
            {r: (m.block_table(r), m.num_computed_tokens(r)) for r in m.request_ids()},
            m.cow_reserve(),
            dataclasses.asdict(m.stats),
            None if index is None else (index.keys(), repr(sorted(index.contents().items()))),
        )

    # -- synthetic K/V ---------------------------------------------------------------------------------
    def _encode(self, rid, tokens, positions, ctx, layer) -> torch.Tensor:
        code = self._writer_code.setdefault(rid, len(self._writer_code) + 1)
        rows = [[t, p, c % (1 << CTX_BITS), code * 16 + layer] for t, p, c in zip(tokens, positions, ctx, strict=True)]
        k = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), 1, 4)
        return k.expand(len(rows), self.storage.num_kv_heads, 4).clone()

    def _writer_name(self, code: int) -> str:
        names = {c: r for r, c in self._writer_code.items()}
        return names.get(code, "<never written>")


BS = 4  # the block size of the small pools the scenario tests use


def cfg(**kw) -> CacheConfig:
    """A 10-block pool of BS-token blocks, with overrides."""
    return CacheConfig(**{"block_size": BS, "num_blocks": 10, **kw})


def clean(rig: Rig, *rids: str) -> None:
    """These requests read only their own K/V, nothing of another salt outside public blocks, and the manager's
    invariants hold."""
    for rid in rids:
        assert rig.check(rid) == []
        assert rig.foreign(rid) == {}
        assert rig.crossed(rid) == {}
    check_invariants(rig.m)
