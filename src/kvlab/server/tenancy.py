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
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

PREFIX_SHARING = ("global", "per-tenant", "off")
CACHED_TOKENS_REPORTS = ("exact", "block", "off")
ANONYMOUS = "anonymous"


class AuthError(ValueError):
    """The request carries no valid API key on a server that requires one (HTTP 401)."""


class TenancyConfigError(ValueError):
    """A tenancy setting is outside its allowed values."""


@dataclass(frozen=True)
class TenancyPolicy:
    api_keys: Mapping[str, str] = field(default_factory=dict)  # API key -> tenant
    prefix_sharing: str = "per-tenant"
    report_cached_tokens: str = "block"
    trust_salt_header: bool = False
    block_size: int = 16

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
                raise TenancyConfigError(f"API keys and tenants must be non-empty and keys without spaces: {tenant!r}")

    # -- per request -----------------------------------------------------------------------------------
    def tenant(self, authorization: str | None) -> str:
        """The tenant of a request given its ``Authorization`` header; raises ``AuthError``."""
        if not self.api_keys:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthError("this server requires an API key: send 'Authorization: Bearer <key>'")
        found = None
        for key, tenant in self.api_keys.items():  # every key compared, in constant time each
            if hmac.compare_digest(key.encode(), token.strip().encode()):
                found = tenant
        if found is None:
            raise AuthError("the API key is not valid")
        return found

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
        return f"tenancy: {sharing}; {report}; {header}"


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
    for i, entry in enumerate(entries):
        key, _, tenant = entry.partition(":")
        if key in keys:
            raise TenancyConfigError(f"API key #{i + 1} is given twice")
        keys[key] = tenant or f"tenant-{i + 1}"
    return keys
