"""The probe's prompts: fresh every run, laid out by the seed.

A prefix cache remembers earlier runs. If a run's prompts were fixed by ``--seed`` alone, a second run's
"misses" would already be cached (its timing test then sees no difference) and its references could hit
entries an earlier burst left behind. So every prompt starts with a per-run nonce, and every text drawn at
random is drawn from a generator seeded with the nonce: the seed fixes the structure (burst order, arrival
offsets, which arm of a timing trial comes first), never the texts.

The non-prefix reuse groups (``kvlab/experiment/data/reuse.yaml``, probe-only) have three parts: a shared
``prefix``, per-victim ``secrets`` and a ``chunk``. The victim sends prefix + secret + chunk, the attacker
prefix + chunk: after the shared prefix, the attacker's whole remainder matches the victim's prompt *later
on*, which is what llama.cpp's ``--cache-reuse`` looks for (it shifts such chunks' K/V into place, K/V that
were computed after the victim's secret).
"""

from __future__ import annotations

import hashlib
import random
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

WORDS = [
    *("amber", "falcon", "silver", "otter", "violet", "maple", "cobalt", "river", "ivory", "stone", "jade"),
    *("lantern", "coral", "harbor", "slate", "meadow", "copper", "willow", "granite", "ember", "orchid"),
    *("tundra", "saffron", "quartz"),
]
# A nonce tag is 16 characters: on a byte-level tokenizer with 16-token blocks (kvlab's mini model) it fills
# exactly one block, so a group's own layout relative to block boundaries (the near-miss group puts its
# swapped tokens inside one block) is kept.
TAG_CHARS = 16


def new_nonce() -> str:
    return uuid.uuid4().hex[:13]


def sub_nonce(nonce: str, label: str) -> str:
    """A nonce of its own for one use within the run (a trial, a control), derived from the run's."""
    return hashlib.sha256(f"{nonce}-{label}".encode()).hexdigest()[:13]


def tag(nonce: str, prompt: str) -> str:
    """``prompt`` after the run's nonce tag, so that nothing cached by an earlier run matches its start."""
    head = f"[{nonce}] "
    assert len(head) == TAG_CHARS, head
    return head + prompt


def words(rng: random.Random, chars: int) -> str:
    """Random words, exactly ``chars`` characters."""
    text = ""
    while len(text) < chars:
        text += (" " if text else "") + rng.choice(WORDS)
    return text[:chars]


def calibration_prompts(nonce: str, count: int) -> list[str]:
    """Unrelated prompts whose answers measure how much unrelated answers share by chance."""
    rng = random.Random(f"calibration-{nonce}")
    # Distinct openings: prompts that began alike would answer alike and make chance look stronger than it is.
    topics = ["Describe", "Summarise", "List facts about", "Write a line about", "Explain", "Name a use of"]
    topics += ["Compare", "Praise", "Criticise", "Define", "Translate", "Rhyme with"]
    return [tag(nonce, f"{topics[i % len(topics)]} {words(rng, 24 + 3 * i)}:") for i in range(count)]


class ReuseFileError(ValueError):
    """A reuse-group file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class ReuseGroup:
    name: str
    prefix: str
    secrets: tuple[str, ...]
    chunk: str

    def victim(self, nonce: str, secret: str) -> str:
        return tag(nonce, self.prefix + secret + self.chunk)

    def attacker(self, nonce: str) -> str:
        return tag(nonce, self.prefix + self.chunk)

    def control(self, nonce: str, secret: str) -> str:
        """Like the victim's prompt, but with another chunk of the same length: only the prefix can be reused."""
        rng = random.Random(f"control-{nonce}")
        return tag(nonce, self.prefix + secret + words(rng, len(self.chunk)))


def default_reuse_groups() -> list[ReuseGroup]:
    text = resources.files("kvlab.experiment").joinpath("data/reuse.yaml").read_text(encoding="utf-8")
    return parse_reuse_groups(text, "<built-in reuse.yaml>")


def load_reuse_groups(path: str | Path) -> list[ReuseGroup]:
    path = Path(path)
    if not path.is_file():
        raise ReuseFileError(f"{path}: no such file")
    return parse_reuse_groups(path.read_text(encoding="utf-8"), str(path))


def parse_reuse_groups(text: str, source: str) -> list[ReuseGroup]:
    import yaml

    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ReuseFileError(f"{source}: {exc}") from exc
    raw = data.get("groups") if isinstance(data, dict) else None
    if not isinstance(raw, list) or not raw:
        raise ReuseFileError(f"{source}: key 'groups' must be a non-empty list")
    groups = []
    for i, g in enumerate(raw):
        where = f"{source}: groups[{i}]"
        if not isinstance(g, dict) or set(g) - {"name", "prefix", "secrets", "chunk"}:
            raise ReuseFileError(f"{where} must be a mapping of name, prefix, secrets, chunk")
        strings = [g.get(k) for k in ("name", "prefix", "chunk")]
        secrets = g.get("secrets")
        if not all(isinstance(s, str) and s for s in strings):
            raise ReuseFileError(f"{where}: name, prefix and chunk must be non-empty strings")
        if not isinstance(secrets, list) or not secrets or not all(isinstance(s, str) and s for s in secrets):
            raise ReuseFileError(f"{where}: secrets must be a non-empty list of non-empty strings")
        groups.append(ReuseGroup(g["name"], g["prefix"], tuple(secrets), g["chunk"]))
    return groups
