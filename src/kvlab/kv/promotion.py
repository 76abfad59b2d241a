"""Promotion by popularity (``CacheConfig.promote_after = K``): a block chain that K distinct *tenants* computed
becomes public.

Every full prompt block of a salted request also has a *public key*: the chain key it would have if it were
public (no salt anywhere in its chain, :mod:`kvlab.kv.hashing`), a function of its tokens from position 0
alone. When the request computes such a block under its own salt (writes it, rather than finding it in the
cache), its tenant is noted for that key; the note counts once the step's writes are committed, and is dropped
if the request is freed first (a failed forward pass writes nothing). Once K distinct tenants have counted for a
key it is *promoted*: from then on the leading promoted blocks of any prompt are keyed without salt
(:meth:`Popularity.promoted_blocks`), so every tenant shares one public copy of them. The copies the K tenants
computed under their salts stay private; the next request to need the chain computes (or finds) the public one.

Parties are tenants, never salts. A salt is the client's to choose inside its tenant (the server derives the
engine's salt from the tenant and the client's ``cache_salt``), so counting salts would let one API key count as
K parties: send a guess under K - 1 salts and read the next send's hit to learn whether anyone else sent it, or
promote a guess alone and watch for another tenant's later send. The tenant is the identity the operator hands
out (an API key maps to one; a key-less server has one anonymous tenant; an engine request without one belongs
to the one default tenant, ``None``), so all the salts of a tenant are one party.

What a tenant can observe: nothing before promotion (counting changes no lookup), and afterwards what every
tenant observes of a public block. So promotion is only as strong as the operator's control of tenants: an
attacker who holds ``a`` tenants (API keys) and sends a guessed prefix from each learns, by a hit on the next
request, whether at least ``K - a`` *other* tenants computed that prefix. With ``a = K - 1`` keys that is a
membership test of one guess against every other tenant's prompts, at the price of K requests per guess; with
fewer keys a guess can never be promoted by the attacker's sends and one victim's together, so it tells nothing.

Public keys are always SHA-256, whatever ``CacheConfig.hash_algo`` the index uses: a collision here would make a
prompt nobody else sent public, and nothing downstream would catch it (the index verifies tokens, so it would
share nothing wrong, but the request's own private blocks would then be stored where every tenant finds them).

Memory is bounded: at most ``capacity`` keys are remembered, least recently counted or used forgotten first.
Forgetting a key delays its promotion or takes it back (its blocks become private again): it never makes
anything public.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvlab.kv.hashing import hash_block

PROMOTED = None  # the value of a promoted key in Popularity's table; a set of tenants while still counting
Tenant = str | None  # None: the engine's default tenant (requests added without one)


class Popularity:
    def __init__(self, promote_after: int, capacity: int, block_size: int) -> None:
        if promote_after < 2 or capacity < 1:
            raise ValueError(f"Popularity needs promote_after >= 2 and capacity >= 1, got {promote_after}, {capacity}")
        self.promote_after = promote_after
        self.capacity = capacity
        self.block_size = block_size
        self._keys: OrderedDict[int, set[Tenant] | None] = OrderedDict()  # key -> tenants counted, or PROMOTED
        self._pending: dict[str, list[tuple[Tenant, int]]] = {}  # request -> (tenant, key) noted this step
        self.promotions = 0

    def public_keys(self, prompt: Sequence[int]) -> list[int]:
        """The public chain key of each full block of ``prompt``."""
        bs, keys = self.block_size, []
        parent: int | None = None
        for i in range(len(prompt) // bs):
            parent = hash_block(parent, prompt[i * bs : (i + 1) * bs], (), "sha256")
            keys.append(parent)
        return keys

    def promoted_prefix(self, prompt: Sequence[int], start: int = 0) -> int:
        """``promoted_blocks(public_keys(prompt), start)``, hashing no further than the first block that is not
        promoted: what a lookup needs (the scheduler looks up a waiting prompt several times per admission)."""
        bs, parent = self.block_size, None
        for i in range(len(prompt) // bs):
            parent = hash_block(parent, prompt[i * bs : (i + 1) * bs], (), "sha256")
            if i >= start and not self.is_promoted(parent):
                return i
        return max(start, len(prompt) // bs)

    def promoted_blocks(self, keys: Sequence[int], start: int = 0) -> int:
        """How many leading blocks are public: the ``start`` already public (declared), then every promoted key
        that follows them. No side effect (a lookup must not change what it looks up)."""
        n = start
        while n < len(keys) and self.is_promoted(keys[n]):
            n += 1
        return n

    def note(self, request_id: str, tenant: Tenant, key: int) -> None:
        """``request_id``, of ``tenant``, computed the block of public key ``key`` under its salt; counts at
        :meth:`commit`."""
        self._pending.setdefault(request_id, []).append((tenant, key))

    def discard(self, request_id: str) -> None:
        """The request is gone before its notes were committed: they never count."""
        self._pending.pop(request_id, None)

    def commit(self) -> int:
        """Count the notes of the step; returns the keys promoted by them."""
        promoted = 0
        for notes in self._pending.values():
            for tenant, key in notes:
                tenants = self._keys.get(key, set())
                if tenants is PROMOTED:
                    self._keys.move_to_end(key)
                    continue
                tenants.add(tenant)
                if len(tenants) >= self.promote_after:
                    self._keys[key] = PROMOTED
                    promoted += 1
                else:
                    self._keys[key] = tenants
                self._keys.move_to_end(key)
        self._pending.clear()
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        self.promotions += promoted
        return promoted

    def touch(self, keys: Sequence[int]) -> None:
        """The promoted keys among ``keys`` were used: forget them last."""
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)

    def reset(self) -> None:
        self._keys.clear()
        self._pending.clear()

    def num_tracked(self) -> int:
        return len(self._keys)

    def is_promoted(self, key: int) -> bool:
        return key in self._keys and self._keys[key] is PROMOTED
