"""Who may share prefix-cache entries with whom, and what a response tells about the cache.

A request belongs to a *tenant*: the one its API key names, or the single anonymous tenant of a server
that requires no keys. The cache salt the engine sees is derived from the tenant; a salt the client
sends (``cache_salt`` in the body, or ``X-Cache-Salt`` from a trusted proxy) can only narrow sharing
inside the tenant, never reach another tenant's entries, because the derived salt always starts with
the tenant.

The prefix cache is a side channel: a client that can tell a hit from a miss (``cached_tokens`` in the
usage, or time to first token) can recover another client's prompt one token at a time. Sharing only
within a tenant closes it between tenants; reporting ``cached_tokens`` in whole blocks only (as vLLM
does) makes the attacker align guesses with block boundaries, which slows it down but does not close it.

/metrics is a side channel too: its prefix-cache-hit counter moves by exactly the cached tokens of a
request sent on an idle server, whatever the response reports, and on a keyed server it shows every
tenant's traffic. ``metrics_access`` decides who may read it (``metrics_reveal`` says what it would give
away): the holder of the metrics key; anyone if the operator says so; else anyone only when it reveals
nothing that responses do not.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar, get_args

# The CLI's choices are these Literal types; the tuples are what the code checks against.
PrefixSharing = Literal["global", "per-tenant", "off"]
CachedTokensReport = Literal["exact", "block", "off"]
PREFIX_SHARING: tuple[str, ...] = get_args(PrefixSharing)
CACHED_TOKENS_REPORTS: tuple[str, ...] = get_args(CachedTokensReport)
ANONYMOUS = "anonymous"
T = TypeVar("T")


class AuthError(ValueError):
    """The request carries no valid API key on a server that requires one (HTTP 401)."""


class TenancyConfigError(ValueError):
    """A tenancy setting is outside its allowed values."""


class MetricsClosedError(ValueError):
    """/metrics is closed by the server's configuration: it would tell more than responses do (HTTP 403)."""


@dataclass(frozen=True)
class MetricsAccess:
    """Who may read /metrics, and why, in words for the startup log and the 403's message."""

    mode: str  # "key": the metrics key only; "open": anyone, harmlessly; "public": anyone, by choice; "closed"
    reason: str  # a sentence on /metrics, naming it
    reveals: str | None = None  # what it tells beyond responses (None: nothing)


def metrics_reveal(keyed: bool, prefix_sharing: str, report_cached_tokens: str) -> str | None:
    """What /metrics tells a client beyond its own responses; None when nothing.

    Keyed servers: every request's token counts and latencies reach clients without a key. Keyless ones:
    every client is one tenant, so the other series are its own traffic; but the prefix-cache-hit counter
    moves by a request's cached tokens, which is what reporting them in blocks, or not at all, hides.
    """
    if keyed:
        return "every request's prompt and generation token counts, TTFT and latency, to clients without an API key"
    if report_cached_tokens != "exact" and prefix_sharing != "off":
        return (
            "each request's exact cached tokens (the prefix-cache-hit counter), which "
            f"--report-cached-tokens {report_cached_tokens} hides from responses"
        )
    return None


