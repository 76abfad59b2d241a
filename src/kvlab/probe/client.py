"""The probe's view of a server: one pooled HTTP client, the answers it reads, and what the server offers.

A probe is only worth what its comparisons are worth, and servers differ in what they tell a client:

- token ids of an answer: kvlab returns ``choices[].token_ids``; vLLM does when asked (``return_token_ids``);
  llama.cpp's native ``/completion`` does with ``return_tokens``; llama.cpp and vLLM offer ``/tokenize``;
  anything else gives text only. ``detect_capabilities`` finds the best of these, once per run.
- how much of a prompt was cached: read by ``kvlab.openai_http.cached_tokens_of``, whichever field the server
  uses.
- whether a body ``cache_salt`` is accepted at all (transformers' server answers 422 to unknown fields).

Every error names the URL that was actually requested (the base URL may carry a path of its own).

A slow or overloaded server must not end a run with its first slow answer: every request has a timeout of its
own, and a timeout, a connection error, a 429 or a 5xx is retried (``retries`` times, exponential backoff with
jitter, a ``Retry-After`` honoured up to ``RETRY_AFTER_MAX``). A request that still fails raises ``GaveUp``;
the phases drop it and carry on with what they measured (``try_complete``, ``tolerate``). ``stats`` counts it
all per phase (the phase is learnt from the probe's progress events: ``watch``), for the report. A retried
request's latency is its last attempt's. An attempt that timed out may still have been computed, and cached,
by the server, so its retry can find its own prompt cached: ``timed_out`` counts such requests, and the
findings that read cache state say so (an "ignored" salt seen through them is only inconclusive).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from kvlab.openai_http import (
    answered,
    auth_headers,
    cached_tokens_of,
    excerpt,
    requested_url,
    server_root,
    token_ids_of,
)

if TYPE_CHECKING:
    import httpx

    from kvlab.probe.progress import PhaseProgress, ProgressCallback

IDS_MODES = ("response", "return_token_ids", "native", "tokenize", "text")
DEFAULT_TIMEOUT = 60.0  # seconds per attempt
DEFAULT_RETRIES = 2  # per request, after its first attempt
BACKOFF = 0.5  # seconds before the first retry, doubled for each further one (times a jitter of 1 to 1.5)
MAX_BACKOFF = 8.0
RETRY_AFTER_MAX = 30.0  # the longest Retry-After honoured
MAX_DROPS_LISTED = 50  # the requests that gave up, listed in the report (all are counted)
P = ParamSpec("P")
T = TypeVar("T")


def retried_status(status: int) -> bool:
    """Statuses worth another attempt: overload (429) and the server's own errors (5xx)."""
    return status == 429 or 500 <= status < 600


class ProbeError(RuntimeError):
    """The server could not be probed (unreachable, or answering with errors); the message says which."""


