"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every refusal, with client
values clipped before they are echoed, and pydantic's validation errors turned into that shape with
``param`` naming the offending field."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import Response
from pydantic import ValidationError

# Client values echoed in an error message are cut to this many characters: a 1 MB model name is not
# sent back whole (nor written whole to a log).
CLIP_CHARS = 120
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # The last guard against echoing a huge client value: no message is longer than this.
        message = message if len(message) <= 4 * CLIP_CHARS else message[: 4 * CLIP_CHARS] + "…"
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})


def clip(value: Any, limit: int = CLIP_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages; computed from a prefix when the value is a
    long string, so a 1 MB value costs nothing. ``repr`` also escapes lone surrogates, which a log cannot write."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"… ({len(value)} characters)"
    if isinstance(value, int) and value.bit_length() > 4 * limit:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    type_ = ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(status: int, obj: Any, headers: Mapping[str, str] | None = None) -> Response:
    # Not JSONResponse: that one writes compact separators; these bodies read as the earlier server's did.
    return Response(json.dumps(obj, ensure_ascii=False), status, headers, media_type="application/json")


def field_path(loc: Sequence[int | str]) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``: how a client would name it."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def from_validation(exc: ValidationError, hints: Mapping[str, str] | None = None) -> APIError:
    """A 400 for the first thing pydantic refused (all unsupported fields at once: a client fixing one should
    learn of the others too). ``param`` is the top-level field; the message names the full path. Pydantic's
    own messages never contain the input, so nothing a client sent is echoed. ``hints``: what to add after an
    unsupported field's name (e.g. the values it is accepted with)."""
    errors = exc.errors(include_url=False, include_input=False)
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = [field_path(e["loc"]) for e in extra]
        listed = ", ".join(clip(n, 60) for n in names[:8]) + (" …" if len(names) > 8 else "")
        verb = "is" if len(names) == 1 else "are"
        hint = (hints or {}).get(names[0], "") if len(names) == 1 else ""
        return APIError(400, f"{listed} {verb} not supported by kvlab{hint}", _param(extra[0]["loc"]))
    first = errors[0]
    loc = first["loc"]
    if not loc:  # the body itself: not an object
        return APIError(400, "the request body must be a JSON object")
    path = field_path(loc)
    if first["type"] == "missing":
        return APIError(400, f"'{path}' is required", _param(loc))
    return APIError(400, f"'{path}': {first['msg']}", _param(loc))


def _param(loc: Sequence[int | str]) -> str | None:
    # The top-level field, as OpenAI's own errors name it ("messages" for a bad messages[3].role).
    # Clipped: an unknown field's name is the client's, and may be long.
    return loc[0][:CLIP_CHARS] if loc and isinstance(loc[0], str) else None
