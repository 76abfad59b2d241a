"""The words of a command's output with Typer's boxed "Error" panel taken apart: the frame's characters dropped
and the lines joined, so that a test matches what an error says, not where the panel wrapped it."""

from __future__ import annotations

import re

_FRAME = re.compile(r"[│╭╮╰╯─]")


def words(output: str) -> str:
    """``output`` (a ``CliRunner`` result's) as one line of words, the error panel's frame left out."""
    return " ".join(_FRAME.sub(" ", output).split())