class HTTPStatusError(ProbeError):
    """A request was answered with a status other than 200; ``status`` and ``url`` say which and where."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(answered("POST", url, status, body))
        self.url, self.status, self.body = url, status, body


class GaveUp(ProbeError):
    """A request still failed after its retries (``attempts`` in all): a timeout, a connection error, or an
    answer with ``status`` 429 or 5xx (None: no answer at all). The phase it was sent in drops it."""

    def __init__(self, method: str, url: str, attempts: int, reason: str, status: int | None = None) -> None:
        super().__init__(gave_up_message(method, url, attempts, reason))
        self.method, self.url, self.attempts, self.reason, self.status = method, url, attempts, reason, status


def gave_up_message(method: str, url: str, attempts: int, reason: str) -> str:
    return f"{method} {url} gave up after {attempts} attempts: {reason}"


@dataclass
class PhaseRequests:
    """The requests of one phase: ``sent`` (each counted once, however many attempts it took), ``retried``
    (those that needed more than one), ``retries`` (the extra attempts), ``gave_up`` (those that still failed:
    dropped), ``timed_out`` (retried ones with an attempt that timed out: the server may have computed it)."""

    sent: int = 0
    retried: int = 0
    retries: int = 0
    gave_up: int = 0
    timed_out: int = 0


@dataclass
class DroppedRequest:
    phase: str
    method: str
    url: str
    attempts: int
    reason: str

    def __str__(self) -> str:
        return gave_up_message(self.method, self.url, self.attempts, self.reason)


@dataclass
class RequestStats:
    """What it took to get the run's answers: the timeout and retries allowed, and the requests per phase."""

    timeout: float
    max_retries: int
    phases: dict[str, PhaseRequests] = field(default_factory=dict)
    dropped: list[DroppedRequest] = field(default_factory=list)  # the first MAX_DROPS_LISTED that gave up

    def phase(self, name: str) -> PhaseRequests:
        return self.phases.get(name) or PhaseRequests()

    @property
    def sent(self) -> int:
        return sum(p.sent for p in self.phases.values())

    @property
    def retried(self) -> int:
        return sum(p.retried for p in self.phases.values())

    @property
    def retries(self) -> int:
        return sum(p.retries for p in self.phases.values())

    @property
    def gave_up(self) -> int:
        return sum(p.gave_up for p in self.phases.values())

    def summary(self) -> str:
        text = (
            f"{self.sent} sent, {self.retried} retried ({self.retries} retries; timeout {self.timeout:g}s, "
            f"{self.max_retries} retries allowed each), {self.gave_up} gave up"
        )
        lost = {name: p.gave_up for name, p in self.phases.items() if p.gave_up}
        if lost:
            text += " and were dropped (" + ", ".join(f"{name}: {n}" for name, n in lost.items()) + ")"
        return text


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
    body shape of the server's ``/tokenize`` (llama.cpp's ``content`` or vLLM's ``prompt``), if it has one.

    ``timeout``: seconds per attempt; ``retries``: further attempts after a timeout, a connection error, a 429
    or a 5xx, ``backoff`` seconds apart at first (default ``BACKOFF``), doubling (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout: float = DEFAULT_TIMEOUT,
        api_key: str | None = None,
        max_connections: int = 256,
        retries: int = DEFAULT_RETRIES,
        backoff: float | None = None,
    ) -> None:
        import httpx  # imported here so importing the probe stays cheap

        if not timeout > 0 or retries < 0:
            raise ValueError(f"the request timeout must be > 0 and retries >= 0, got {timeout} and {retries}")
        self.base_url = server_root(base_url)
        self.model = model
        self.timeout = timeout
        self.retries = retries
        self.backoff = BACKOFF if backoff is None else backoff
        self.ids_mode = "response"
        self.tokenize_body: dict[str, Any] | None = None
        self.phase = ""  # the probe phase requests are counted under (``watch``)
        self.stats = RequestStats(timeout, retries)
        self._lock = threading.Lock()  # the stats: the burst probe sends from several threads
        self._jitter = random.Random()
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

    # ------------------------------------------------------------------------------------------- phases, drops
    def watch(self, progress: ProgressCallback | None = None) -> ProgressCallback:
        """A progress callback that tells this client which phase its requests belong to (for ``stats``), then
        passes the event on to ``progress``."""

        def on_event(event: PhaseProgress) -> None:
            if event.done == 0 and not event.finished:
                self.phase = event.phase
            if progress is not None:
                progress(event)

        return on_event

    def tolerate(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """``fn(*args, **kwargs)``, or None when one of its requests gave up after its retries (counted in
        ``stats``): for a step that is worth nothing without all of its requests."""
        try:
            return fn(*args, **kwargs)
        except GaveUp:
            return None

    def try_complete(self, prompt: str, max_tokens: int, chat: bool = False, salt: str | None = None) -> Answer | None:
        """``complete``, or None when the request gave up after its retries (dropped; ``stats`` has it)."""
        return self.tolerate(self.complete, prompt, max_tokens, chat, salt)

    def _count(self, attempts: int, timed_out: bool, dropped: DroppedRequest | None = None) -> None:
        with self._lock:
            phase = self.stats.phases.setdefault(self.phase or "other", PhaseRequests())
            phase.sent += 1
            phase.retried += attempts > 1
            phase.retries += attempts - 1
            phase.timed_out += timed_out and attempts > 1 and dropped is None
            if dropped is not None:
                phase.gave_up += 1
                if len(self.stats.dropped) < MAX_DROPS_LISTED:
                    self.stats.dropped.append(dropped)

    def _delay(self, attempt: int, resp: httpx.Response | None) -> float:
        """Seconds to wait before attempt ``attempt + 1``: exponential with jitter, at least a Retry-After."""
        delay = min(self.backoff * 2 ** (attempt - 1), MAX_BACKOFF) * self._jitter.uniform(1.0, 1.5)
        after = resp.headers.get("retry-after") if resp is not None else None
        try:
            return max(delay, min(float(after), RETRY_AFTER_MAX)) if after else delay
        except ValueError:  # an HTTP date: not worth parsing for a probe
            return delay

    def _send(
        self, method: str, path: str, body: dict[str, Any] | None, retry_status: bool = True
    ) -> tuple[httpx.Response, float]:
        """(the answer, seconds until it was read) of the last attempt; a timeout, a connection error and (with
        ``retry_status``) a 429 or 5xx are retried. ``GaveUp`` when the last attempt failed too; ``ProbeError``
        for errors no retry mends (an unsupported URL, a redirect loop)."""
        import httpx

        attempt, timed_out = 0, False
        while True:
            attempt += 1
            resp: httpx.Response | None = None
            t0 = time.perf_counter()
            try:
                resp = self._http.request(method, path, json=body)
                elapsed = time.perf_counter() - t0
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                timed_out = timed_out or isinstance(exc, httpx.TimeoutException)
                url, reason, status = requested_url(exc, self.base_url + path), f"{type(exc).__name__}: {exc}", None
            except httpx.HTTPError as exc:
                url = requested_url(exc, self.base_url + path)
                self._count(attempt, timed_out)
                raise ProbeError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
            else:
                if not (retry_status and retried_status(resp.status_code)):
                    self._count(attempt, timed_out)
                    return resp, elapsed
                url, status = str(resp.request.url), resp.status_code
                reason = answered(method, url, status, resp.text).removeprefix(f"{method} {url} ")
            if attempt > self.retries:
                self._count(attempt, timed_out, DroppedRequest(self.phase or "other", method, url, attempt, reason))
                raise GaveUp(method, url, attempt, reason, status)
            time.sleep(self._delay(attempt, resp))

    def post(self, path: str, body: dict[str, Any], retry_status: bool = True) -> tuple[dict[str, Any], float]:
        """POST ``body`` with the model filled in (servers that serve one model ignore it) and return (the JSON
        answer, seconds until it was read). Errors carry the URL httpx actually requested. Retried as
        ``_send`` says (``retry_status``: a 429 or 5xx too)."""
        resp, elapsed = self._send("POST", path, {"model": self.model, **body}, retry_status)
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
        """(status, body) of ``GET path``. A refusal is an answer here, not an error: the caller reads it (only
        a timeout or a connection error is retried)."""
        resp, _ = self._send("GET", path, None, retry_status=False)
        return resp.status_code, resp.text

    def completion(
        self, prompt: str | Sequence[int], max_tokens: int, chat: bool = False, salt: str | None = None, **extra: Any
    ) -> tuple[dict[str, Any], float]:
        """The raw answer (usage included) of one temperature-0 request, and its latency. ``prompt``: text, or
        token ids (completions only)."""
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, **extra}
        if chat:
            if not isinstance(prompt, str):
                raise ValueError("a chat request takes a text prompt")
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
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
    status: int | None = None  # the refusal's status (None with accepted False: the check gave up)
    url: str = ""
    message: str = ""

    @property
    def unknown(self) -> bool:
        """The check's request gave up after its retries: the probe carries on without salts, not knowing."""
        return not self.accepted and self.status is None


