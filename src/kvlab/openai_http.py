"""What every client of an OpenAI-compatible server here shares (``kvlab probe``, ``kvlab bench serve``).

- Where to send: the server's root from a base URL given with or without its ``/v1`` (and trailing ``/``),
  the API key header, the model a server names first (``GET /v1/models``).
- How to read an answer, whichever server wrote it: cached prompt tokens (``usage.prompt_tokens_details.
  cached_tokens`` from OpenAI, vLLM and kvlab; llama.cpp's ``timings.cache_n``, or ``tokens_cached`` on its
  native endpoint), token ids, usage fields, and error bodies and events, quoted in messages that name the
  URL actually requested.

No kvlab imports: both sides of the layer above use it, and they may not import each other.
"""

from __future__ import annotations

import json
from typing import Any

ERROR_EXCERPT = 300  # characters of an error body quoted in a message


class ModelDiscoveryError(RuntimeError):
    """``GET /v1/models`` named no model; the message names the URL asked and what to pass instead."""


# ------------------------------------------------------------------------------------------------ where to send
def server_root(base_url: str) -> str:
    """The server's root, whether the base URL was given with or without its ``/v1`` (and trailing ``/``)."""
    return base_url.strip().rstrip("/").removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def discover_model(
    base_url: str, api_key: str | None = None, timeout: float = 30.0, *, instead: str = "--model"
) -> str:
    """The first model id of ``GET {root}/v1/models``; ``instead`` names the option the error suggests."""
    import httpx

    url = server_root(base_url) + "/v1/models"
    try:
        resp = httpx.get(url, headers=auth_headers(api_key), timeout=timeout, follow_redirects=False)
        if resp.status_code != 200:
            raise ModelDiscoveryError(f"{answered('GET', url, resp.status_code, resp.text)}; pass {instead}")
        return str(resp.json()["data"][0]["id"])
    except ModelDiscoveryError:
        raise
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ModelDiscoveryError(
            f"GET {url} did not name a model ({type(exc).__name__}: {exc}); pass {instead}"
        ) from exc


def requested_url(exc: Exception, fallback: str) -> str:
    """The URL an httpx error was raised for (the base URL may carry a path of its own), else ``fallback``."""
    try:
        request = exc.request  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # httpx raises when an error was never bound to a request
        return fallback
    return fallback if request is None else str(request.url)


# ------------------------------------------------------------------------------------------------ reading answers
def int_or_none(value: Any) -> int | None:
    """``value`` if it is a JSON integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def token_ids_of(value: Any) -> tuple[int, ...] | None:
    """``value`` as token ids if it is a list of JSON integers, else None."""
    if isinstance(value, list) and all(int_or_none(t) is not None for t in value):
        return tuple(value)
    return None


def usage_of(data: dict[str, Any]) -> dict[str, Any]:
    """The answer's (or the final stream chunk's) ``usage`` object; empty when there is none."""
    usage = data.get("usage")
    return usage if isinstance(usage, dict) else {}


def usage_int(data: dict[str, Any], name: str) -> int | None:
    """An integer field of the usage (``prompt_tokens``, ``completion_tokens``, ...); None when not given."""
    return int_or_none(usage_of(data).get(name))


def cached_tokens_of(data: dict[str, Any]) -> int | None:
    """How many prompt tokens the server says it found cached, from whichever field it uses; None: not said."""
    details = usage_of(data).get("prompt_tokens_details")
    if isinstance(details, dict) and int_or_none(details.get("cached_tokens")) is not None:
        return int_or_none(details["cached_tokens"])
    timings = data.get("timings")
    if isinstance(timings, dict) and int_or_none(timings.get("cache_n")) is not None:
        return int_or_none(timings["cache_n"])
    return int_or_none(data.get("tokens_cached"))


def excerpt(text: str) -> str:
    return text[:ERROR_EXCERPT]


def answered(method: str, url: str, status: int, body: str) -> str:
    """The message for a refusal: ``"POST {url} answered {status}: {body excerpt}"``."""
    return f"{method} {url} answered {status}: {excerpt(body)}"


def error_event(data: dict[str, Any]) -> str | None:
    """The ``error`` of an answer or stream event (kvlab and vLLM send one inside a 200 stream), as an
    excerpt of its JSON; None when there is none."""
    error = data.get("error")
    return None if error is None else excerpt(json.dumps(error))
