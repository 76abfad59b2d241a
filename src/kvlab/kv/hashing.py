"""Block keys of the prefix index: a hash chain over full blocks.

``h_i = H(h_{i-1}, tokens_i, extra_i)``. Because every key folds in its parent, equal keys mean equal
prefixes (up to collisions of H), so a lookup can walk a prompt block by block. ``extra`` carries anything
besides the tokens that changes K/V; today that is the tenant's cache salt, which enters block 0 only and
reaches every later block through the chain.

``"weak"`` is a deliberately broken H for the experiment: a 16-bit, order-blind sum, so two prompts that
differ by a swap of two tokens get the same key.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

import xxhash

Extra = tuple[tuple[str, object], ...]

WEAK_BITS = 16


def salt_extra(salt: str | None) -> Extra:
    """Extra keys of block 0 for a request with this cache salt (none without one)."""
    return () if salt is None else (("salt", salt),)


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