@dataclass(frozen=True)
class TenancyPolicy:
    api_keys: Mapping[str, str] = field(default_factory=dict)  # API key -> tenant
    prefix_sharing: str = "per-tenant"
    report_cached_tokens: str = "block"
    trust_salt_header: bool = False
    block_size: int = 16
    metrics_api_key: str | None = None  # opens /metrics, and nothing else
    public_metrics: bool = False  # /metrics open to anyone, whatever it reveals: the operator's choice

    def __post_init__(self) -> None:
        if self.prefix_sharing not in PREFIX_SHARING:
            raise TenancyConfigError(
                f"prefix_sharing must be one of {list(PREFIX_SHARING)}, got {self.prefix_sharing!r}"
            )
        if self.report_cached_tokens not in CACHED_TOKENS_REPORTS:
            raise TenancyConfigError(
                f"report_cached_tokens must be one of {list(CACHED_TOKENS_REPORTS)}, got {self.report_cached_tokens!r}"
            )
        for key, tenant in self.api_keys.items():
            if not key or not tenant or any(c.isspace() for c in key):
                raise TenancyConfigError(
                    f"API keys and tenants must be non-empty and keys without whitespace (tenant {tenant!r})"
                )
        self._check_metrics_key()

    def _check_metrics_key(self) -> None:
        key = self.metrics_api_key
        if key is None:
            return
        if not key or any(c.isspace() for c in key):
            raise TenancyConfigError("the metrics API key must be non-empty and without spaces")
        if self.public_metrics:
            raise TenancyConfigError("--public-metrics opens /metrics to anyone: it cannot go with --metrics-api-key")
        if key in self.api_keys:
            # A tenant holding it would read every tenant's traffic; the key itself never reaches the message.
            raise TenancyConfigError(
                f"the metrics API key is also the API key of tenant {self.api_keys[key]!r}: "
                "give /metrics a key of its own"
            )

    # -- per request -----------------------------------------------------------------------------------
    def tenant(self, authorization: str | None) -> str:
        """The tenant of a request given its ``Authorization`` header; raises ``AuthError``."""
        if not self.api_keys:
            return ANONYMOUS
        found = _match(_bearer(authorization, "this server requires an API key"), self.api_keys)
        if found is None:
            raise AuthError("the API key is not valid")
        return found

    def check_any_key(self, authorization: str | None) -> None:
        """/docs, /openapi.json, /version: on a keyed server any valid key, a tenant's or the metrics key."""
        if not self.api_keys:
            return
        keys = {**dict.fromkeys(self.api_keys, True), **self._metrics_keys()}
        if _match(_bearer(authorization, "this server requires an API key"), keys) is None:
            raise AuthError("the API key is not valid")

    def check_metrics(self, authorization: str | None) -> None:
        """/metrics: raises ``AuthError`` (401) or ``MetricsClosedError`` (403) unless this request may read it."""
        access = self.metrics_access()
        if access.mode == "closed":
            raise MetricsClosedError(access.reason)
        if access.mode == "key":
            token = _bearer(authorization, "/metrics requires the metrics API key")
            if _match(token, self._metrics_keys()) is None:  # a tenant's key never opens it
                raise AuthError("the metrics API key is not valid")

    def _metrics_keys(self) -> dict[str, bool]:
        return {} if self.metrics_api_key is None else {self.metrics_api_key: True}

    def cache_salt(self, tenant: str, client_salt: str | None) -> str | None:
        """The salt the engine uses. JSON keeps (tenant, client salt) pairs apart: no choice of client salt
        can spell another tenant's salt."""
        if self.prefix_sharing == "global":
            return client_salt
        if self.prefix_sharing == "off":
            return None  # the engine is built without prefix caching
        return json.dumps([tenant, client_salt])

    def reported_cached_tokens(self, num_cached_tokens: int) -> int | None:
        if self.report_cached_tokens == "off":
            return None
        if self.report_cached_tokens == "block":
            return num_cached_tokens // self.block_size * self.block_size
        return num_cached_tokens

    # -- for the operator ------------------------------------------------------------------------------
    def metrics_access(self) -> MetricsAccess:
        """Who may read /metrics: the rule of the security model, from the configuration alone (no request)."""
        reveals = metrics_reveal(bool(self.api_keys), self.prefix_sharing, self.report_cached_tokens)
        if self.metrics_api_key is not None:
            return MetricsAccess("key", "/metrics is served only with the metrics API key (--metrics-api-key)", reveals)
        if self.public_metrics:
            shown = f": it reveals {reveals}" if reveals else ""
            return MetricsAccess("public", f"/metrics is open to anyone (--public-metrics){shown}", reveals)
        if reveals is None:
            return MetricsAccess("open", "/metrics is open to anyone: it tells a client nothing its responses do not")
        return MetricsAccess(
            "closed",
            f"/metrics is closed: it would reveal {reveals}; start the server with --metrics-api-key KEY "
            "(or --public-metrics to open it to anyone)",
            reveals,
        )

    def describe(self) -> str:
        """One line for the startup log: what is shared between whom, and what responses reveal."""
        tenants = sorted(set(self.api_keys.values()))
        who = f"{len(tenants)} tenant(s) by API key" if tenants else "no API keys: every client is one tenant"
        sharing = {
            "global": "the prefix cache is shared by ALL clients (a client salt narrows it)",
            "per-tenant": f"the prefix cache is shared only within a tenant ({who})",
            "off": "prefix caching is off: no request shares K/V with another",
        }[self.prefix_sharing]
        report = {
            "exact": "cached_tokens reported exactly (a token-by-token side channel)",
            "block": f"cached_tokens reported in whole blocks of {self.block_size}",
            "off": "cached_tokens not reported",
        }[self.report_cached_tokens]
        header = "X-Cache-Salt honoured (trusted proxy)" if self.trust_salt_header else "X-Cache-Salt refused"
        return f"tenancy: {sharing}; {report}; {header}; {self.metrics_access().reason}"


def _bearer(authorization: str | None, required: str) -> str:
    """The token of ``Authorization: Bearer <token>``; ``AuthError`` (saying what is ``required``) otherwise."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthError(f"{required}: send 'Authorization: Bearer <key>'")
    return token.strip()


def _match(token: str, keys: Mapping[str, T]) -> T | None:
    """The value of the key equal to ``token``. Every key is compared, each in constant time: how long the
    answer takes tells nothing of which key, or how much of one, matched."""
    found = None
    for key, value in keys.items():
        if hmac.compare_digest(key.encode(), token.encode()):
            found = value
    return found


def parse_api_keys(values: list[str], keys_file: Path | None = None) -> dict[str, str]:
    """``KEY`` or ``KEY:TENANT`` values, plus a file of ``KEY [TENANT]`` lines (# comments). A key without a
    tenant is a tenant of its own, named after its position (never after the key: names reach the logs)."""
    entries = list(values)
    if keys_file is not None:
        for line in keys_file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                key, _, tenant = line.partition(" ")
                entries.append(f"{key}:{tenant.strip()}" if tenant.strip() else key)
    keys: dict[str, str] = {}
    explicit: set[str] = set()
    for i, entry in enumerate(entries):
        key, _, tenant = entry.partition(":")
        # Named by position, never by the key itself: a key must not reach an error message or a log.
        if not key or any(c.isspace() for c in key):
            what = "empty" if not key else "not one word (it has whitespace)"
            raise TenancyConfigError(f"API key #{i + 1} is {what}")
        if key in keys:
            raise TenancyConfigError(f"API key #{i + 1} is given twice")
        if tenant:
            explicit.add(tenant)
        keys[key] = tenant or f"tenant-{i + 1}"
    for i, entry in enumerate(entries):
        name = f"tenant-{i + 1}"
        if not entry.partition(":")[2] and name in explicit:
            # Otherwise the two keys would silently be one tenant, sharing one cache.
            raise TenancyConfigError(
                f"API key #{i + 1} has no tenant, so it would be tenant {name!r}, which another key names "
                "explicitly: give it a tenant of its own (KEY:TENANT)"
            )
    return keys