@dataclass
class Capabilities:
    ids_mode: str  # one of IDS_MODES
    tokenize: str | None  # the /tokenize body shape found ("content" or "prompt"), or None
    cached_tokens: bool  # does a response say how much of its prompt was cached?
    salt: SaltAcceptance
    # What could not be learnt because the baseline request gave up after its retries ("": nothing lost).
    lost: str = ""

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
    it accepts ``cache_salt``. Sets ``client.ids_mode`` and ``client.tokenize_body`` accordingly.

    A request that gives up after its retries costs only what it would have told: the baseline's answer is
    then read from the salt check's (the same prompt), the salt check's loss leaves salts unknown (the probe
    carries on without them). Where neither was answered the server answers no completion at all: nothing
    can be measured, and a ``ProbeError`` says so (the probe's exit status 2)."""
    baseline: GaveUp | None = None
    try:
        data: dict[str, Any] | None = client.completion(probe_prompt, 2)[0]
    except GaveUp as exc:
        data, baseline = None, exc
    salt, salted = _salt_acceptance(client, probe_prompt)
    if data is None and salt.unknown:
        raise ProbeError(
            f"nothing could be measured: the server answered neither of the probe's first two requests ({baseline}; "
            f"the same with cache_salt: {salt.message}); raise --request-timeout or --retries"
        )
    lost = ""
    if data is None:
        data = salted
    if data is None:  # the baseline gave up and the salted copy was refused: no answer to read
        lost = f"cached_tokens unknown (taken as not reported): the baseline request {baseline}"
    cached = data is not None and cached_tokens_of(data) is not None
    find_tokenizer(client)
    tokenize = None if client.tokenize_body is None else next(iter(client.tokenize_body))
    if data is not None and token_ids_of(data["choices"][0].get("token_ids")) is not None:
        mode = "response"
    elif _works(client, "/v1/completions", {"prompt": probe_prompt, "max_tokens": 2, "return_token_ids": True}):
        mode = "return_token_ids"
    elif (not has_chat or tokenize) and _works(client, "/completion", _native_body(probe_prompt)):
        mode = "native"  # chat prompts then go through /v1/chat/completions and /tokenize
    else:
        mode = "tokenize" if tokenize else "text"
    client.ids_mode = mode
    return Capabilities(mode, tokenize, cached, salt, lost)


def _native_body(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": 2, "temperature": 0, "return_tokens": True}


def _works(client: ProbeClient, path: str, body: dict[str, Any]) -> bool:
    """Does ``path`` answer ``body`` with token ids? (Any refusal or other shape just means "not offered".)"""
    body = {k: ("probe" if v is None else v) for k, v in body.items()}
    try:
        # A 5xx is how some servers refuse a body they do not take: an answer here, not worth retrying.
        data, _ = client.post(path, body, retry_status=False)
    except ProbeError:  # a request that gave up too: the probe goes on without what it would have offered
        return False
    if path == "/v1/completions":
        choices = data.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        return isinstance(first, dict) and token_ids_of(first.get("token_ids")) is not None
    return token_ids_of(data.get("tokens")) is not None


def _salt_acceptance(client: ProbeClient, prompt: str) -> tuple[SaltAcceptance, dict[str, Any] | None]:
    """Is a body ``cache_salt`` accepted, and the answer where it was. A check that gave up after its retries:
    not accepted, with no status (``SaltAcceptance.unknown``)."""
    try:
        data, _ = client.completion(prompt, 2, salt="probe-salt-check")
    except GaveUp as exc:
        return SaltAcceptance(False, None, exc.url, f"gave up after its retries: {exc}"), None
    except HTTPStatusError as exc:
        if 400 <= exc.status < 500:
            return SaltAcceptance(False, exc.status, exc.url, excerpt(exc.body)), None
        raise
    return SaltAcceptance(True), data
