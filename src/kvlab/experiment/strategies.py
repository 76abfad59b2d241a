"""Sharing strategies: a named cache configuration plus runner flags (the table in docs/architecture.md).

A strategy states what it is expected to do: a ``safe`` one must never contaminate, an ``unsafe`` one
must contaminate in some trials (``kvlab experiment --check`` fails otherwise: the harness must be able
to fail). Users define their own in the passphrase file's ``strategies:`` section.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from kvlab.config import CacheConfig, ConfigError, SchedulerConfig

EXPECTATIONS = ("safe", "unsafe")
_CACHE_FIELDS = {f.name for f in fields(CacheConfig)}
_SCHED_FIELDS = {f.name for f in fields(SchedulerConfig)}


@dataclass(frozen=True)
class Strategy:
    name: str
    description: str
    cache: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    expect: str = "safe"
    inject_empty: bool = False  # add a zero-length request to every trial

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("Strategy.name must be a non-empty string")
        if self.expect not in EXPECTATIONS:
            raise ConfigError(f"Strategy.expect must be one of {list(EXPECTATIONS)}, got {self.expect!r}")
        for key in self.cache:
            if key not in _CACHE_FIELDS:
                raise ConfigError(
                    f"strategy {self.name!r}: unknown cache knob {key!r} (allowed: {sorted(_CACHE_FIELDS)})"
                )
        for key in self.scheduler:
            if key not in _SCHED_FIELDS:
                raise ConfigError(
                    f"strategy {self.name!r}: unknown scheduler knob {key!r} (allowed: {sorted(_SCHED_FIELDS)})"
                )

    def configs(self, base_cache: dict[str, Any], base_sched: dict[str, Any]) -> tuple[CacheConfig, SchedulerConfig]:
        cache = CacheConfig(**{**base_cache, **self.cache})
        unsafe = cache.unsafe or self.scheduler.get("unsafe", False)
        sched = SchedulerConfig(**{**base_sched, "unsafe": unsafe, **self.scheduler})
        return cache, sched


# The built-in names as a type, for command-line choices (a test holds it equal to BUILTIN_STRATEGIES' keys).
BuiltinStrategy = Literal["isolated", "shared-no-cow", "shared-cow", "shared-no-refcount", "weak-hash", "empty-request"]

BUILTIN_STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in [
        Strategy("isolated", "no sharing: every request owns its blocks", {"share_prefix": False}),
        Strategy(
            "shared-no-cow",
            "prefix sharing without copy-on-write or refcounts: writes land in shared blocks",
            {"copy_on_write": False, "reference_counting": False, "unsafe": True},
            expect="unsafe",
        ),
        Strategy("shared-cow", "prefix sharing with refcounts and copy-on-write", {}),
        Strategy(
            "shared-no-refcount",
            "copy-on-write, but the first owner to finish frees blocks others still read (use-after-free)",
            {"reference_counting": False, "unsafe": True},
            expect="unsafe",
        ),
        Strategy(
            "weak-hash",
            "16-bit order-blind hash and no token check: near-miss prefixes share the wrong blocks",
            {"hash_algo": "weak", "verify_tokens": False, "unsafe": True},
            expect="unsafe",
        ),
        Strategy(
            "empty-request",
            "a zero-length request rides in every batch with filter_empty=False: it reads its neighbour's row",
            {},
            {"filter_empty": False, "unsafe": True},
            expect="unsafe",
            inject_empty=True,
        ),
    ]
}
