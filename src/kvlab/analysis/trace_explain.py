"""Replay a KV trace: each request's block history, and where a request read state that is not its own.

The trace records block transitions, not reads, so reads are reconstructed: a request that writes at a
step was scheduled in that step, and a scheduled request attends to every slot of its view of every block
in its table (its view: the slots it hit, had copied on write, or wrote itself). Each slot's provenance
(writer, step) is replayed from the write and CoW events; a slot in a reader's view whose writer is
another request is a *foreign read*:

- ``hit``: the state was already there when the reader took the block (prefix sharing; correct only if
  the prefixes really match, which a weak hash without a token check does not guarantee). A hit whose
  tokens the cache verified against the reader's prompt (``verified`` on the trace's hit event) is a
  *shared* read: the reader's own prefix, computed by another request, and benign;
- ``overwritten``: another request wrote the slot while the reader held the block (sharing without CoW,
  or a block freed while still shared and handed to someone else).

Every read that is not a shared one is *foreign*: contamination, or a hit nobody checked.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvlab.instrument.trace import TraceEvent

TrialKey = tuple[str | None, int | None]  # (strategy, trial); (None, None) for a plain Trace file


def load_trace(path: str | os.PathLike[str]) -> dict[TrialKey, list[TraceEvent]]:
    """Events grouped by trial. Reads both ``Trace(path)`` files (``detail`` nested) and the lines of
    ``kvlab experiment --trace`` (``strategy``/``trial`` added, detail flattened)."""
    out: dict[TrialKey, list[TraceEvent]] = defaultdict(list)
    base = {"step", "op", "request", "block", "refcount"}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from exc
            if not base <= d.keys():
                raise ValueError(f"{path}:{n}: not a trace event (missing {sorted(base - d.keys())})")
            key = (d.pop("strategy", None), d.pop("trial", None))
            detail = d.pop("detail", None) or {k: d.pop(k) for k in list(d) if k not in base}
            out[key].append(TraceEvent(d["step"], d["op"], d["request"], d["block"], d["refcount"], detail))
    return dict(out)


def infer_block_size(events: Iterable[TraceEvent]) -> int:
    """The block size implied by write slots (slot // block_size == block for every write)."""
    lo, hi = 1, 1 << 20
    for e in events:
        if e.op != "write" or e.block is None:
            continue
        for s in e.detail.get("slots", []):
            lo = max(lo, s // (e.block + 1) + 1)  # s < (block + 1) * bs
            if e.block:
                hi = min(hi, s // e.block)  # block * bs <= s
    if lo > hi:
        raise ValueError("write slots are inconsistent with any block size")
    # The engine's block sizes are powers of two; take one inside the feasible range when there is one.
    p = 1
    while p < lo:
        p *= 2
    return p if p <= hi else lo


@dataclass(frozen=True)
class Provenance:
    writer: str | None
    step: int


@dataclass
class ForeignRead:
    step: int
    reader: str
    block: int
    slots: list[int]
    writer: str | None
    written_step: int
    kind: str  # hit | overwritten
    verified: bool = False  # a hit whose tokens the cache compared with the reader's prompt
    chain: list[TraceEvent] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        """A benign read: the reader's own prefix, found by a verified hit, computed by another request."""
        return self.kind == "hit" and self.verified

    @property
    def label(self) -> str:
        if self.shared:
            return "shared (verified hit)"
        return "foreign (hit, unverified)" if self.kind == "hit" else "foreign (overwritten)"

    def headline(self) -> str:
        span = f"slot {self.slots[0]}" if len(self.slots) == 1 else f"slots {self.slots[0]}..{self.slots[-1]}"
        how = {
            "shared (verified hit)": "its own prefix, found by a verified hit when it took the block",
            "foreign (hit, unverified)": "state it found there when it took the block (a hit nobody verified)",
            "foreign (overwritten)": "written while the reader held the block",
        }[self.label]
        return (
            f"step {self.step}: request {self.reader} read block {self.block} {span} "
            f"({len(self.slots)} slots) written by request {self.writer} at step {self.written_step}: {how}"
        )


@dataclass
class Replay:
    block_size: int
    requests: list[str]
    history: dict[str, list[TraceEvent]]
    foreign: list[ForeignRead]
    holders: list[tuple[int, dict[int, set[str]]]]  # (step, block -> requests holding it after that step)


class _Replayer:
    """The cache state rebuilt event by event: tables, views and slot provenance, and what was read."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.prov: dict[int, Provenance] = {}  # slot -> last write
        self.tables: dict[str, dict[int, int]] = defaultdict(dict)  # request -> block -> step it took the block
        self.views: dict[str, set[int]] = defaultdict(set)  # request -> slots it attends to
        self.verified: dict[str, set[int]] = defaultdict(set)  # request -> slots it took by a verified hit
        self.history: dict[str, list[TraceEvent]] = defaultdict(list)
        self.order: list[str] = []
        self.foreign: dict[tuple[str, int, str | None, str, bool], ForeignRead] = {}
        self.holders: list[tuple[int, dict[int, set[str]]]] = []

    def _slots(self, block: int) -> range:
        return range(block * self.bs, (block + 1) * self.bs)

    def end_step(self, step: int, readers: set[str]) -> None:
        """Record the foreign reads of the requests scheduled in ``step``, then who holds which block."""
        for r in sorted(readers):
            for b, taken in self.tables[r].items():
                self._read(step, r, b, taken)
        held: dict[int, set[str]] = defaultdict(set)
        for r, t in self.tables.items():
            for b in t:
                held[b].add(r)
        self.holders.append((step, dict(held)))

    def _read(self, step: int, r: str, b: int, taken: int) -> None:
        by: dict[tuple[str | None, str, bool], list[int]] = defaultdict(list)
        first_write: dict[tuple[str | None, str, bool], int] = {}
        for s in self._slots(b):
            p = self.prov.get(s)
            if s not in self.views[r] or p is None or p.writer == r:
                continue
            # A hit finds only what earlier steps wrote: a write in the step of the take came after it.
            kind = "hit" if p.step < taken else "overwritten"
            group = (p.writer, kind, kind == "hit" and s in self.verified[r])
            by[group].append(s)
            first_write[group] = min(first_write.get(group, p.step), p.step)
        for (w, kind, verified), slots in by.items():
            key = (r, b, w, kind, verified)
            if key not in self.foreign:
                self.foreign[key] = ForeignRead(step, r, b, slots, w, first_write[(w, kind, verified)], kind, verified)

    def apply(self, e: TraceEvent) -> bool:
        """Apply one event; True when it is a write (its request was scheduled in this step)."""
        r, b = e.request, e.block
        if r is not None:
            if r not in self.history:
                self.order.append(r)
            self.history[r].append(e)
        if e.op == "reset":
            self.tables.clear()
            self.views.clear()
            self.verified.clear()
            self.prov.clear()
            return False
        if r is None or b is None:
            return False
        if e.op in ("alloc", "fork", "hit", "cow"):
            self.tables[r][b] = e.step
        if e.op == "fork":
            parent = e.detail.get("parent")
            if parent is not None:
                self.views[r] |= {s for s in self._slots(b) if s in self.views.get(parent, ())}
        elif e.op == "hit":
            taken = set(range(b * self.bs, b * self.bs + int(e.detail.get("tokens", self.bs))))
            self.views[r] |= taken
            if e.detail.get("verified"):  # traces written before the flag existed count as unverified
                self.verified[r] |= taken
        elif e.op == "cow":
            self._copy(r, b, e.detail.get("src"), int(e.detail.get("slots", 0)))
        elif e.op == "write":
            for s in e.detail.get("slots", []):
                self.prov[s] = Provenance(r, e.step)
                self.views[r].add(s)
            return True
        elif e.op == "free":
            self.tables[r].pop(b, None)
            self.views[r] -= set(self._slots(b))
            self.verified[r] -= set(self._slots(b))
        return False

    def _copy(self, r: str, b: int, src: int | None, kept: int) -> None:
        if src is None:
            return
        for i in range(kept):
            s_src, s_dst = src * self.bs + i, b * self.bs + i
            if s_src in self.prov:
                self.prov[s_dst] = self.prov[s_src]  # a copy keeps the provenance of what it copied
            if s_src in self.verified[r]:
                self.verified[r].add(s_dst)
            self.views[r].add(s_dst)
            self.views[r].discard(s_src)


def replay(events: list[TraceEvent], block_size: int | None = None) -> Replay:
    rp = _Replayer(block_size or infer_block_size(events))
    step = events[0].step if events else 0
    scheduled: set[str] = set()
    for e in events:
        if e.step != step:
            rp.end_step(step, scheduled)
            scheduled = set()
            step = e.step
        if rp.apply(e) and e.request is not None:
            scheduled.add(e.request)
    if events:
        rp.end_step(step, scheduled)
    found = sorted(rp.foreign.values(), key=lambda f: (f.step, f.reader, f.block))
    for f in found:
        f.chain = _chain(events, f)
    return Replay(rp.bs, rp.order, dict(rp.history), found, rp.holders)


def _chain(events: list[TraceEvent], f: ForeignRead) -> list[TraceEvent]:
    """The events of the block (and of any block it was copied from) that set up the foreign read: from
    the writer's allocation of the block's current contents (or the start) up to the read."""
    blocks = {f.block}
    for e in events:
        if e.op == "cow" and e.block in blocks and e.step <= f.step and e.detail.get("src") is not None:
            blocks.add(e.detail["src"])
    relevant = [e for e in events if e.block in blocks and e.step <= f.step]
    # Start at the last allocation that precedes the foreign write: what came before it is another life.
    start = 0
    for i, e in enumerate(relevant):
        if e.op in ("alloc", "reset") and e.step <= f.written_step:
            start = i
    return relevant[start:]


def format_event(e: TraceEvent) -> str:
    extra = " ".join(f"{k}={v}" for k, v in e.detail.items() if k != "slots" or e.op == "cow")
    if e.op == "write" and e.detail.get("slots"):
        s = e.detail["slots"]
        extra = f"slots {s[0]}..{s[-1]}" if len(s) > 1 else f"slot {s[0]}"
    who = f"request {e.request}" if e.request is not None else "cache"
    blk = f" block {e.block}" if e.block is not None else ""
    rc = f" rc={e.refcount}" if e.refcount is not None else ""
    return f"step {e.step:>3}  {e.op:<5} {who}{blk}{rc}" + (f"  {extra}" if extra else "")


def summarize_text(rep: Replay, request: str | None = None) -> str:
    lines = []
    for r in rep.requests:
        if request is not None and r != request:
            continue
        evs = rep.history[r]
        counts: dict[str, int] = defaultdict(int)
        for e in evs:
            counts[e.op] += 1
        hit_tokens = sum(int(e.detail.get("tokens", 0)) for e in evs if e.op == "hit")
        mine = [f for f in rep.foreign if f.reader == r]
        nf, ns = sum(not f.shared for f in mine), sum(f.shared for f in mine)
        lines.append(
            f"request {r}: steps {evs[0].step}..{evs[-1].step}, "
            + ", ".join(f"{op} {n}" for op, n in counts.items())
            + f", {hit_tokens} tokens from hits, {nf} foreign reads, {ns} shared reads"
        )
        lines += [f"  {format_event(e)}" for e in evs]
    if request is not None and not lines:
        raise KeyError(f"no request {request!r} in the trace; requests: {', '.join(rep.requests) or 'none'}")
    return "\n".join(lines)


READS = ("foreign", "shared", "all")  # what ``explain_text`` shows: contamination, benign shared reads, both


def explain_text(rep: Replay, request: str | None = None, reads: str = "foreign") -> str:
    """The reads of state another request wrote, each with the chain of block events behind it: ``reads``
    "foreign" (contamination and unverified hits), "shared" (verified prefix hits: benign) or "all"."""
    if reads not in READS:
        raise ValueError(f"reads must be one of {list(READS)}, got {reads!r}")
    if request is not None and request not in rep.history:
        raise KeyError(f"no request {request!r} in the trace; requests: {', '.join(rep.requests) or 'none'}")
    mine = [f for f in rep.foreign if request is None or f.reader == request]
    found = [f for f in mine if reads == "all" or f.shared == (reads == "shared")]
    if not found:
        shared = sum(f.shared for f in mine)
        if reads == "shared":
            return "no shared reads: no request read a prefix another request computed"
        more = f" ({shared} shared reads of verified prefix hits: --reads shared)" if shared else ""
        return "no foreign reads: every slot read was written by the reader itself or found by a verified hit" + more
    lines = []
    for f in found:
        lines.append(f.headline())
        lines += [f"  {format_event(e)}" for e in f.chain]
        lines.append(f"  step {f.step:>3}  read  request {f.reader} block {f.block}  <- {f.label}")
    return "\n".join(lines)
