"""Public prefixes: what the server shares across tenants, and nothing else.

Under ``--prefix-sharing per-tenant`` every block of a request is keyed by its tenant's salt, so every tenant
recomputes (and stores) its own copy of the same long system prompt. A public prefix is the middle way: the
full KV blocks of a request's first ``public_prefix_tokens`` tokens are keyed with no salt, so requests of any
tenant that start with the same tokens share them; everything after (the partial block at the boundary
included, and every generated token) stays in the tenant's namespace (``KVCacheManager``).

A request's ``public_prefix_tokens`` is the larger of two declarations:

* the operator's: ``kvlab serve --public-prefix-file FILE`` lists texts (or chat messages, rendered with the
  served chat template) that are public. They are tokenised at start-up with the served tokenizer; a request
  whose prompt token ids start with one of them gets its length (the longest that matches). The match is on
  token ids, so a prefix whose last token merges with what follows (a tokenizer joining the prefix's last
  characters with the prompt's next ones) does not match: end a text prefix at a natural boundary (a newline).
  Chat messages are rendered as a conversation that goes on with a user turn: the public prefix is what every
  such conversation renders first, the entry's messages and the header of the next user turn.
* the client's: ``kvlab_public_prefix_tokens: N`` in the body marks the request's own first N tokens public
  (0 <= N <= its prompt's length). It can never reach another tenant's namespace: it changes how *this*
  request's blocks are keyed, not anyone else's. A lookup finds a block only if every token from position 0
  up to the block's end equals the request's own (the hash chain and the verification compare them all), and
  under no salt it finds only blocks that their writers keyed with no salt, that is, blocks that some request
  declared public itself (or the operator's file did); another tenant's private blocks are keyed under that
  tenant's salt, which no value of N (and no client salt: ``tenancy.cache_salt``) can produce. What the field
  does do is publish: once a request marks its text public, every tenant that sends the same tokens hits it,
  and can therefore tell (from ``cached_tokens`` or the time to first token) that someone sent them. Mark only
  text you would show anyone.

File format: YAML (``.yaml``/``.yml``, a list of entries) or JSON Lines (``.jsonl``, one entry per line,
blank lines skipped). An entry is a string, ``{"text": STR}`` or ``{"messages": [{"role", "content"}, ...]}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvlab.engine.sampling import InvalidRequestError
from kvlab.server.schemas import ChatMessage

log = logging.getLogger(__name__)

FIELD = "kvlab_public_prefix_tokens"  # the request body's field
# Two user turns that differ from their first character: what both render before it is the entries' prefix.
_NEXT_TURNS = ("a", "b")


class PublicPrefixFileError(ValueError):
    """The public-prefix file cannot be used: unreadable, malformed, or an entry empty or too long."""


class PublicPrefixRequestError(InvalidRequestError):
    """A request's ``kvlab_public_prefix_tokens`` is outside [0, its prompt's length] (HTTP 400)."""

    param = FIELD


@dataclass(frozen=True)
class PublicPrefixes:
    """The operator's public prefixes, as token ids; ``match`` finds the longest one a prompt starts with."""

    prefixes: tuple[tuple[int, ...], ...] = ()
    _trie: dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for ids in self.prefixes:
            node = self._trie
            for t in ids:
                node = node.setdefault(t, {})
            node[-1] = True  # no token id is negative: the end-of-prefix mark

    def match(self, ids: Sequence[int]) -> int:
        """Length of the longest declared prefix ``ids`` starts with (0: none)."""
        node, best = self._trie, 0
        for depth, t in enumerate(ids):
            child = node.get(t)
            if child is None:
                break
            node = child
            if -1 in node:
                best = depth + 1
        return best

    def __len__(self) -> int:
        return len(self.prefixes)


def resolve_public_prefix(ids: Sequence[int], requested: int, prefixes: PublicPrefixes | None) -> int:
    """The request's public prefix: the larger of the client's ``requested`` (validated) and the operator's
    longest declared prefix its token ids start with."""
    if isinstance(requested, bool) or not isinstance(requested, int) or not 0 <= requested <= len(ids):
        raise PublicPrefixRequestError(
            f"'{FIELD}' is {requested!r}, but it must be in [0, {len(ids)}]: the prompt has {len(ids)} tokens"
        )
    return max(requested, prefixes.match(ids) if prefixes is not None else 0)


