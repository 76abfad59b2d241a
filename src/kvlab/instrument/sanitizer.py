"""KV sanitizer: a shadow of the pool that catches a request reading K/V that is not its own.

For every slot the shadow keeps what was last written there: token id, position, writer, step and, when
the engine provides it, a digest of the writer's whole prefix up to that position. K/V at position p is a
function of every token up to p, so a slot whose token and position match but whose prefix differs is
foreign state too; the digest catches that. A read is correct when each slot attended to holds the
reader's own token at that position (and prefix). Sharing with another writer is fine as long as the
content is the same -- that is what prefix caching does.

Sharing across namespaces is another matter. Given each request's :class:`Namespace` (its cache salt and how
many leading blocks it declared public), the shadow also records, per slot, the writer's namespace and whether
the slot lies in one of the writer's public blocks. A read of a slot written under another salt is then a
violation of kind ``"cross-tenant"`` unless the slot is public for the writer *and* lies in a public block of
the reader: the prefix cache may share what both declared public, never a tenant's private blocks, even when
their content is identical (the hit itself is the side channel). The salt-free namespace is public throughout.

With promotion (``promote_after = K``, :mod:`kvlab.kv.promotion`) a read across namespaces is also allowed where
the shadow itself saw K distinct *tenants* write that very content under a salt: the same token at that position
after the same prefix (its digest). The shadow counts those tenants on its own, from the writes it is told of (the
namespace's ``tenant``; the salts of one tenant are one party), so it checks the KV manager's promotions rather
than trusting them.

The checks are numpy operations over the slots read, so keeping the sanitizer on in tests is cheap.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

_UNSET = -1
FINDABLE = "(prefix index)"  # the reader of a check_findable violation: the index offering the slot to any lookup
_MOD = (1 << 61) - 1  # a Mersenne prime: the rolling digest stays exact in Python ints and fits int64
_BASE = 1_000_003


def prefix_digests(tokens: Iterable[int], start: int = 0) -> list[int]:
    """Per-position digest of a token sequence's whole prefix; ``start`` is the digest before it."""
    out = []
    d = start
    for t in tokens:
        d = (d * _BASE + t + 1) % _MOD
        out.append(d)
    return out


@dataclass(frozen=True)
class Violation:
    """A read of state that is not the reader's own. ``block == -1`` marks a batch-row read (``slot`` is
    then the row): the zero-length-request leak, which happens outside the pool."""

    step: int
    reader: str
    block: int
    slot: int
    position: int
    expected_token: int
    found_token: int | None  # None: the slot was never written
    found_position: int | None
    writer: str | None
    written_step: int | None
    # "foreign": not the reader's own token, position or prefix; "cross-tenant": the reader's own content, but
    # written under another namespace and outside the blocks both declared public; "draft": a speculative draft
    # token's K/V never verified, read by another request or by its writer after the step that wrote it.
    kind: str = "foreign"

    def explain(self) -> str:
        if self.block < 0:
            # Not a cache slot: a batch row (the runner's check of which row each request samples from).
            return (
                f"step {self.step}: request {self.reader} has no token of its own yet sampled batch row "
                f"{self.slot}, the hidden state of token {self.found_token} at pos {self.found_position} "
                f"written by request {self.writer} at step {self.written_step}"
            )
        if self.kind == "draft" and self.reader == FINDABLE:
            return (
                f"step {self.step}: block {self.block} slot {self.slot} (pos {self.position}) is findable by the "
                f"prefix index but holds a speculative draft token {self.found_token} of request {self.writer} "
                f"(written at step {self.written_step}) that was never verified"
            )
        if self.kind == "draft":
            return (
                f"step {self.step}: request {self.reader} read block {self.block} slot {self.slot} "
                f"(pos {self.position}) holding a speculative draft token of request {self.writer} (written at "
                f"step {self.written_step}) that was never verified: a rejected draft reached a later read"
            )
        if self.kind == "cross-tenant":
            return (
                f"step {self.step}: request {self.reader} read block {self.block} slot {self.slot} "
                f"(pos {self.position}) written by request {self.writer} at step {self.written_step} under "
                "another cache salt, outside the public blocks of one of them"
            )
        head = (
            f"step {self.step}: request {self.reader} read block {self.block} slot {self.slot} "
            f"(pos {self.position}): expected token {self.expected_token} at pos {self.position}, "
        )
        if self.found_token is None:
            return head + "found a slot never written"
        found = f"found token {self.found_token} at pos {self.found_position}"
        if self.found_token == self.expected_token and self.found_position == self.position:
            found += " computed after a different prefix"
        return head + f"{found} written by request {self.writer} at step {self.written_step}"


