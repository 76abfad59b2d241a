"""Stand-in servers for the probe's tests: small FastAPI apps that each reproduce one behaviour of a server
nobody here wrote (llama.cpp, transformers serve), answering instantly from a toy "model".

The toy model: an answer is a deterministic function of the text it is computed from, a run of words
picked by a hash of that text. A request's text is its prompt, plus whatever foreign state the stand-in's
cache lets in (the reuse stand-in appends the other request's text that its reused chunk was computed
after), plus, under batching noise, a marker that another request was in flight. So an answer changes
exactly when the behaviour under test says it should. Latency: ``per_char`` seconds per uncached prompt
character, so a cache hit answers faster (tens of milliseconds at most). Only 1-token requests pay it: the
probe times nothing else, and a real server's cost for the others would only slow the tests down.

Behaviours (``Behaviour`` fields): refusing unknown fields with 422 (transformers), registering only
requests that generate at least 2 tokens (transformers' continuous batching), honouring or ignoring
``cache_salt``, reporting cached tokens (OpenAI's usage field, or llama.cpp's ``timings.cache_n``), token
ids in the response (kvlab) or through ``/tokenize`` and the native ``/completion`` (llama.cpp), one slot
with llama.cpp's ``--cache-reuse`` chunk matching, answers that change when requests overlap, and vLLM's
tokens and blocks (several characters a token, cached_tokens in whole 128-token blocks, max_model_len in
/v1/models), fixed hit/miss latencies, and a cache per API key.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import socket
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

VOCAB = [c1 + v + c2 for c1 in "bdfgklmnprstvz" for v in "aeiou" for c2 in "lnrst"][:256]
# Cached characters from which cache_noise changes an answer: more than a nonce tag shares with an unrelated
# prompt, less than any reuse group's prefix.
CACHE_NOISE_MIN = 32
KNOWN_FIELDS = {"model", "prompt", "messages", "max_tokens", "temperature", "stream", "top_p", "n", "stop"}


@dataclass
class Behaviour:
    reject_unknown: bool = False  # 422 on any field outside KNOWN_FIELDS (transformers serve)
    salts: str = "honour"  # honour | ignore (when accepted)
    cache: bool = True
    register_min_tokens: int = 1  # 2: a 1-token request never enters the cache
    report_cached: str | None = None  # None | "usage" (prompt_tokens_details) | "timings" (llama.cpp's cache_n)
    token_ids: bool = False  # choices[].token_ids (kvlab)
    tokenize: bool = False  # POST /tokenize {"content"} (llama.cpp)
    native: bool = False  # POST /completion with return_tokens (llama.cpp)
    single_slot: bool = False  # one slot holding the previous prompt (llama.cpp -np 1) instead of a block cache
    reuse_chunk: int | None = None  # with single_slot: llama.cpp's --cache-reuse N (in characters here)
    # With single_slot: llama.cpp's host prompt cache (--cache-ram): a prompt seen before is restored whole,
    # with whatever state it was computed from then, instead of being matched against the slot.
    prompt_cache: bool = False
    batch_noise: bool = False  # an answer changes when another request overlapped it
    # An answer changes when part of its prompt came from the cache (llama.cpp recomputes only the rest, in
    # another kernel shape, and near-ties flip): the same prompt answers one way fresh and another cached.
    cache_noise: bool = False
    per_char: float = 2e-5  # seconds per uncached prompt character
    busy: float = 0.0  # extra seconds every request stays in flight
    # vLLM-like tokens and blocks: a token is ``chars_per_token`` characters (what usage.prompt_tokens counts),
    # the cache keeps whole blocks of ``block`` tokens (cached_tokens is floored to them, and a hit leaves at
    # least the last prompt token to compute), /v1/models offers ``max_model_len`` and a longer request is
    # refused with 400 (vLLM's "maximum context length" error).
    chars_per_token: int = 1
    block: int = 1
    max_model_len: int | None = None
    offer_max_model_len: bool = True  # False: /v1/models leaves it out (only the refusal names it)
    # (hit, miss) seconds of a 1-token request instead of per_char's (a hit: at least half the prompt cached).
    fixed_latency: tuple[float, float] | None = None
    tenants: bool = False  # one cache namespace per API key (the Authorization header), as kvlab's tenants


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def toy_answer(text: str, n: int) -> list[int]:
    digest = b""
    counter = itertools.count()
    while len(digest) < n:
        digest += hashlib.sha256(f"{next(counter)}|{text}".encode()).digest()
    return list(digest[:n])


def toy_tokenize(text: str) -> list[int]:
    return [VOCAB.index(w) if w in VOCAB else 1000 + zlib.crc32(w.encode()) % 100000 for w in text.split()]


class Toy:
    """The server's state: the block cache (prompts by namespace) or the single slot, and requests in flight."""

    def __init__(self, b: Behaviour) -> None:
        self.b = b
        self.cached: dict[str, list[str]] = defaultdict(list)
        self.slot = ""
        self.saved: dict[str, str] = {}  # the host prompt cache: prompt -> the foreign state it was computed with
        self.slot_lock = asyncio.Lock()
        self.active: dict[int, bool] = {}  # request -> did another one overlap it?
        self.ids = itertools.count()

    def tokens(self, prompt: str) -> int:
        return -(-len(prompt) // self.b.chars_per_token)

    def lookup(self, ns: str, prompt: str) -> tuple[int, str]:
        """Cached tokens: the common prefix with a cached prompt in whole tokens, at most all but the last prompt
        token, floored to whole blocks."""
        if not self.b.cache:
            return 0, ""
        hit = max((common_prefix(prompt, p) for p in self.cached[ns]), default=0)
        tokens = min(hit // self.b.chars_per_token, self.tokens(prompt) - 1)
        return tokens // self.b.block * self.b.block, ""

    def slot_lookup(self, prompt: str) -> tuple[int, str]:
        """llama.cpp's slot reuse: the common prefix, then (``reuse_chunk``) every chunk of at least N characters
        that matches somewhere later in the slot, shifted into place. A chunk computed after other text than
        the prompt's own carries that text into the answer: the leak."""
        if self.b.prompt_cache and prompt in self.saved:
            self.slot = prompt
            return len(prompt) - 1, self.saved[prompt]
        slot, n_min = self.slot, self.b.reuse_chunk
        cached = head_c = head_p = min(common_prefix(prompt, slot), len(prompt) - 1)
        foreign = ""
        while n_min is not None and head_c < len(slot) and head_p < len(prompt):
            n = common_prefix(slot[head_c:], prompt[head_p:])
            if n >= n_min:
                if not foreign and slot[:head_c] != prompt[:head_p]:
                    foreign = "|computed after:" + slot[:head_c]
                cached, head_c, head_p = cached + n, head_c + n, head_p + n
            else:
                head_c += 1
        self.slot = prompt
        self.saved[prompt] = foreign
        return min(cached, len(prompt) - 1), foreign

    def latency(self, uncached: int, max_tokens: int, cached: int = 0) -> float:
        """``cached`` characters of the prompt were cached, ``uncached`` were not."""
        if max_tokens != 1:
            return self.b.busy
        if self.b.fixed_latency is not None:
            return self.b.fixed_latency[0 if cached >= uncached else 1] + self.b.busy
        return self.b.per_char * uncached + self.b.busy

    async def generate(self, prompt: str, max_tokens: int, salt: str | None, tenant: str = "") -> tuple[list[int], int]:
        rid = next(self.ids)
        self.active[rid] = False
        if len(self.active) > 1:  # every request in flight now overlapped another one
            self.active = dict.fromkeys(self.active, True)
        try:
            if self.b.single_slot:
                async with self.slot_lock:  # one slot: one request at a time
                    cached, foreign = self.slot_lookup(prompt)
                    await asyncio.sleep(self.latency(len(prompt) - cached, max_tokens))
            else:
                ns = salt if salt is not None and self.b.salts == "honour" else ""
                ns = f"{tenant if self.b.tenants else ''}|{ns}"
                cached, foreign = self.lookup(ns, prompt)
                uncached = len(prompt) - cached * self.b.chars_per_token
                await asyncio.sleep(self.latency(uncached, max_tokens, cached * self.b.chars_per_token))
                if self.b.cache and max_tokens >= self.b.register_min_tokens:
                    self.cached[ns].append(prompt)
            noise = "|batched" if self.b.batch_noise and self.active[rid] else ""
            noise += "|cached" if self.b.cache_noise and cached >= CACHE_NOISE_MIN else ""
            return toy_answer(prompt + foreign + noise, max_tokens), cached
        finally:
            del self.active[rid]


def _text(ids: list[int]) -> str:
    return "".join(" " + VOCAB[i] for i in ids)


def build_app(b: Behaviour) -> FastAPI:
    app, toy = FastAPI(), Toy(b)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {"id": "toy", "object": "model"}
        if b.max_model_len is not None and b.offer_max_model_len:
            card["max_model_len"] = b.max_model_len
        return {"object": "list", "data": [card]}

    async def openai(request: Request, chat: bool) -> JSONResponse:
        body = await request.json()
        unknown = set(body) - KNOWN_FIELDS
        if b.reject_unknown and unknown:
            return JSONResponse({"error": f"Unexpected fields in the request: {unknown}"}, status_code=422)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        max_tokens = int(body.get("max_tokens", 16))
        if b.max_model_len is not None and toy.tokens(prompt) + max_tokens > b.max_model_len:
            message = (
                f"This model's maximum context length is {b.max_model_len} tokens. However, you requested "
                f"{toy.tokens(prompt) + max_tokens} tokens ({toy.tokens(prompt)} in the messages, {max_tokens} in "
                "the completion)."
            )
            return JSONResponse({"error": {"message": message, "type": "BadRequestError"}}, status_code=400)
        tenant = request.headers.get("authorization", "")
        ids, cached = await toy.generate(prompt, max_tokens, body.get("cache_salt"), tenant)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": _text(ids)}} if chat else {"text": _text(ids)})
        if b.token_ids:
            choice["token_ids"] = ids
        data: dict[str, Any] = {"choices": [choice], "usage": {"prompt_tokens": toy.tokens(prompt)}}
        if b.report_cached == "usage":
            data["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        elif b.report_cached == "timings":
            data["timings"] = {"cache_n": cached, "prompt_n": len(prompt) - cached}
        return JSONResponse(data)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        return await openai(request, chat=True)

    if b.native:

        @app.post("/completion")
        async def native(request: Request) -> JSONResponse:
            body = await request.json()
            ids, cached = await toy.generate(body["prompt"], int(body.get("n_predict", 16)), body.get("cache_salt"))
            tokens = ids if body.get("return_tokens") else []
            return JSONResponse({"content": _text(ids), "tokens": tokens, "tokens_cached": cached})

    if b.tokenize:

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            return JSONResponse({"tokens": toy_tokenize((await request.json())["content"])})

    return app


class StandIn:
    """One stand-in on 127.0.0.1, on a free port, served by uvicorn on a background thread."""

    def __init__(self, b: Behaviour) -> None:
        # IPPROTO_TCP, so that asyncio sets TCP_NODELAY: without it a keep-alive answer can wait ~40 ms for a
        # delayed ACK, which would swamp the stand-ins' hit/miss latencies (as kvlab's server.serve.listen does).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(b), log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> StandIn:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture
def standin() -> Iterator[Any]:
    """``standin(**behaviour)`` starts a stand-in and returns its base URL; all are stopped after the test."""
    started: list[StandIn] = []

    def make(**kw: Any) -> str:
        s = StandIn(Behaviour(**kw)).start()
        started.append(s)
        return s.base_url

    yield make
    for s in started:
        s.stop()
