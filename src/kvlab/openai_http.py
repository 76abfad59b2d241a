"""What every client of an OpenAI-compatible server here shares (``kvlab probe``, ``kvlab bench serve``): the
server's root from a base URL given with or without its ``/v1``, the API key header, the model a server names
first, and reading an integer field of a JSON answer. No kvlab imports: both sides of the layer above use it.
"""

from __future__ import annotations

from typing import Any

ERROR_EXCERPT = 300  # characters of an error body quoted in a message


class ModelDiscoveryError(RuntimeError):
    """``GET /v1/models`` named no model; the message names the URL asked and what to pass instead."""


def server_root(base_url: str) -> str:
    """The server's root, whether the base URL was given with or without its ``/v1`` (and trailing ``/``)."""
    return base_url.strip().rstrip("/").removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def int_or_none(value: Any) -> int | None:
    """``value`` if it is a JSON integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def discover_model(
    base_url: str, api_key: str | None = None, timeout: float = 30.0, *, instead: str = "--model"
) -> str:
    """The first model id of ``GET {root}/v1/models``; ``instead`` names the option the error suggests."""
    import httpx

    url = server_root(base_url) + "/v1/models"
    try:
        resp = httpx.get(url, headers=auth_headers(api_key), timeout=timeout, follow_redirects=False)
        if resp.status_code != 200:
            raise ModelDiscoveryError(
                f"GET {url} answered {resp.status_code}: {resp.text[:ERROR_EXCERPT]}; pass {instead}"
            )
        return str(resp.json()["data"][0]["id"])
    except ModelDiscoveryError:
        raise
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ModelDiscoveryError(
            f"GET {url} did not name a model ({type(exc).__name__}: {exc}); pass {instead}"
        ) from exc