@dataclass(frozen=True)
class Namespace:
    """Whose prefix-cache namespace a request writes and reads in: its cache salt (None: the public namespace,
    where every block is public), how many of its leading blocks are public (keyed without the salt), and the
    tenant it belongs to (the party promotion counts; None: the default tenant)."""

    salt: str | None
    public_blocks: int = 0
    tenant: str | None = None


class KVSanitizer:
    def __init__(self, num_blocks: int, block_size: int, promote_after: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.promote_after = promote_after
        # promote_after: (position, prefix digest) -> the tenants that wrote it under a salt
        self._tenants_of: dict[tuple[int, int], set[str | None]] = {}
        n = num_blocks * block_size
        self._token = np.full(n, _UNSET, dtype=np.int64)
        self._position = np.full(n, _UNSET, dtype=np.int64)
        self._writer = np.full(n, _UNSET, dtype=np.int64)  # index into self._writers
        self._step = np.full(n, _UNSET, dtype=np.int64)
        self._context = np.zeros(n, dtype=np.int64)
        self._has_context = np.zeros(n, dtype=bool)
        self._namespace = np.full(n, _UNSET, dtype=np.int64)  # the writer's salt id (_salt_ids); unset: not told
        self._public = np.zeros(n, dtype=bool)  # the slot lies in a public block of its writer
        self._draft = np.zeros(n, dtype=bool)  # the slot holds a speculative draft token not (yet) verified
        self._reported_findable: set[tuple[int, int]] = set()  # (slot, step written): reported by check_findable
        self._salt_ids: dict[str | None, int] = {}
        self._writers: list[str] = []
        self._writer_ids: dict[str, int] = {}
        self.violations: list[Violation] = []

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self._token,
            self._position,
            self._writer,
            self._step,
            self._context,
            self._has_context,
            self._namespace,
            self._public,
            self._draft,
        )

    def _writer_id(self, request_id: str) -> int:
        if request_id not in self._writer_ids:
            self._writer_ids[request_id] = len(self._writers)
            self._writers.append(request_id)
        return self._writer_ids[request_id]

    def _salt_id(self, salt: str | None) -> int:
        return self._salt_ids.setdefault(salt, len(self._salt_ids))

    def _in_public_blocks(self, namespace: Namespace, positions: np.ndarray) -> np.ndarray:
        if namespace.salt is None:
            return np.ones(len(positions), dtype=bool)
        return positions // self.block_size < namespace.public_blocks

    def record_write(
        self,
        request_id: str,
        slots: Sequence[int],
        token_ids: Sequence[int],
        positions: Sequence[int],
        step: int,
        context: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        num_draft: int = 0,
    ) -> None:
        """``namespace``: the writer's (None: not known, and reads of these slots are not checked for it).
        ``num_draft``: the last this many slots take a speculative draft: unverified until :meth:`accept_draft`
        says otherwise, and no other request may read them. A draft token written over the same content, verified
        (a cached token it repeats), leaves that slot verified."""
        idx = np.asarray(slots, dtype=np.int64)
        draft = np.zeros(len(idx), dtype=bool)
        if num_draft:
            draft[len(idx) - num_draft :] = True
            same = (
                ~self._draft[idx]
                & (self._token[idx] == np.asarray(token_ids, dtype=np.int64))
                & (self._position[idx] == np.asarray(positions, dtype=np.int64))
            )
            if context is not None:
                same &= self._has_context[idx] & (self._context[idx] == np.asarray(context, dtype=np.int64))
            draft &= ~same
        self._draft[idx] = draft
        self._token[idx] = np.asarray(token_ids, dtype=np.int64)
        self._position[idx] = np.asarray(positions, dtype=np.int64)
        self._writer[idx] = self._writer_id(request_id)
        self._step[idx] = step
        if context is None:
            self._has_context[idx] = False
        else:
            self._context[idx] = np.asarray(context, dtype=np.int64)
            self._has_context[idx] = True
        if namespace is None:
            self._namespace[idx] = _UNSET
            self._public[idx] = False
        else:
            self._namespace[idx] = self._salt_id(namespace.salt)
            self._public[idx] = self._in_public_blocks(namespace, np.asarray(positions, dtype=np.int64))
            if self.promote_after is not None and context is not None and namespace.salt is not None:
                for pos, ctx, unverified in zip(positions, context, draft.tolist(), strict=True):
                    if not unverified:  # a draft counts once verified (accept_draft)
                        self._tenants_of.setdefault((int(pos), int(ctx)), set()).add(namespace.tenant)

    def accept_draft(self, slots: Sequence[int], namespace: Namespace | None = None) -> None:
        """The draft tokens in ``slots`` were verified: the writer's own tokens now, readable as any other."""
        idx = np.asarray(slots, dtype=np.int64)
        self._draft[idx] = False
        if self.promote_after is not None and namespace is not None and namespace.salt is not None:
            for slot in idx.tolist():
                if self._has_context[slot]:
                    key = (int(self._position[slot]), int(self._context[slot]))
                    self._tenants_of.setdefault(key, set()).add(namespace.tenant)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Mirror :meth:`KVStorage.copy_blocks`: the copy carries the original writer's record."""
        bs = self.block_size
        for src, dst in copies:
            for arr in self._arrays():
                arr[dst * bs : (dst + 1) * bs] = arr[src * bs : (src + 1) * bs]

    def check_read(
        self,
        request_id: str,
        slots: Sequence[int],
        token_ids: Sequence[int],
        positions: Sequence[int],
        step: int,
        context: Sequence[int] | None = None,
        namespace: Namespace | None = None,
    ) -> list[Violation]:
        """Report every slot read whose shadow is not the reader's own token at that position; with the reader's
        ``namespace``, also every slot of another namespace read outside the blocks both declared public."""
        idx = np.asarray(slots, dtype=np.int64)
        want_tok = np.asarray(token_ids, dtype=np.int64)
        want_pos = np.asarray(positions, dtype=np.int64)
        bad = (self._token[idx] != want_tok) | (self._position[idx] != want_pos)
        if context is not None:
            want_ctx = np.asarray(context, dtype=np.int64)
            bad |= self._has_context[idx] & (self._context[idx] != want_ctx)
        found = []
        for i in np.flatnonzero(bad).tolist():
            found.append(self._violation(step, request_id, int(idx[i]), int(want_pos[i]), int(want_tok[i])))
        # A draft is readable only by the query of the step that wrote it, in its writer's own rows.
        unverified = self._draft[idx] & ~bad
        unverified &= (self._writer[idx] != self._writer_ids.get(request_id, _UNSET)) | (self._step[idx] != step)
        for i in np.flatnonzero(unverified).tolist():
            found.append(self._violation(step, request_id, int(idx[i]), int(want_pos[i]), int(want_tok[i]), "draft"))
        bad |= unverified
        if namespace is not None:
            theirs = self._namespace[idx]
            crossed = (theirs != _UNSET) & (theirs != self._salt_id(namespace.salt))
            crossed &= ~(self._public[idx] & self._in_public_blocks(namespace, want_pos)) & ~bad
            for i in np.flatnonzero(crossed).tolist():
                slot, pos, tok = int(idx[i]), int(want_pos[i]), int(want_tok[i])
                if self._promoted(slot, pos):
                    continue
                found.append(self._violation(step, request_id, slot, pos, tok, kind="cross-tenant"))
        self.violations += found
        return found

    def check_findable(self, findable: Iterable[tuple[int, int]], step: int) -> list[Violation]:
        """Report every slot the prefix index lets a later request find (``findable``: block and committed
        tokens, ``KVCacheManager.findable``) that holds a draft token never verified, once per write. A read
        of it would be caught by :meth:`check_read`; this catches the draft being offered at all."""
        bs = self.block_size
        found = []
        for block, committed in findable:
            idx = np.arange(block * bs, block * bs + committed)
            for slot in idx[self._draft[idx]].tolist():
                key = (slot, int(self._step[slot]))
                if key in self._reported_findable:
                    continue
                self._reported_findable.add(key)
                found.append(self._violation(step, FINDABLE, slot, int(self._position[slot]), -1, "draft"))
        self.violations += found
        return found

    def _promoted(self, slot: int, position: int) -> bool:
        """Did K distinct tenants write the content this slot holds (its position after its prefix)?"""
        if self.promote_after is None or not self._has_context[slot]:
            return False
        return len(self._tenants_of.get((position, int(self._context[slot])), ())) >= self.promote_after

    def _violation(
        self, step: int, reader: str, slot: int, position: int, expected: int, kind: str = "foreign"
    ) -> Violation:
        """What the shadow holds at ``slot``, as a violation of ``reader`` at ``position``."""
        written = self._token[slot] != _UNSET
        return Violation(
            step=step,
            reader=reader,
            block=slot // self.block_size,
            slot=slot,
            position=position,
            expected_token=expected,
            found_token=int(self._token[slot]) if written else None,
            found_position=int(self._position[slot]) if written else None,
            writer=self._writers[self._writer[slot]] if written else None,
            written_step=int(self._step[slot]) if written else None,
            kind=kind,
        )

    def reset(self) -> None:
        for arr in (self._token, self._position, self._writer, self._step, self._namespace):
            arr.fill(_UNSET)
        self._context.fill(0)
        self._has_context.fill(False)
        self._public.fill(False)
        self._draft.fill(False)
        self._reported_findable.clear()
        self._tenants_of.clear()
        self.violations.clear()