def load_public_prefixes(path: Path, tokenizer: Any, max_model_len: int, block_size: int) -> PublicPrefixes:
    """Parse, render and tokenise the file's entries; ``PublicPrefixFileError`` names the entry at fault."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PublicPrefixFileError(f"{path}: cannot be read: {exc}") from exc
    entries = _parse(text, path)
    if not entries:
        raise PublicPrefixFileError(f"{path}: no public prefixes in it (an entry is a text or chat messages)")
    out: dict[tuple[int, ...], None] = {}
    for where, entry in entries:
        rendered = _render(entry, tokenizer, f"{path}: {where}")
        try:
            rendered.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in JSON): no text a tokenizer takes
            raise PublicPrefixFileError(
                f"{path}: {where} is not valid Unicode text: it has a lone surrogate "
                f"U+{ord(rendered[exc.start]):04X} at character {exc.start}"
            ) from None
        ids = tuple(tokenizer.encode(rendered)) if rendered else ()
        if not ids:
            raise PublicPrefixFileError(f"{path}: {where} is empty")
        if len(ids) > max_model_len:
            raise PublicPrefixFileError(
                f"{path}: {where} has {len(ids)} tokens, more than max_model_len={max_model_len}: no prompt holds it"
            )
        if len(ids) < block_size:
            log.warning(
                "%s: %s has %d tokens, less than one KV block of %d: it can never be shared", path, where, len(ids),
                block_size,
            )  # fmt: skip
        out[ids] = None
    return PublicPrefixes(tuple(out))


def _parse(text: str, path: Path) -> list[tuple[str, Any]]:
    """(where, entry) pairs: "entry #3" in YAML, "line 7" in JSON Lines."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        found = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                found.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise PublicPrefixFileError(f"{path}: line {n}, column {exc.colno}: {exc.msg}") from None
        return found
    if suffix not in (".yaml", ".yml"):
        raise PublicPrefixFileError(f"{path}: the file must be YAML (.yaml, .yml) or JSON Lines (.jsonl)")
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise PublicPrefixFileError(f"{path}: {at}{exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise PublicPrefixFileError(f"{path}: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, list):
        raise PublicPrefixFileError(f"{path}: the YAML file must be a list of entries (texts or chat messages)")
    return [(f"entry #{i}", e) for i, e in enumerate(data, 1)]


def _render(entry: Any, tokenizer: Any, where: str) -> str:
    if isinstance(entry, str):
        return entry
    if not isinstance(entry, dict) or len(entry) != 1 or not ({"text", "messages"} & set(entry)):
        raise PublicPrefixFileError(
            f"{where} must be a string, {{text: STR}} or {{messages: [{{role, content}}, ...]}}, got {_clip(entry)}"
        )
    if "text" in entry:
        if not isinstance(entry["text"], str):
            raise PublicPrefixFileError(f"{where}: 'text' must be a string, got {_clip(entry['text'])}")
        return entry["text"]
    raw = entry["messages"]
    if not isinstance(raw, list) or not raw:
        raise PublicPrefixFileError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    messages = []
    for i, m in enumerate(raw):
        try:
            messages.append(ChatMessage.model_validate(m))
        except ValidationError as exc:
            problem = exc.errors()[0]
            at = "".join(f".{p}" for p in problem["loc"])
            raise PublicPrefixFileError(f"{where}: messages[{i}]{at} is not valid: {problem['msg']}") from None
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        a, b = (str(tokenizer.apply_chat_template([*turns, {"role": "user", "content": c}])) for c in _NEXT_TURNS)
    except Exception as exc:  # no chat template, or the template refuses the conversation
        raise PublicPrefixFileError(f"{where}: the chat template cannot render these messages: {exc}") from None
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:n]


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
