"""Block keys of the prefix index: a hash chain over full blocks.

``h_i = H(h_{i-1}, tokens_i, extra_i)``. Because every key folds in its parent, equal keys mean equal
prefixes (up to collisions of H), so a lookup can walk a prompt block by block. ``extra`` carries anything
besides the tokens that changes K/V, or the namespace a block is in; today that is the tenant's cache salt.
A :class:`Keying` says which block index carries it: block ``P`` (the request's first private block, ``P = 0``
without a public prefix), from where it reaches every later block through the chain. Blocks ``0 .. P-1`` carry
no salt: they are *public*, findable under any salt.

``"weak"`` is a deliberately broken H for the experiment: a 16-bit, order-blind sum, so two prompts that
differ by a swap of two tokens get the same key.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

Extra = tuple[tuple[str, object], ...]

WEAK_BITS = 16


def salt_extra(salt: str | None) -> Extra:
    """Extra keys of a request's first private block for this cache salt (none without one)."""
    return () if salt is None else (("salt", salt),)


@dataclass(frozen=True)
class Keying:
    """How one request's blocks are keyed: the namespace of each block index.

    Blocks ``0 .. public_blocks-1`` are *public*: keyed with no salt, so a lookup under any salt finds them
    (given equal tokens from position 0: the chain and the verification compare every one). Block
    ``public_blocks`` carries the salt in its extra keys, and every later block inherits it through the
    hash chain: they are *private* to the salt, found only under this very keying. ``Keying(salt)`` (no public
    blocks) puts the salt in block 0, as before public prefixes existed. Without a salt every block is public
    (the salt-free namespace is the public one), so ``public_blocks`` is normalised to 0 then: the keys are
    the same either way.
    """

    salt: str | None = None
    public_blocks: int = 0

    def __post_init__(self) -> None:
        n = self.public_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"Keying.public_blocks must be an int >= 0, got {n!r}")
        if self.salt is None and n:
            object.__setattr__(self, "public_blocks", 0)

    @classmethod
    def of(cls, salt: str | None, public_prefix_tokens: int, block_size: int) -> Keying:
        """The keying of a request whose first ``public_prefix_tokens`` tokens are public: only the FULL blocks
        among them are (floor), so a block holding both public and private tokens is private."""
        if isinstance(public_prefix_tokens, bool) or not isinstance(public_prefix_tokens, int):
            raise ValueError(f"public_prefix_tokens must be an int, got {public_prefix_tokens!r}")
        if public_prefix_tokens < 0:
            raise ValueError(f"public_prefix_tokens must be >= 0, got {public_prefix_tokens}")
        return cls(salt, public_prefix_tokens // block_size)

    def extra(self, i: int) -> Extra:
        """Extra keys of block ``i``: the salt at the first private block, nothing elsewhere."""
        return salt_extra(self.salt) if i == self.public_blocks else ()

    def namespace(self, i: int) -> str | None:
        """The salt block ``i`` is private to; None: the block is public."""
        return None if i < self.public_blocks else self.salt

    def public_tokens(self, block_size: int) -> int | None:
        """How many leading tokens lie in public blocks; None: all of them (no salt)."""
        return None if self.salt is None else self.public_blocks * block_size

    def agrees(self, other: Keying, num_blocks: int) -> bool:
        """Whether both keyings key the first ``num_blocks`` blocks alike, so that equal tokens share them."""
        if self == other:
            return True
        # Different keyings agree exactly on the blocks public under both (a salt-free keying: all of them).
        limit = min(b.public_blocks if b.salt is not None else num_blocks for b in (self, other))
        return num_blocks <= limit


def _check_extra(extra: Extra) -> None:
    # Every extra key is tagged by its kind, so a salt "x" can never be confused with some other key "x".
    for item in extra:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"extra keys must be (kind, value) tuples such as ('salt', s), got {item!r}")


def _encode(parent: int | None, tokens: Sequence[int], extra: Extra) -> bytes:
    # A tag byte and a length prefix keep the encoding unambiguous: no (parent, tokens, extra) triple
    # serialises to the same bytes as another one.
    head = b"\x00" if parent is None else b"\x01" + parent.to_bytes(32, "big")
    body = array("q", tokens).tobytes()
    return head + struct.pack("<I", len(tokens)) + body + repr(extra).encode()


def hash_block(parent: int | None, tokens: Sequence[int], extra: Extra = (), algo: str = "sha256") -> int:
    """Key of a full block given its parent's key (None for block 0), its tokens and its extra keys."""
    _check_extra(extra)
    if algo == "sha256":
        return int.from_bytes(hashlib.sha256(_encode(parent, tokens, extra)).digest(), "big")
    if algo == "xxh64":
        return xxhash.xxh64_intdigest(_encode(parent, tokens, extra))
    if algo == "weak":
        total = (parent or 0) + sum(tokens) + sum(repr(extra).encode())
        return total & ((1 << WEAK_BITS) - 1)
    raise ValueError(f"unknown hash algo {algo!r}; expected sha256, xxh64 or weak")
