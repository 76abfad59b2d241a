"""One request set, two servers: vLLM's OpenAI-compatible server and ``kvlab serve``, through the official
``openai`` client, on SmolLM2 fp32.

    # vLLM (scripts/peers/vllm-serve.sh float32 8001 running; the client is kvlab's venv's, or vLLM's own)
    .venv/bin/python scripts/peers/server_parity.py --base-url http://127.0.0.1:8001 --model smollm2 \\
        --out tests/server/vllm_server_parity_0.32.json
    # kvlab (kvlab serve smollm2 --port 8000 --block-size 32 --max-model-len 2048 --enable-prefix-caching)
    .venv/bin/python scripts/peers/server_parity.py --base-url http://127.0.0.1:8000 --model smollm2 --out kvlab.json
    # the differences, as three lists (exit status 1 when there are any)
    .venv/bin/python scripts/peers/server_parity.py --diff tests/server/vllm_server_parity_0.32.json kvlab.json

The requests cover what kvlab serves: completions (a string, token ids, a list of prompts, a list of token-id
lists, n=2 sampled with a seed, max_tokens and its default, stop, logprobs, echo, seed at temperature 0, streams
with and without ``stream_options.include_usage``, a repeated long prompt for
``usage.prompt_tokens_details.cached_tokens``), chat completions (messages, a system message, an answer that
ends at EOS, max_completion_tokens, logprobs with top_logprobs, n=2 sampled, streams), ``/v1/models``,
vLLM's ``/tokenize``, and refusals (a prompt over max_model_len, a prompt plus max_tokens over it, a bad
temperature, an unknown model, top_logprobs without logprobs, stream_options without stream, vLLM's
``return_token_ids``). Greedy requests use temperature 0 only: vLLM refuses n > 1 with greedy sampling.
The server must start from an empty prefix cache (a fresh one): the cached-token counts are recorded.

For each request the record holds, apart:

- ``shape``: every key path of the response with its JSON types (``$.choices[].logprobs.top_logprobs[].*``:
  ``*`` where keys are data, such as token strings); for a stream, ``chunk:`` paths (the union over its chunks)
  and ``usage_chunk:`` paths (the final chunk that carries the usage and no choices);
- ``values``: what must agree between engines on the same weights: the body without the fields that differ
  from run to run (ids, ``created``, ``system_fingerprint``, error messages, the model's path), which are
  recorded in the shape only; for a stream, per choice the joined text, the finish and stop reasons and the
  joined log-probabilities, and the usage; for a sampled request (n=2 with a seed), only the choices' indices
  and the prompt's token count, the rest going to ``own_values`` (compared within one engine only: the same
  seed must give the same draws again, but the engines' generators differ);
- ``status``, and whether the official client's own types take the body (``sdk``).

``diff(theirs, ours)`` compares two records (pure, standard library): the fields only one side returns (a
field is a path with one of its JSON types, so ``token_ids`` null on one side and an array on the other is in
both lists) and the values that differ (floats within ``tol``; a key only one side has is a shape matter, not
a value one). Only the standard library, ``openai`` and ``httpx`` (the client's own dependency) are used:
nothing here imports kvlab, so the script runs in vLLM's venv as well.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
]  # scripts/peers/parity.py's: its recording of vLLM's offline greedy outputs holds the same prompts
CHAT = [{"role": "user", "content": "Name three colours."}]
SHORT_CHAT = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]
SYSTEM_CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
# Sent twice, for usage.prompt_tokens_details.cached_tokens: its first block is no other prompt's (mini: a token
# a byte), ~100 tokens on SmolLM2 (three 32-token blocks to hit).
LONG_PROMPT = "Twice over: " + " ".join(TEXTS) * 3
SEED = 1234
TOL = 1e-3  # absolute, per float (log-probabilities): fp32 kernels differ in summation order only

# Values that differ from run to run (or machine to machine): recorded in the shape, never as values.
NONDETERMINISTIC = frozenset(
    {
        "$.id",
        "$.created",
        "$.system_fingerprint",
        "$.data[].created",
        "$.data[].root",  # vLLM: the model's directory on the recording machine
        "$.data[].permission[].id",
        "$.data[].permission[].created",
        "$.error.message",  # each server words its refusals its own way; type, param and code are compared
    }
)
# Objects whose keys are data (token strings, token ids), not field names: one path, "*", for all keys.
MAP_PATHS = frozenset({"$.choices[].logprobs.top_logprobs[]", "$.choices[].prompt_logprobs[]"})
LONG_LIST = 64  # request bodies are recorded with token-id lists longer than this summarised


# ------------------------------------------------------------------------------------------------ shapes
def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def shape(obj: Any, path: str = "$", out: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Every key path in ``obj`` with the JSON types found there (list elements merged under ``[]``)."""
    out = {} if out is None else out
    out.setdefault(path, set()).add(json_type(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            shape(v, child_path(path, k), out)
    elif isinstance(obj, list):
        for v in obj:
            shape(v, f"{path}[]", out)
    return out


def shape_all(objects: Iterable[Any]) -> dict[str, set[str]]:
    """``shape`` of several objects merged: every key path any of them has, with every type found there."""
    out: dict[str, set[str]] = {}
    for obj in objects:
        shape(obj, out=out)
    return out


def child_path(path: str, key: str) -> str:
    """The path of ``key`` under ``path``: one ``*`` for every key of a map (``MAP_PATHS``)."""
    return f"{path}.*" if path in MAP_PATHS else f"{path}.{key}"


def _sorted_shape(s: dict[str, set[str]], prefix: str = "") -> dict[str, list[str]]:
    return {prefix + p: sorted(t) for p, t in sorted(s.items())}


def strip(obj: Any, path: str = "$") -> Any:
    """``obj`` without the NONDETERMINISTIC paths."""
    if isinstance(obj, dict):
        return {k: strip(v, child_path(path, k)) for k, v in obj.items() if f"{path}.{k}" not in NONDETERMINISTIC}
    if isinstance(obj, list):
        return [strip(v, f"{path}[]") for v in obj]
    return obj


# ------------------------------------------------------------------------------------------------ requests
@dataclass
class Request:
    name: str
    route: str  # "completions", "chat", "models", "tokenize"
    body: dict[str, Any] = field(default_factory=dict)  # the create() keywords; extra_body for vLLM's fields
    sampled: bool = False  # temperature > 0: values only within one engine


def request_set(model: str, ids: list[list[int]], max_model_len: int) -> list[Request]:
    """The fixed requests; ``ids`` are TEXTS tokenised by the server (its /tokenize), ``max_model_len`` its
    /v1/models'."""
    m = {"model": model}
    g = {**m, "temperature": 0}
    over = (ids[0] * (max_model_len // len(ids[0]) + 2))[: max_model_len + 1]
    fits = over[: max_model_len - 8]
    r = Request
    return [
        # ---- completions
        r("completion", "completions", {**g, "prompt": TEXTS[0], "max_tokens": 16}),
        r("completion_default_max_tokens", "completions", {**g, "prompt": TEXTS[3]}),
        r("completion_seed_greedy", "completions", {**g, "prompt": TEXTS[3], "max_tokens": 8, "seed": SEED}),
        r("completion_token_ids", "completions", {**g, "prompt": ids[1], "max_tokens": 16}),
        r("completion_prompt_list", "completions", {**g, "prompt": TEXTS[:3], "max_tokens": 8}),
        r("completion_token_id_lists", "completions", {**g, "prompt": ids[:2], "max_tokens": 8}),
        r("completion_n2_seeded", "completions",
          {**m, "prompt": TEXTS[0], "max_tokens": 8, "n": 2, "temperature": 0.8, "seed": SEED}, sampled=True),
        r("completion_stop", "completions", {**g, "prompt": TEXTS[2], "max_tokens": 32, "stop": [".", "\n"]}),
        r("completion_logprobs", "completions", {**g, "prompt": TEXTS[0], "max_tokens": 6, "logprobs": 2}),
        r("completion_echo", "completions", {**g, "prompt": TEXTS[0], "max_tokens": 4, "echo": True}),
        r("completion_echo_logprobs", "completions",
          {**g, "prompt": TEXTS[0], "max_tokens": 4, "echo": True, "logprobs": 1}),
        r("completion_return_token_ids", "completions",
          {**g, "prompt": TEXTS[0], "max_tokens": 16, "extra_body": {"return_token_ids": True}}),
        r("completion_stream", "completions",
          {**g, "prompt": TEXTS[0], "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}),
        r("completion_stream_no_usage", "completions",
          {**g, "prompt": TEXTS[0], "max_tokens": 6, "logprobs": 2, "stream": True}),
        r("completion_stream_prompt_list", "completions",
          {**g, "prompt": TEXTS[:2], "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}),
        r("completion_cache_first", "completions", {**g, "prompt": LONG_PROMPT, "max_tokens": 4}),
        r("completion_cache_again", "completions", {**g, "prompt": LONG_PROMPT, "max_tokens": 4}),
        # ---- chat completions
        r("chat", "chat", {**g, "messages": CHAT, "max_tokens": 16}),
        r("chat_system", "chat", {**g, "messages": SYSTEM_CHAT, "max_tokens": 8}),
        r("chat_eos", "chat", {**g, "messages": SHORT_CHAT, "max_tokens": 16}),
        r("chat_max_completion_tokens", "chat", {**g, "messages": CHAT, "max_completion_tokens": 12}),
        r("chat_logprobs", "chat", {**g, "messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}),
        r("chat_n2_seeded", "chat",
          {**m, "messages": CHAT, "max_tokens": 8, "n": 2, "temperature": 0.8, "seed": SEED}, sampled=True),
        r("chat_stream", "chat",
          {**g, "messages": CHAT, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}),
        r("chat_stream_logprobs", "chat",
          {**g, "messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, "stream": True}),
        # ---- refusals
        r("error_prompt_too_long", "completions", {**g, "prompt": over, "max_tokens": 4}),
        r("error_prompt_plus_max_tokens_too_long", "completions", {**g, "prompt": fits, "max_tokens": 16}),
        r("error_bad_temperature", "completions", {**m, "prompt": TEXTS[0], "max_tokens": 4, "temperature": -1}),
        r("error_unknown_model", "completions", {**g, "model": "no-such-model", "prompt": TEXTS[0], "max_tokens": 4}),
        r("error_stream_options_without_stream", "completions",
          {**g, "prompt": TEXTS[0], "max_tokens": 4, "stream_options": {"include_usage": True}}),
        r("error_chat_top_logprobs_without_logprobs", "chat",
          {**g, "messages": CHAT, "max_tokens": 4, "top_logprobs": 2}),
    ]  # fmt: skip


def recorded_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as recorded: long token-id lists summarised (the over-long prompts have thousands)."""
    out = dict(body)
    p = out.get("prompt")
    if isinstance(p, list) and len(p) > LONG_LIST and all(isinstance(t, int) for t in p):
        out["prompt"] = f"<{len(p)} token ids: {p[:8]}...>"
    return out


# ------------------------------------------------------------------------------------------------ values
def stream_values(events: list[Any], chat: bool) -> dict[str, Any]:
    """What a client assembles from a stream: per choice index the text, reasons and log-probabilities."""
    choices: dict[int, dict[str, Any]] = {}
    usage: list[Any] = []
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if ev.get("usage") is not None:
            usage.append(ev["usage"])
        for c in ev.get("choices") or []:
            acc = choices.setdefault(int(c.get("index", -1)), {"text": ""})
            delta = (c.get("delta") or {}) if chat else c
            if chat and delta.get("role") is not None:
                acc.setdefault("role", delta["role"])
            acc["text"] += delta.get("content" if chat else "text") or ""
            for key in ("finish_reason", "stop_reason"):
                if c.get(key) is not None:
                    acc[key] = c[key]
            if c.get("token_ids") is not None:
                acc.setdefault("token_ids", []).extend(c["token_ids"])
            lp = c.get("logprobs")
            if lp:
                joined = acc.setdefault("logprobs", {})
                for key, part in lp.items() if isinstance(lp, dict) else []:
                    if isinstance(part, list):
                        joined.setdefault(key, []).extend(part)
    out: dict[str, Any] = {"choices": [{"index": i, **choices[i]} for i in sorted(choices)]}
    out["usage_chunks"] = len(usage)
    if usage:
        out["usage"] = usage[-1]
    return out


def values_of(req: Request, body: Any, stream: bool) -> tuple[Any, Any]:
    """(values, own_values): what is compared across engines, and what only within one."""
    if stream:
        values: Any = stream_values(body, req.route == "chat")
    else:
        values = strip(body)
    if not req.sampled or not isinstance(values, dict) or "choices" not in values:
        return values, None
    usage = values.get("usage") or {}
    cross = {
        "choices": [{"index": c.get("index")} for c in values["choices"]],
        "prompt_tokens": usage.get("prompt_tokens"),
    }
    return cross, values


def sdk_check(req: Request, body: Any, stream: bool, status: int) -> str:
    """Whether the official client's own types take the body: "ok" or the first error."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.model import Model

    if status != 200 or req.route == "tokenize":
        return "n/a"
    try:
        if req.route == "models":
            for card in body["data"]:
                Model.model_validate(card)
        elif stream:
            for ev in body:
                # The client builds a stream's chunks without validating them (a completion chunk's
                # finish_reason is null until the last one, which Completion does not allow): checked here
                # are the chat chunks, and the completion chunks that end their choices.
                if not isinstance(ev, dict):
                    continue
                if req.route == "chat":
                    ChatCompletionChunk.model_validate(ev)
                elif all(c.get("finish_reason") is not None for c in ev.get("choices") or []):
                    Completion.model_validate(ev)
        else:
            (ChatCompletion if req.route == "chat" else Completion).model_validate(body)
    except Exception as e:  # pydantic's ValidationError: where and what, without its version-specific text
        errors = getattr(e, "errors", None)
        if callable(errors):
            found = sorted({f"{'.'.join(str(x) for x in err['loc'])} ({err['type']})" for err in errors()})
            return f"{type(e).__name__}: " + ", ".join(found)[:300]
        return f"{type(e).__name__}: {str(e)[:300]}"
    return "ok"


# ------------------------------------------------------------------------------------------------ running
def sse_events(lines: Iterable[str]) -> Iterator[Any]:
    """The ``data:`` payloads of a server-sent event stream: parsed JSON, or the string "[DONE]"."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        yield data if data == "[DONE]" else json.loads(data)


def send(client: Any, req: Request) -> tuple[int, Any, bool]:
    """(status, body, streamed): the raw JSON (a list of events for a stream), as the wire had it; the client
    sends the request (its serialisation, its headers) and never retries."""
    import openai

    kw = dict(req.body)
    stream = bool(kw.get("stream"))
    if req.route == "models":
        raw = client.models.with_raw_response.list()
        return raw.status_code, json.loads(raw.text), False
    api = client.chat.completions if req.route == "chat" else client.completions
    try:
        with api.with_streaming_response.create(**kw) as resp:
            if stream:
                events = list(sse_events(resp.iter_lines()))
                return resp.status_code, events, True
            return resp.status_code, json.loads(resp.read()), False
    except openai.APIStatusError as e:
        try:
            body = e.response.json()
        except ValueError:
            body = e.response.text
        return e.status_code, body, False


def record_one(client: Any, req: Request) -> dict[str, Any]:
    t0 = time.perf_counter()
    status, body, stream = send(client, req)
    entry: dict[str, Any] = {
        "request": {"route": req.route, "body": recorded_body(req.body), "sampled": req.sampled},
        "status": status,
    }
    if stream:
        events = [e for e in body if isinstance(e, dict)]
        usage_only = [not e.get("choices") and bool(e.get("usage")) for e in events]
        entry["shape"] = {
            **_sorted_shape(shape_all(e for e, u in zip(events, usage_only, strict=True) if not u), "chunk:"),
            **_sorted_shape(shape_all(e for e, u in zip(events, usage_only, strict=True) if u), "usage_chunk:"),
        }
        entry["stream"] = {
            "done": body[-1:] == ["[DONE]"],  # the stream ends with data: [DONE]
            "usage_chunk_last": bool(usage_only) and usage_only[-1],
        }
    else:
        entry["shape"] = _sorted_shape(shape(body))
    entry["values"], own = values_of(req, body, stream)
    if own is not None:
        entry["own_values"] = own
    entry["sdk"] = sdk_check(req, body, stream, status)
    entry["seconds"] = round(time.perf_counter() - t0, 2)  # information only, never compared
    return entry


def record(base_url: str, model: str, api_key: str = "EMPTY", timeout: float = 600) -> dict[str, Any]:
    """Every request of ``request_set`` against the server at ``base_url`` (its root, not /v1)."""
    import httpx
    import openai

    base = base_url.rstrip("/").removesuffix("/v1")
    client = openai.OpenAI(base_url=base + "/v1", api_key=api_key, timeout=timeout, max_retries=0)
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=base, headers=headers, timeout=timeout) as http:
        version = http.get("/version").json().get("version")
        cases: dict[str, Any] = {}
        models = Request("models", "models")
        cases["models"] = record_one(client, models)
        cards = cases["models"]["values"]["data"]
        max_model_len = int(cards[0]["max_model_len"])
        ids = []
        for i, text in enumerate(TEXTS):
            resp = http.post("/tokenize", json={"model": model, "prompt": text})
            body = resp.json()
            ids.append(list(body["tokens"]))
            if i == 0:
                cases["tokenize"] = {
                    "request": {"route": "tokenize", "body": {"model": model, "prompt": text}, "sampled": False},
                    "status": resp.status_code,
                    "shape": _sorted_shape(shape(body)),
                    "values": strip(body),
                    "sdk": "n/a",
                }
        for req in request_set(model, ids, max_model_len):
            cases[req.name] = record_one(client, req)
            print(f"  {req.name}: {cases[req.name]['status']} ({cases[req.name]['seconds']} s)", file=sys.stderr)
    return {
        "tool": "scripts/peers/server_parity.py",
        "server_version": version,
        "model": model,
        "max_model_len": max_model_len,
        "openai": openai.__version__,
        "python": platform.python_version(),
        "cases": cases,
    }


# ------------------------------------------------------------------------------------------------ diff
@dataclass
class Diff:
    """What two records disagree on. Each item is ``case: path (type)`` or ``case: path: theirs != ours``."""

    only_theirs: list[str] = field(default_factory=list)
    only_ours: list[str] = field(default_factory=list)
    values: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.only_theirs or self.only_ours or self.values)

    def report(self, theirs: str = "vLLM", ours: str = "kvlab") -> str:
        out = []
        for title, items in (
            (f"fields {theirs} returns that {ours} does not", self.only_theirs),
            (f"fields {ours} returns that {theirs} does not", self.only_ours),
            ("values that differ", self.values),
        ):
            out.append(f"{title} ({len(items)}):")
            out.extend(f"  {item}" for item in items)
        return "\n".join(out)


def _short(v: Any, limit: int = 160) -> str:
    text = json.dumps(v, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def _same_scalar(a: Any, b: Any, tol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        if isinstance(a, float) or isinstance(b, float):
            return math.isclose(a, b, rel_tol=0, abs_tol=tol) or (math.isnan(a) and math.isnan(b))
        return a == b
    return bool(a == b)


def diff_values(a: Any, b: Any, path: str = "$", tol: float = TOL) -> list[str]:
    """``path: a != b`` wherever the two differ; keys only one side has are skipped (a shape matter)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in a:
            if k in b:
                out += diff_values(a[k], b[k], f"{path}.{k}", tol)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)} items ({_short(a, 80)} != {_short(b, 80)})"]
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += diff_values(x, y, f"{path}[{i}]", tol)
        return out
    if isinstance(a, dict | list) or isinstance(b, dict | list):
        return [f"{path}: {_short(a)} != {_short(b)}"]
    return [] if _same_scalar(a, b, tol) else [f"{path}: {_short(a)} != {_short(b)}"]


def _fields(s: dict[str, list[str]]) -> set[tuple[str, str]]:
    return {(p, t) for p, types in s.items() for t in types}


def diff(theirs: dict[str, Any], ours: dict[str, Any], *, same_engine: bool = False, tol: float = TOL) -> Diff:
    """The differences between two records of ``record``: fields (path and JSON type) only one returns,
    values that differ. ``same_engine``: also the values that agree only within one engine (seeded draws)."""
    d = Diff()
    a_cases, b_cases = theirs["cases"], ours["cases"]
    for case in a_cases.keys() - b_cases.keys():
        d.only_theirs.append(f"{case}: (the whole request: not in the other record)")
    for case in b_cases.keys() - a_cases.keys():
        d.only_ours.append(f"{case}: (the whole request: not in the other record)")
    for case in [c for c in a_cases if c in b_cases]:
        a, b = a_cases[case], b_cases[case]
        # The same request on both sides, but for the served model's name.
        ra, rb = ({k: v for k, v in x["request"]["body"].items() if k != "model"} for x in (a, b))
        d.values += [f"{case}: request{p[1:]}" for p in diff_values(ra, rb, "$", 0)]
        if a["status"] != b["status"]:
            d.values.append(f"{case}: status {a['status']} != {b['status']}")
            continue  # a refusal and an answer: nothing else compares
        fa, fb = _fields(a["shape"]), _fields(b["shape"])
        d.only_theirs += [f"{case}: {p} ({t})" for p, t in sorted(fa - fb)]
        d.only_ours += [f"{case}: {p} ({t})" for p, t in sorted(fb - fa)]
        d.values += [f"{case}: {x}" for x in diff_values(a["values"], b["values"], "$", tol)]
        d.values += [f"{case}: stream.{x[2:]}" for x in diff_values(a.get("stream"), b.get("stream"), "$", tol)]
        if a["sdk"] != b["sdk"]:
            d.values.append(f"{case}: sdk {a['sdk']!r} != {b['sdk']!r}")
        if same_engine and (a.get("own_values") is not None or b.get("own_values") is not None):
            d.values += [
                f"{case}: own_values{x[1:]}" for x in diff_values(a.get("own_values"), b.get("own_values"), "$", tol)
            ]
    return d


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="the server's root URL (http://127.0.0.1:8001; a trailing /v1 is dropped)")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--model", help="the served model name (smollm2 on vllm-serve.sh's server)")
    ap.add_argument("--out", default="-", help="JSON output file (- for stdout)")
    ap.add_argument("--diff", nargs=2, metavar=("THEIRS", "OURS"), help="print the differences of two records")
    ap.add_argument("--same-engine", action="store_true", help="with --diff: compare the seeded draws too")
    args = ap.parse_args(argv)
    if args.diff:
        a, b = (json.loads(Path(p).read_text(encoding="utf-8")) for p in args.diff)
        d = diff(a, b, same_engine=args.same_engine)
        print(d.report(theirs=args.diff[0], ours=args.diff[1]))
        return 0 if d.empty() else 1
    if not (args.base_url and args.model):
        ap.error("--base-url and --model are required (or --diff THEIRS OURS)")
    t0 = time.perf_counter()
    result = record(args.base_url, args.model, args.api_key)
    print(f"{len(result['cases'])} requests in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    text = json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
