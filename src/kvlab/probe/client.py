"""The probe's view of a server: one pooled HTTP client, the answers it reads, and what the server offers.

A probe is only worth what its comparisons are worth, and servers differ in what they tell a client:

- token ids of an answer: kvlab returns ``choices[].token_ids``; vLLM does when asked (``return_token_ids``);
  llama.cpp's native ``/completion`` does with ``return_tokens``; llama.cpp and vLLM offer ``/tokenize``;
  anything else gives text only. ``detect_capabilities`` finds the best of these, once per run.
- how much of a prompt was cached: read by ``kvlab.openai_http.cached_tokens_of``, whichever field the server
  uses.
- whether a body ``cache_salt`` is accepted at all (transformers' server answers 422 to unknown fields).

Every error names the URL that was actually requested (the base URL may carry a path of its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvlab.openai_http import (
    answered,
    auth_headers,
    cached_tokens_of,
    excerpt,
    requested_url,
    server_root,
    token_ids_of,
)

IDS_MODES = ("response", "return_token_ids", "native", "tokenize", "text")


class ProbeError(RuntimeError):
    """The server could not be probed (unreachable, or answering with errors); the message says which."""


class HTTPStatusError(ProbeError):
    """A request was answered with a status other than 200; ``status`` and ``url`` say which and where."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(answered("POST", url, status, body))
        self.url, self.status, self.body = url, status, body


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: tuple[int, ...] | None

    def key(self) -> tuple[int, ...] | str:
        """What answers are compared by: the token ids where the server gave them, else the text."""
        return self.token_ids if self.token_ids is not None else self.text


class ProbeClient:
    """One identity's connection to an OpenAI-compatible server: a pooled ``httpx.Client`` (keep-alive, so
    timings are not dominated by TCP setup, and every request goes to the server's root only: ``base_url``
    may be given with or without its ``/v1``), with the API key, if any, sent as ``Authorization: Bearer``.
    Thread-safe: the burst probe shares one between threads.

    ``ids_mode`` (one of ``IDS_MODES``) says how ``complete`` obtains token ids; ``tokenize_body`` is the
    body shape of the server's ``/tokenize`` (llama.cpp's ``content`` or vLLM's ``prompt``), if it has one."""

    def __init__(
        self, base_url: str, model: str, timeout: float = 60.0, api_key: str | None = None, max_connections: int = 256
    ) -> None:
        import httpx  # the serve extra; imported here so importing the probe stays cheap

        self.base_url = server_root(base_url)
        self.model = model
        self.timeout = timeout
        self.ids_mode = "response"
        self.tokenize_body: dict[str, Any] | None = None
        headers = auth_headers(api_key)
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            # Only the given URL: a redirect elsewhere is an error, never followed.
            follow_redirects=False,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ProbeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """POST ``body`` with the model filled in (servers that serve one model ignore it) and return (the JSON
        answer, seconds until it was read). Errors carry the URL httpx actually requested."""
        import httpx

        t0 = time.perf_counter()
        try:
            resp = self._http.post(path, json={"model": self.model, **body})
            elapsed = time.perf_counter() - t0
        except httpx.HTTPError as exc:
            url = requested_url(exc, self.base_url + path)
            raise ProbeError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
        url = str(resp.request.url)
        if resp.status_code != 200:
            raise HTTPStatusError(url, resp.status_code, resp.text)
        try:
            data = resp.json()
        except ValueError as exc:
            raise ProbeError(f"POST {url} answered with a body that is not JSON: {excerpt(resp.text)!r}") from exc
        if not isinstance(data, dict):
            raise ProbeError(f"POST {url} answered with JSON that is not an object: {excerpt(resp.text)}")
        return data, elapsed

    def get(self, path: str) -> tuple[int, str]:
        """(status, body) of ``GET path``. A refusal is an answer here, not an error: the caller reads it."""
        import httpx

        try:
            resp = self._http.get(path)
        except httpx.HTTPError as exc:
            url = requested_url(exc, self.base_url + path)
            raise ProbeError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
        return resp.status_code, resp.text

    def completion(
        self, prompt: str, max_tokens: int, chat: bool = False, salt: str | None = None, **extra: Any
    ) -> tuple[dict[str, Any], float]:
        """The raw answer (usage included) of one temperature-0 request, and its latency."""
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, **extra}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if salt is not None:
            body["cache_salt"] = salt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        data, seconds = self.post(path, body)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ProbeError(f"POST {self.base_url}{path} answered without choices: {excerpt(str(data))}")
        return data, seconds

    def complete(self, prompt: str, max_tokens: int, chat: bool = False, salt: str | None = None) -> Answer:
        """One temperature-0 answer, with token ids obtained the way ``ids_mode`` says."""
        if self.ids_mode == "native" and not chat:
            return self._native(prompt, max_tokens, salt)
        extra = {"return_token_ids": True} if self.ids_mode == "return_token_ids" else {}
        data, _ = self.completion(prompt, max_tokens, chat, salt, **extra)
        choice = data["choices"][0]
        text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
        text = text if isinstance(text, str) else ""
        if self.ids_mode in ("response", "return_token_ids"):
            return Answer(text, token_ids_of(choice.get("token_ids")))
        if self.tokenize_body is not None:
            return Answer(text, self.tokenize(text))
        return Answer(text, None)

    def _native(self, prompt: str, max_tokens: int, salt: str | None) -> Answer:
        """llama.cpp's own endpoint: the same slots and cache as its OpenAI one, and the generated ids."""
        body: dict[str, Any] = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "return_tokens": True}
        if salt is not None:
            body["cache_salt"] = salt
        data, _ = self.post("/completion", body)
        text = data.get("content")
        return Answer(text if isinstance(text, str) else "", token_ids_of(data.get("tokens")))

    def tokenize(self, text: str) -> tuple[int, ...] | None:
        if self.tokenize_body is None:
            return None
        if not text:
            return ()
        body = {k: (text if v is None else v) for k, v in self.tokenize_body.items()}
        data, _ = self.post("/tokenize", body)
        return token_ids_of(data.get("tokens"))


