"""Passphrase sets: groups of prompts sharing a long prefix and differing in a short suffix.

A set is read from YAML or JSON::

    chat_template: false          # optional: wrap every prompt in the model's chat template
    groups:
      - name: weather
        kind: plain               # optional: plain | near-miss (prefixes differ by swapped tokens)
        chat_template: true       # optional, per group
        prompts: ["...", "..."]
    strategies:                   # optional: user-defined sharing strategies
      - name: my-cow
        expect: safe              # safe | unsafe
        cache: {block_size: 8}
        scheduler: {}
        inject_empty: false

Errors name the file and the line (syntax) or the key (structure).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvlab.config import ConfigError
from kvlab.experiment.strategies import Strategy

GROUP_KINDS = ("plain", "near-miss")
_TOP_KEYS = {"chat_template", "groups", "strategies"}
_GROUP_KEYS = {"name", "kind", "chat_template", "prompts"}
_STRATEGY_KEYS = {"name", "description", "expect", "cache", "scheduler", "inject_empty"}


class PassphraseFileError(ValueError):
    """A passphrase file that cannot be used; the message names the file and the line or key."""


@dataclass(frozen=True)
class PassphraseGroup:
    name: str
    prompts: tuple[str, ...]
    kind: str = "plain"
    chat_template: bool = False


@dataclass(frozen=True)
class PassphraseSet:
    source: str
    groups: tuple[PassphraseGroup, ...]
    strategies: tuple[Strategy, ...] = ()

    def group(self, name: str) -> PassphraseGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r} in {self.source} (groups: {[g.name for g in self.groups]})")


def default_passphrases() -> PassphraseSet:
    text = resources.files("kvlab.experiment").joinpath("data/default.yaml").read_text(encoding="utf-8")
    return parse_passphrases(text, "<built-in default.yaml>", "yaml")


def load_passphrases(path: str | Path) -> PassphraseSet:
    path = Path(path)
    if not path.is_file():
        raise PassphraseFileError(f"{path}: no such file")
    fmt = "json" if path.suffix.lower() == ".json" else "yaml"
    return parse_passphrases(path.read_text(encoding="utf-8"), str(path), fmt)


def parse_passphrases(text: str, source: str, fmt: str = "yaml") -> PassphraseSet:
    data = _parse(text, source, fmt)
    if not isinstance(data, dict):
        raise PassphraseFileError(f"{source}: the top level must be a mapping with a 'groups' key")
    _no_unknown(data, _TOP_KEYS, source, "the top level")
    chat_default = _bool(data.get("chat_template", False), source, "chat_template")
    raw_groups = data.get("groups")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise PassphraseFileError(f"{source}: key 'groups' must be a non-empty list of groups")
    groups = []
    for i, g in enumerate(raw_groups):
        where = _entry(g, f"groups[{i}]", _GROUP_KEYS, source)
        name = g.get("name")
        if not isinstance(name, str) or not name:
            raise PassphraseFileError(f"{source}: {where}.name must be a non-empty string")
        where = f"{where} ({name!r})"
        prompts = g.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise PassphraseFileError(f"{source}: {where}.prompts is empty: a group needs at least one prompt")
        if not all(isinstance(p, str) and p for p in prompts):
            raise PassphraseFileError(f"{source}: {where}.prompts must be non-empty strings")
        kind = g.get("kind", "plain")
        if kind not in GROUP_KINDS:
            raise PassphraseFileError(f"{source}: {where}.kind must be one of {list(GROUP_KINDS)}, got {kind!r}")
        chat = _bool(g.get("chat_template", chat_default), source, f"{where}.chat_template")
        groups.append(PassphraseGroup(name, tuple(prompts), kind, chat))
    names = [g.name for g in groups]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise PassphraseFileError(f"{source}: group name {dup!r} is used twice")
    return PassphraseSet(source, tuple(groups), tuple(_strategies(data.get("strategies", []), source)))


def _strategies(raw: Any, source: str) -> list[Strategy]:
    if not isinstance(raw, list):
        raise PassphraseFileError(f"{source}: key 'strategies' must be a list")
    out = []
    for i, s in enumerate(raw):
        where = _entry(s, f"strategies[{i}]", _STRATEGY_KEYS, source)
        try:
            out.append(
                Strategy(
                    name=s.get("name", ""),
                    description=s.get("description", "user-defined"),
                    cache=dict(s.get("cache") or {}),
                    scheduler=dict(s.get("scheduler") or {}),
                    expect=s.get("expect", "safe"),
                    inject_empty=bool(s.get("inject_empty", False)),
                )
            )
        except ConfigError as exc:
            raise PassphraseFileError(f"{source}: {where}: {exc}") from exc
    return out


def _parse(text: str, source: str, fmt: str) -> Any:
    if fmt == "json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise PassphraseFileError(f"{source}: line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise PassphraseFileError(f"{source}: {line}{exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise PassphraseFileError(f"{source}: {exc}") from exc


def _entry(item: Any, where: str, allowed: set[str], source: str) -> str:
    """Check that one list entry is a mapping of known keys; returns where it is, for later messages."""
    if not isinstance(item, dict):
        raise PassphraseFileError(f"{source}: {where} must be a mapping with keys among {sorted(allowed)}")
    _no_unknown(item, allowed, source, where)
    return where


def _no_unknown(d: dict, allowed: set[str], source: str, where: str) -> None:
    for key in d:
        if key not in allowed:
            raise PassphraseFileError(f"{source}: unknown key {key!r} in {where} (allowed: {sorted(allowed)})")


def _bool(value: Any, source: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise PassphraseFileError(f"{source}: {key} must be true or false, got {value!r}")
    return value
