"""A benchmark's result as a table: title, columns, rows of formatted cells and the notes printed under it.

Each benchmark formats its own numbers next to its result type (``throughput_table`` beside ``ThroughputRow``,
``cow_table`` beside ``CowComparison``, ...); a front end only draws the table (the CLI: ``kvlab.cli.common.render``,
a rich table, then the notes). Cells, the heading and the notes are rich console markup (``"[red]NO[/red]"``).
Nothing here imports rich, torch or the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Justify = Literal["left", "right"]


@dataclass(frozen=True)
class Column:
    header: str
    justify: Justify = "left"
    no_wrap: bool = False


def right_columns(*headers: str) -> list[Column]:
    """Columns of these headers, right-justified (the numbers of a table)."""
    return [Column(h, justify="right") for h in headers]


@dataclass(frozen=True)
class ResultTable:
    """``rows`` hold one formatted cell per column; ``heading``: a line printed above the table (the run's
    setup), ``notes``: lines printed under it (what the columns mean, warnings, verdicts)."""

    title: str
    columns: tuple[Column, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()
    heading: str = ""

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"table {self.title!r}: a row of {len(row)} cells for {len(self.columns)} columns")

    @property
    def headers(self) -> tuple[str, ...]:
        return tuple(c.header for c in self.columns)


def result_table(
    title: str,
    columns: Iterable[str | Column],
    rows: Iterable[Iterable[str]],
    notes: Iterable[str] = (),
    heading: str = "",
) -> ResultTable:
    """A ``ResultTable``; a column given by its header alone is left-justified and wraps."""
    cols = tuple(c if isinstance(c, Column) else Column(c) for c in columns)
    return ResultTable(title, cols, tuple(tuple(r) for r in rows), tuple(notes), heading)