@dataclass
class SaltAcceptance:
    accepted: bool
    status: int | None = None  # the refusal's status
    url: str = ""
    message: str = ""


@dataclass
class Capabilities:
    ids_mode: str  # one of IDS_MODES
    tokenize: str | None  # the /tokenize body shape found ("content" or "prompt"), or None
    cached_tokens: bool  # does a response say how much of its prompt was cached?
    salt: SaltAcceptance

    @property
    def unit(self) -> str:
        return "characters" if self.ids_mode == "text" else "tokens"


# /tokenize bodies, tried in order: llama.cpp's, then vLLM's (also kvlab's) without and with special tokens.
_TOKENIZE_BODIES: tuple[dict[str, Any], ...] = (
    {"content": None, "add_special": False},
    {"prompt": None, "add_special_tokens": False},
    {"prompt": None},
)


def find_tokenizer(client: ProbeClient) -> bool:
    """Set ``client.tokenize_body`` to the ``/tokenize`` body shape this server takes (None: it has none)."""
    client.tokenize_body = next((b for b in _TOKENIZE_BODIES if _works(client, "/tokenize", b)), None)
    return client.tokenize_body is not None


def detect_capabilities(client: ProbeClient, probe_prompt: str, has_chat: bool) -> Capabilities:
    """Find out, with a handful of requests, how this server gives token ids and cache reports and whether
    it accepts ``cache_salt``. Sets ``client.ids_mode`` and ``client.tokenize_body`` accordingly."""
    data, _ = client.completion(probe_prompt, 2)  # a server that cannot answer this fails the probe here
    cached = cached_tokens_of(data) is not None
    salt = _salt_acceptance(client, probe_prompt)
    find_tokenizer(client)
    tokenize = None if client.tokenize_body is None else next(iter(client.tokenize_body))
    if token_ids_of(data["choices"][0].get("token_ids")) is not None:
        mode = "response"
    elif _works(client, "/v1/completions", {"prompt": probe_prompt, "max_tokens": 2, "return_token_ids": True}):
        mode = "return_token_ids"
    elif (not has_chat or tokenize) and _works(client, "/completion", _native_body(probe_prompt)):
        mode = "native"  # chat prompts then go through /v1/chat/completions and /tokenize
    else:
        mode = "tokenize" if tokenize else "text"
    client.ids_mode = mode
    return Capabilities(mode, tokenize, cached, salt)


def _native_body(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": 2, "temperature": 0, "return_tokens": True}


def _works(client: ProbeClient, path: str, body: dict[str, Any]) -> bool:
    """Does ``path`` answer ``body`` with token ids? (Any refusal or other shape just means "not offered".)"""
    body = {k: ("probe" if v is None else v) for k, v in body.items()}
    try:
        data, _ = client.post(path, body)
    except ProbeError:
        return False
    if path == "/v1/completions":
        choices = data.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        return isinstance(first, dict) and token_ids_of(first.get("token_ids")) is not None
    return token_ids_of(data.get("tokens")) is not None


def _salt_acceptance(client: ProbeClient, prompt: str) -> SaltAcceptance:
    try:
        client.completion(prompt, 2, salt="probe-salt-check")
    except HTTPStatusError as exc:
        if 400 <= exc.status < 500:
            return SaltAcceptance(False, exc.status, exc.url, excerpt(exc.body))
        raise
    return SaltAcceptance(True)
