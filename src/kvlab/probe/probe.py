"""``kvlab probe``: does a server leak one request's KV state into another's output?

1. References: every passphrase prompt alone, one after another, at temperature 0. Each reference
   request carries a fresh random ``cache_salt`` so that, on a server that honours salts, it cannot
   hit anything cached by an earlier reference (a broken server would otherwise poison the references).
   A server that ignores salts still gives sequential, unbatched references.
2. Bursts: the prompts of one group sent concurrently (``concurrency`` requests, cycling through the
   group, with small staggered arrivals so later ones find the earlier ones' prefixes in the cache),
   without salts, so sharing is possible.
3. Each burst response is ``same`` (equals its own reference), ``contaminated`` (closer to another
   prompt's reference than to its own) or ``diverged`` (different, with no sign of another prompt:
   batching can change the numbers).

Closeness is the length of the common prefix of token ids (the ``token_ids`` kvlab returns) or, for
other servers, of the text.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from kvlab.experiment.passphrases import PassphraseSet

OUTCOMES = ("same", "diverged", "contaminated")


class ProbeError(RuntimeError):
    """The server could not be probed (unreachable, or answering with errors); the message says which."""


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: tuple[int, ...] | None

    def key(self) -> tuple[Any, ...] | str:
        return self.token_ids if self.token_ids is not None else self.text


@dataclass
class Observation:
    group: str
    prompt_index: int
    round: int
    outcome: str
    own_prefix: int  # common-prefix length with its own reference
    closest_other: int | None  # index of the other prompt it is closest to, when contaminated
    other_prefix: int


@dataclass
class ProbeReport:
    base_url: str
    model: str
    rounds: int
    concurrency: int
    max_tokens: int
    counts: dict[str, int] = field(default_factory=dict)
    uninformative_groups: list[str] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def contaminated(self) -> int:
        return self.counts.get("contaminated", 0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _common_prefix(a: tuple[Any, ...] | str, b: tuple[Any, ...] | str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def classify(answer: Answer, own: Answer, others: dict[int, Answer]) -> tuple[str, int, int | None, int]:
    """(outcome, own common prefix, index of the closest other reference, its common prefix)."""
    key = answer.key()
    own_p = _common_prefix(key, own.key())
    if key == own.key():
        return "same", own_p, None, 0
    best, best_p = None, -1
    for idx, ref in others.items():
        if ref.key() == own.key():
            continue  # a reference identical to ours says nothing about where the tokens came from
        p = _common_prefix(key, ref.key())
        exact = key == ref.key()
        if exact or p > best_p:
            best, best_p = idx, (len(key) + 1 if exact else p)
    if best is not None and best_p > own_p:
        return "contaminated", own_p, best, min(best_p, len(key))
    return "diverged", own_p, None, max(best_p, 0)


def normalize_base_url(base_url: str) -> str:
    """The server root, whether given as the root or as the ``/v1`` URL the openai client takes."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1") if url.endswith("/v1") else url


def discover_model(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """The first model id of ``GET /v1/models`` (what ``--model`` defaults to)."""
    import httpx

    url = normalize_base_url(base_url) + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout, follow_redirects=False)
        resp.raise_for_status()
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ProbeError(f"GET {url} did not name a model ({type(exc).__name__}: {exc}); pass --model") from exc


class Client:
    """One identity's connection to an OpenAI-compatible server: a pooled ``httpx.Client`` (keep-alive, so
    timings are not dominated by TCP setup, and every request goes to ``base_url`` only), with the API key,
    if any, sent as ``Authorization: Bearer``. Thread-safe: the burst probe shares one between threads."""

    def __init__(
        self, base_url: str, model: str, timeout: float = 60.0, api_key: str | None = None, max_connections: int = 256
    ) -> None:
        import httpx  # the serve extra; imported here so importing the probe stays cheap

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """POST ``body`` (the model is filled in) and return (the JSON answer, seconds until it was read)."""
        import httpx

        url = self.base_url + path
        t0 = time.perf_counter()
        try:
            resp = self._http.post(path, json={"model": self.model, **body})
            elapsed = time.perf_counter() - t0
        except httpx.HTTPError as exc:
            raise ProbeError(f"cannot reach {url}: {exc}") from exc
        if resp.status_code != 200:
            raise ProbeError(f"{url} answered {resp.status_code}: {resp.text[:300]}")
        try:
            data = resp.json()
        except ValueError as exc:
            raise ProbeError(f"{url} answered with a body that is not JSON: {resp.text[:300]!r}") from exc
        if not isinstance(data, dict) or not data.get("choices"):
            raise ProbeError(f"{url} answered without choices: {resp.text[:300]}")
        return data, elapsed

    def completion(
        self, prompt: str, max_tokens: int, chat: bool = False, salt: str | None = None
    ) -> tuple[dict[str, Any], float]:
        """The raw answer (usage included) of one temperature-0 request, and its latency."""
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if salt is not None:
            body["cache_salt"] = salt
        return self.post("/v1/chat/completions" if chat else "/v1/completions", body)

    def complete(self, prompt: str, max_tokens: int, chat: bool = False, salt: str | None = None) -> Answer:
        data, _ = self.completion(prompt, max_tokens, chat, salt)
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        ids = choice.get("token_ids")
        return Answer(text or "", tuple(ids) if isinstance(ids, list) else None)


def run_probe(
    base_url: str,
    model: str,
    passphrases: PassphraseSet,
    *,
    concurrency: int = 8,
    rounds: int = 3,
    max_tokens: int = 16,
    stagger: float = 0.02,
    seed: int = 0,
    api_key: str | None = None,
) -> ProbeReport:
    """Probe ``base_url``; see the module docstring for the method."""
    with Client(base_url, model, api_key=api_key, max_connections=concurrency) as client:
        return _run_probe(client, passphrases, concurrency, rounds, max_tokens, stagger, seed)


def _run_probe(
    client: Client,
    passphrases: PassphraseSet,
    concurrency: int,
    rounds: int,
    max_tokens: int,
    stagger: float,
    seed: int,
) -> ProbeReport:
    t0 = time.perf_counter()
    base_url, model = client.base_url, client.model
    rng = random.Random(seed)
    report = ProbeReport(base_url, model, rounds, concurrency, max_tokens)
    refs: dict[str, list[Answer]] = {}
    for g in passphrases.groups:
        chat = g.chat_template
        refs[g.name] = [client.complete(p, max_tokens, chat, salt=f"probe-ref-{uuid.uuid4().hex}") for p in g.prompts]
        if len({a.key() for a in refs[g.name]}) < 2:
            report.uninformative_groups.append(g.name)
    counts: Counter[str] = Counter({o: 0 for o in OUTCOMES})
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for r in range(rounds):
            for g in passphrases.groups:
                chat = g.chat_template
                order = [i % len(g.prompts) for i in range(concurrency)]
                rng.shuffle(order)
                delays = sorted(rng.uniform(0, stagger) for _ in order)

                def one(idx: int, delay: float, g=g, chat=chat, r=r) -> None:
                    time.sleep(delay)
                    ans = client.complete(g.prompts[idx], max_tokens, chat)
                    ref = refs[g.name]
                    others = {j: a for j, a in enumerate(ref) if j != idx}
                    outcome, own_p, other, other_p = classify(ans, ref[idx], others)
                    with lock:
                        counts[outcome] += 1
                        report.observations.append(Observation(g.name, idx, r, outcome, own_p, other, other_p))

                for fut in [pool.submit(one, i, d) for i, d in zip(order, delays, strict=True)]:
                    fut.result()
    report.counts = dict(counts)
    report.seconds = time.perf_counter() - t0
    return report
