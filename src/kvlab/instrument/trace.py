"""Structured events of the KV cache, kept in memory and/or written as JSON lines.

One event per block transition (``alloc``, ``hit``, ``write``, ``cow``, ``fork``, ``free``, ``evict``), per
verified speculative draft (``draft``: the tokens drafted, how many were accepted, the slots the rest left
unrecorded) or per cache-wide action (``reset``), stamped with the engine step that caused it, so a leak found by the
sanitizer can be traced back to the allocation that set it up.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

OPS = ("alloc", "hit", "write", "cow", "fork", "free", "evict", "reset", "draft")


@dataclass(frozen=True)
class TraceEvent:
    step: int
    op: str
    request: str | None
    block: int | None
    refcount: int | None
    detail: dict[str, Any] = field(default_factory=dict)


class Trace:
    """Event sink. ``path``: append JSON lines there; ``keep``: also keep events in :attr:`events`."""

    def __init__(self, path: str | os.PathLike[str] | None = None, keep: bool = True) -> None:
        self.step = 0  # set by the engine at the start of every step
        self.keep = keep
        self.events: list[TraceEvent] = []
        # Line-buffered so that the events leading up to a crash are on disk.
        self._file = open(path, "w", encoding="utf-8", buffering=1) if path is not None else None  # noqa: SIM115

    def emit(
        self,
        op: str,
        request: str | None = None,
        block: int | None = None,
        refcount: int | None = None,
        **detail: Any,
    ) -> None:
        if op not in OPS:
            raise ValueError(f"unknown trace op {op!r}; expected one of {list(OPS)}")
        event = TraceEvent(self.step, op, request, block, refcount, detail)
        if self.keep:
            self.events.append(event)
        if self._file is not None:
            self._file.write(json.dumps(asdict(event)) + "\n")

    def select(self, op: str | None = None, request: str | None = None, block: int | None = None) -> list[TraceEvent]:
        """Kept events matching every given field."""
        return [
            e
            for e in self.events
            if (op is None or e.op == op)
            and (request is None or e.request == request)
            and (block is None or e.block == block)
        ]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def read_jsonl(path: str | os.PathLike[str]) -> list[TraceEvent]:
        with open(path, encoding="utf-8") as f:
            return [TraceEvent(**json.loads(line)) for line in f if line.strip()]
