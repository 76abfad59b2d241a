"""Serving throughput: kvlab's modes vs Hugging Face transformers, llama.cpp and vLLM on the same weights.

Workloads (``--workloads``; every sequence 32 tokens with EOS ignored, greedy unless said otherwise):

* ``shared-prefix``, W<N>: N requests sharing a ~100-token system prompt, each with its own question;
* ``no-sharing``: 32 distinct ~200-token prompts with no common prefix (plain text, no chat template);
* ``long-context``: 8 requests over one ~2,000-token document, each with its own question after it
  (prefill-bound; the document is cut to fit a model with fewer positions, and the table says so);
* ``chat``: 8 sessions x 4 turns, issued in rounds (a round starts when the previous one is done, on the same
  engine): turn k's prompt is turn k-1's prompt + a scripted assistant answer + the next user message, so every
  engine gets the same prompts and its prefix cache can reuse the whole earlier prompt;
* ``parallel``: W16's prompts with n = 4 samples each, at temperature 1 with top_k 1, which can only draw the
  argmax (the greedy tokens, so they compare across engines; vLLM refuses n > 1 at temperature 0): kvlab forks
  the samples after the prompt (shared blocks, copy on write), vLLM shares their prompt blocks.

Every peer but vLLM runs in the same process, one after another, on the same number of threads, so the ratios
compare like with like; vLLM runs in its own interpreter (``vllm_peer``), one worker per dtype. Outputs are
checked token by token against the first kvlab mode's. Each peer first runs a small warm-up (one-time
initialisation is not what is measured), then the workload ``repeats`` times, each time on a cold prefix cache
(a new kvlab engine; vLLM's cache reset); the best time counts (the usual choice on a shared machine: noise only
ever adds time).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlab.bench.modes import Mode, engine_resident_bytes
from kvlab.bench.names import THROUGHPUT_WORKLOADS
from kvlab.bench.peers import PEERS, VLLM_PEERS
from kvlab.bench.peers import llama_cpp_available as llama_cpp_available  # where it was
from kvlab.bench.table import ResultTable, result_table
from kvlab.bench.vllm_peer import VLLM_CPU_BLOCK_SIZE, VLLMPeer
from kvlab.config import admission_blocks, blocks_for
from kvlab.model.loader import LoadedModel
from kvlab.tokenizer import HFTokenizer

SYSTEM_PROMPT = (
    "You are a careful assistant for a travel agency. Answer in two short sentences, in plain English, "
    "without lists or headings. Mention prices only when the customer asks for them, never invent a "
    "booking reference, and if a question is about visas or health rules, tell the customer to check "
    "the official government website of the country they are travelling to before they book anything."
)
QUESTIONS = [
    "Which month is best to visit Lisbon?",
    "Can I bring my cat on a train to Vienna?",
    "What should I pack for Iceland in March?",
    "Is Kyoto crowded in April?",
    "How do I get from Rome to Naples?",
    "Do I need cash in Stockholm?",
    "What is a good day trip from Madrid?",
    "Is Prague walkable?",
    "Where can I see the northern lights?",
    "How early should I arrive for a ferry to Corsica?",
    "What is the weather like in Crete in May?",
    "Can children visit the Louvre for free?",
    "Is Budapest good for a weekend?",
    "What food should I try in Bologna?",
    "How long is the hike to Machu Picchu?",
    "Are trains in Switzerland expensive?",
]


@dataclass(frozen=True)
class PeerResult:
    name: str
    seconds: float
    tokens: list[list[int]]
    setup: str = ""  # how the peer was configured, printed with the result
    resident_mib: float | None = None  # kvlab modes: the engine's weights (packed copies included) + KV pool

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def shared_prefix_prompts(loaded: LoadedModel, n: int, seed: int = 0) -> list[list[int]]:
    """N prompts: one shared ~100-token system prompt + a distinct question each."""
    tok = loaded.tokenizer
    if loaded.config.vocab_size <= 512:  # byte-level mini: random bytes, 100 shared + 8-24 distinct
        rng = random.Random(seed)
        system = [rng.randrange(256) for _ in range(100)]
        return [system + [rng.randrange(256) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    prompts = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (case {i})")
        text = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}])
        prompts.append(tok.encode(text))
    return prompts


# The other workloads' texts for a real tokenizer (the byte-level mini draws random bytes instead, as W<N>
# does): the places and months their sentences are drawn from, the chat's follow-up questions and the scripted
# assistant answers every engine is given in place of its own (so that every engine gets the same prompts).
CITIES = (
    "Lisbon", "Vienna", "Reykjavik", "Kyoto", "Naples", "Stockholm", "Madrid", "Prague", "Tromso", "Ajaccio",
    "Heraklion", "Paris", "Budapest", "Bologna", "Cusco", "Zurich", "Porto", "Seville", "Krakow", "Dubrovnik",
    "Bergen", "Edinburgh", "Dublin", "Athens", "Split", "Valencia", "Munich", "Salzburg", "Ghent", "Tallinn",
    "Riga", "Palermo",
)  # fmt: skip
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
)  # fmt: skip
FOLLOW_UPS = (
    "And what would that cost for two people?",
    "Is that easy with two small children?",
    "What if it rains all day?",
    "Can I do that without a car?",
    "Which part of town should we stay in?",
    "How far ahead should I book it?",
    "Is there anything we should avoid?",
    "Could you say that again more briefly?",
)
ANSWERS = (
    "Late spring is usually the best time: the days are long and mild, the crowds are smaller than in summer, "
    "and the ferries and mountain trains already run their full timetable.",
    "Yes, that works well. The regional trains run every hour, the trip takes about three hours, and a seat "
    "booked a week ahead costs much less than one bought at the station.",
    "Pack layers rather than one heavy coat, good walking shoes and a rain jacket, because the weather can "
    "change several times in a single afternoon.",
    "It is busy around the main sights from ten until four, so start early or go in the evening, when the old "
    "town is quieter and the light is better for photographs.",
    "Most visitors stay near the old town: it is walkable, close to the station, and the small hotels there are "
    "often cheaper than the large ones by the river.",
    "Book the ferry and the first two nights in advance and keep the rest flexible; outside August there is "
    "almost always a room for the same evening.",
    "Cards are accepted nearly everywhere, even for a coffee, but keep a little cash for markets, buses in "
    "small villages and the toilets at some stations.",
    "Please check the official government website of the country before you book anything: the rules for "
    "visas and health papers change often and only that page is binding.",
)
LONG_CONTEXT_INTRO = "Here is a travel report."
LONG_CONTEXT_MARK = "\x00DOCUMENT\x00"  # where the document's token ids go in the rendered chat template


class WorkloadError(ValueError):
    """A workload cannot be built for this model as asked (the message says why)."""


def _plain_ids(tok: Any, text: str) -> list[int]:
    """The ids of ``text`` alone: no BOS/EOS added, as it goes after other tokens."""
    return tok.encode(text, add_special_tokens=False) if isinstance(tok, HFTokenizer) else tok.encode(text)


def _sentence(rng: random.Random) -> str:
    a, b = rng.sample(CITIES, 2)
    month = rng.choice(MONTHS)
    kind = rng.randrange(4)
    if kind == 0:
        part = rng.choice(("morning", "evening", "night", "coastal"))
        return (
            f"The {part} train from {a} to {b} leaves at {rng.randrange(5, 23)}:{rng.randrange(0, 60, 5):02d} and "
            f"takes {rng.randint(2, 9)} hours; a seat costs {rng.randint(19, 140)} euros in {month}."
        )
    if kind == 1:
        return (
            f"In {month} the afternoons in {a} reach {rng.randint(-5, 34)} degrees, and the museums of the old "
            f"town open at {rng.randint(8, 11)} in the morning."
        )
    if kind == 2:
        return (
            f"The ferry between {a} and {b} carried {rng.randint(120, 2400)} passengers on an average day last "
            f"{month}, and it is often full at weekends."
        )
    price, breakfast = rng.randint(60, 320), rng.choice(("included", "extra"))
    return f"Small hotels near the centre of {a} charge about {price} euros a night in {month}, breakfast {breakfast}."


def _text_ids(tok: Any, rng: random.Random, count: int, opener: str = "") -> list[int]:
    """Exactly ``count`` token ids of ``opener`` followed by sentences drawn from ``rng``."""
    text, ids = opener, _plain_ids(tok, opener) if opener else []
    while len(ids) < count:
        text += (" " if text else "") + _sentence(rng)
        ids = _plain_ids(tok, text)
    return ids[:count]


def _first_token(ids: list[int], bos: int | None) -> int:
    return ids[1] if len(ids) > 1 and ids[0] == bos else ids[0]


def no_sharing_prompts(loaded: LoadedModel, n: int = 32, tokens: int = 200, seed: int = 0) -> list[list[int]]:
    """N distinct prompts of exactly ``tokens`` tokens with no common prefix beyond a BOS: their first tokens
    differ (for N up to 256 on the mini, up to the 44 openers otherwise), so the prefix cache finds nothing.
    Plain text, no chat template: its header would be a prefix every prompt shares."""
    tok = loaded.tokenizer
    if loaded.config.vocab_size <= 512:  # byte-level mini: random bytes, distinct first bytes
        rng = random.Random(seed)
        firsts = rng.sample(range(256), min(n, 256))
        return [[firsts[i % len(firsts)]] + [rng.randrange(256) for _ in range(tokens - 1)] for i in range(n)]
    openers = (*CITIES, *MONTHS)
    prompts: list[list[int]] = []
    used: set[int] = set()
    for i in range(n):
        # Prompt i opens with the i-th place (or the next one whose first token no earlier prompt has).
        # Past the openers a first token repeats: the first try is kept.
        tries = (
            _text_ids(tok, random.Random(seed * 1_000_003 + i), tokens, f"{openers[(i + k) % len(openers)]}:")
            for k in range(len(openers))
        )
        first_try = next(tries)
        fresh = (t for t in itertools.chain([first_try], tries) if _first_token(t, tok.bos_token_id) not in used)
        ids = next(fresh, first_try)
        used.add(_first_token(ids, tok.bos_token_id))
        prompts.append(ids)
    return prompts


def long_context_parts(
    loaded: LoadedModel, n: int = 8, document_tokens: int = 2000, max_tokens: int = 32, seed: int = 0
) -> tuple[list[int], list[int], list[list[int]]]:
    """(head, document, tails) of the long-context prompts: prompt i is head + document + tails[i] (the
    document in a user message, question i after it). The document has ``document_tokens`` tokens, or fewer
    when the model's positions would not hold it with the longest question and ``max_tokens``."""
    tok, max_pos = loaded.tokenizer, loaded.config.max_position_embeddings
    rng = random.Random(seed)
    if loaded.config.vocab_size <= 512:  # byte-level mini: random bytes, a question of 8-24 each
        head: list[int] = []
        tails = [[rng.randrange(256) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    else:
        head, tails = [], []
        for i in range(n):
            q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (case {i})")
            content = f"{LONG_CONTEXT_INTRO}\n\n{LONG_CONTEXT_MARK}\n\nQuestion: {q} Answer from the report only."
            before, after = tok.apply_chat_template([{"role": "user", "content": content}]).split(LONG_CONTEXT_MARK)
            head = tok.encode(before)  # the same for every question: it ends before the document
            tails.append(_plain_ids(tok, after))
    room = max_pos - max_tokens - len(head) - max(len(t) for t in tails)
    if room < 16:
        raise WorkloadError(
            f"long-context: {max_pos} positions leave {room} tokens for the document (fewer --max-tokens?)"
        )
    count = min(document_tokens, room)
    if loaded.config.vocab_size <= 512:
        return head, [rng.randrange(256) for _ in range(count)], tails
    return head, _text_ids(tok, rng, count), tails


def long_context_prompts(
    loaded: LoadedModel, n: int = 8, document_tokens: int = 2000, max_tokens: int = 32, seed: int = 0
) -> list[list[int]]:
    """N prompts over one document (``long_context_parts``), each with its own question after it."""
    head, doc, tails = long_context_parts(loaded, n, document_tokens, max_tokens, seed)
    return [head + doc + t for t in tails]


def chat_rounds(
    loaded: LoadedModel, sessions: int = 8, turns: int = 4, max_tokens: int = 32, seed: int = 0
) -> list[list[list[int]]]:
    """The chat workload's prompts, round by round: round k holds turn k of every session still going. Turn 0
    is the system prompt + the session's question; turn k is turn k-1's prompt + a scripted assistant answer +
    the next user message, so it extends turn k-1's prompt token for token. A session ends early when its next
    turn and ``max_tokens`` would not fit the model's positions. The scripted answers replace the engines' own,
    so every engine gets the same prompts (and no engine's output decides another's prompt)."""
    tok, max_pos = loaded.tokenizer, loaded.config.max_position_embeddings
    byte_level = loaded.config.vocab_size <= 512
    system = [random.Random(seed).randrange(256) for _ in range(100)]  # the mini's shared system prompt
    rounds: list[list[list[int]]] = [[] for _ in range(turns)]
    for s in range(sessions):
        rng = random.Random(seed * 1_000_003 + s + 1)
        prompt: list[int] = []
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        text = ""
        for t in range(turns):
            if byte_level:  # random bytes: a 32-byte answer, a user message of 8-24
                answer = [rng.randrange(256) for _ in range(32)] if t else []
                prompt = prompt + answer + [rng.randrange(256) for _ in range(rng.randint(8, 24))]
                if t == 0:
                    prompt = system + prompt
            else:
                if t:
                    messages.append({"role": "assistant", "content": ANSWERS[(s + t - 1) % len(ANSWERS)]})
                first = QUESTIONS[s % len(QUESTIONS)] + ("" if s < len(QUESTIONS) else f" (case {s})")
                messages.append({"role": "user", "content": FOLLOW_UPS[(3 * s + t) % len(FOLLOW_UPS)] if t else first})
                new_text = tok.apply_chat_template(messages)
                full = tok.encode(new_text)
                if full[: len(prompt)] != prompt:  # the tokens at the seam merged: extend the ids instead
                    if not new_text.startswith(text):
                        raise WorkloadError("chat: the template does not render a longer conversation as an extension")
                    full = prompt + _plain_ids(tok, new_text[len(text) :])
                prompt, text = full, new_text
            if len(prompt) + max_tokens > max_pos:
                break
            rounds[t].append(prompt)
    return [r for r in rounds if r]


@dataclass(frozen=True)
class WorkloadSizes:
    """How big the workloads besides W<N> are (W<N>'s sizes are ``compare_throughput``'s ``sizes``)."""

    distinct_requests: int = 32  # no-sharing: prompts
    distinct_tokens: int = 200  # no-sharing: tokens per prompt
    long_requests: int = 8  # long-context: questions over the document
    document_tokens: int = 2000  # long-context: the document (cut to the model's positions)
    sessions: int = 8  # chat: sessions
    turns: int = 4  # chat: turns per session (rounds)
    n: int = 4  # parallel: samples per prompt
    parallel_requests: int = 16  # parallel: W<N>'s prompts


@dataclass(frozen=True)
class Workload:
    """One workload as every engine runs it: ``rounds`` of prompts (token ids), a round's prompts submitted at
    once and a round only after the previous one finished, on the same engine (one round but for chat); ``n``
    samples per prompt. ``name`` labels its rows; ``note``: what the table says about it."""

    kind: str
    name: str
    rounds: list[list[list[int]]]
    n: int = 1
    note: str = ""

    @property
    def prompts(self) -> list[list[int]]:
        return [p for r in self.rounds for p in r]

    @property
    def temperature(self) -> float:
        """0 (greedy) for one sample; n > 1 samples at temperature 1 with top_k 1: the argmax again, by the
        sampling path (vLLM refuses n > 1 at temperature 0)."""
        return 0.0 if self.n == 1 else 1.0

    @property
    def top_k(self) -> int:
        return 0 if self.n == 1 else 1

    @property
    def seed(self) -> int | None:
        """Sampled runs are seeded: top_k 1 keeps every token tied at the top (frequent in bf16 logits), and the
        draw among ties must repeat from run to run."""
        return None if self.n == 1 else 0

    def peak(self) -> list[list[int]]:
        """Prompts standing for the most an engine holds at once, what it is sized for: as many as the largest
        round has sequences, each as long as the longest prompt."""
        return [max(self.prompts, key=len)] * (max(len(r) for r in self.rounds) * self.n)

    def warmup(self) -> Workload:
        """Two prompts of the first round, with the same sampling."""
        return Workload(self.kind, self.name, [self.rounds[0][:2]], self.n)


def as_workload(prompts: Sequence[list[int]] | Workload) -> Workload:
    """A workload as it is, or prompts as one greedy round (what the runners took before workloads)."""
    if isinstance(prompts, Workload):
        return prompts
    return Workload("shared-prefix", f"W{len(prompts)}", [[list(p) for p in prompts]])


def build_workloads(
    loaded: LoadedModel,
    kinds: Sequence[str],
    requests: Sequence[int],
    max_tokens: int,
    sizes: WorkloadSizes = WorkloadSizes(),
) -> list[Workload]:
    """The workloads of ``kinds`` in that order (``THROUGHPUT_WORKLOADS``; shared-prefix: W<N> for each N of
    ``requests``), each with its rows' label and note."""
    if bad := sorted(set(kinds) - set(THROUGHPUT_WORKLOADS)):
        raise WorkloadError(f"unknown workload(s) {bad}; known: {', '.join(THROUGHPUT_WORKLOADS)}")
    out: list[Workload] = []
    for kind in dict.fromkeys(kinds):
        if kind == "shared-prefix":
            out += [Workload(kind, f"W{n}", [shared_prefix_prompts(loaded, n)]) for n in requests]
        elif kind == "no-sharing":
            prompts = no_sharing_prompts(loaded, sizes.distinct_requests, sizes.distinct_tokens)
            out.append(Workload(kind, f"no-sharing {len(prompts)}x{sizes.distinct_tokens}", [prompts]))
        elif kind == "long-context":
            head, doc, tails = long_context_parts(loaded, sizes.long_requests, sizes.document_tokens, max_tokens)
            note = ""
            if len(doc) < sizes.document_tokens:
                note = (
                    f"long-context: the document is cut from {sizes.document_tokens} to {len(doc)} tokens, what "
                    f"{loaded.name}'s {loaded.config.max_position_embeddings} positions hold with a question and "
                    f"{max_tokens} output tokens"
                )
            rounds = [[head + doc + t for t in tails]]
            out.append(Workload(kind, f"long-context {len(tails)}x{len(doc)}", rounds, note=note))
        elif kind == "chat":
            rounds = chat_rounds(loaded, sizes.sessions, sizes.turns, max_tokens)
            ended = sizes.sessions * sizes.turns - sum(len(r) for r in rounds)
            note = (
                f"chat: {sizes.sessions} sessions x {sizes.turns} turns in rounds, a round once the last one is "
                "done, on the same engine; the sessions share W<N>'s system prompt, and turn k's prompt is turn "
                "k-1's + a scripted assistant answer + the next user message, for every engine the same: the "
                "prefix cache can reuse every earlier prompt (not the generated answer, which the script replaces); "
                "HF's peers keep nothing between rounds, llama.cpp only the prompt it ran last"
            ) + (f"; {ended} turns left out, past the model's positions" if ended else "")
            out.append(Workload(kind, f"chat {sizes.sessions}x{sizes.turns}", rounds, note=note))
        else:  # parallel
            n, k = sizes.n, sizes.parallel_requests
            note = (
                f"W{k} n={n}: W{k}'s prompts, {n} samples each at temperature 1 with top_k 1, the argmax (greedy "
                "tokens that compare across engines; vLLM refuses n > 1 at temperature 0); kvlab forks the "
                "samples after the prompt (shared blocks, copy on write), HF generates n copies of each prompt "
                "(num_return_sequences), llama.cpp runs each prompt n times in a row"
            )
            out.append(Workload(kind, f"W{k} n={n}", [shared_prefix_prompts(loaded, k)], n=n, note=note))
    return out


def best_of(repeats: int, run: Callable[[], PeerResult], strict: bool = True) -> PeerResult:
    """The fastest of ``repeats`` runs. Outputs must not change between runs of kvlab (``strict``: an error);
    a peer's that do (vLLM in bf16 batches its rows differently from run to run) are said in its setup, unless
    its runs do not even return the same number of sequences (an error too)."""
    results = [run() for _ in range(repeats)]
    fastest = min(results, key=lambda r: r.seconds)
    first = results[0].tokens
    if all(r.tokens == first for r in results):
        return fastest
    if strict or any(len(r.tokens) != len(first) for r in results):
        raise RuntimeError(f"{results[0].name} gave different tokens on repeated greedy runs")
    differing = sum(any(r.tokens[i] != seq for r in results) for i, seq in enumerate(first))
    note = f"its {repeats} runs differed in {differing} of {len(first)} sequences (the fastest's compared)"
    return dataclasses.replace(fastest, setup=f"{fastest.setup}, {note}" if fastest.setup else note)


def kvlab_knobs(prompts: Sequence[list[int]], max_tokens: int, max_len: int, **knobs) -> dict:
    longest = max(len(p) for p in prompts) + max_tokens
    knobs.setdefault("max_model_len", min(max_len, max(longest, 128)))
    knobs.setdefault("num_blocks", max(256, admission_blocks(longest, 16, len(prompts))))
    knobs.setdefault("max_num_seqs", max(64, len(prompts)))
    knobs.setdefault("max_num_batched_tokens", 2048)
    return knobs


def run_kvlab(
    loaded: LoadedModel, prompts: Sequence[list[int]] | Workload, max_tokens: int, mode: Mode | None = None, **knobs
) -> PeerResult:
    """One engine (built outside the timed region) for the whole workload: each round's prompts submitted at
    once, the rounds one after another (the time is the rounds' sum). ``loaded`` must be in the mode's dtype."""
    from kvlab import LLM, SamplingParams

    w = as_workload(prompts)
    mode = mode or Mode()
    if str(loaded.model.dtype).removeprefix("torch.") != mode.dtype:
        raise ValueError(f"mode {mode.name!r} needs the model in {mode.dtype}, got {loaded.model.dtype}")
    knobs = kvlab_knobs(w.peak(), max_tokens, loaded.config.max_position_embeddings, **knobs)
    llm = LLM(loaded, **mode.engine_knobs(), **knobs)
    params = SamplingParams(
        n=w.n, temperature=w.temperature, top_k=w.top_k, seed=w.seed, max_tokens=max_tokens, ignore_eos=True
    )
    tokens: list[list[int]] = []
    dt = 0.0
    for batch in w.rounds:
        t0 = time.perf_counter()
        outs = llm.generate(list(batch), params, use_tqdm=False)
        dt += time.perf_counter() - t0
        if errors := [o.error for o in outs if o.error]:
            raise RuntimeError(f"kvlab {mode.name}: {len(errors)} request(s) failed: {errors[0]}")
        tokens += [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    setup = f"max_num_seqs={knobs['max_num_seqs']} max_num_batched_tokens={knobs['max_num_batched_tokens']}"
    setup += f", {len(w.rounds)} rounds" if len(w.rounds) > 1 else ""
    weights, kv = engine_resident_bytes(llm.engine)
    return PeerResult(f"kvlab {mode.name}", dt, tokens, setup, resident_mib=(weights + kv) / 2**20)


def _in_rounds(w: Workload, run_round: Callable[[list[list[int]]], PeerResult]) -> PeerResult:
    """A peer without a cache across calls, round by round: the seconds summed, the tokens in order."""
    results = [run_round(batch) for batch in w.rounds]
    setup = results[0].setup + (f", {len(results)} rounds" if len(results) > 1 else "")
    return PeerResult(results[0].name, sum(r.seconds for r in results), [t for r in results for t in r.tokens], setup)


def _hf_sampling(n: int) -> dict[str, Any]:
    """HF's arguments for the workload's sampling: greedy, or n samples at temperature 1 with top_k 1 (its
    greedy search refuses num_return_sequences > 1)."""
    if n == 1:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": 1.0, "top_k": 1, "num_return_sequences": n}


def run_hf_generate(hf, prompts: Sequence[list[int]] | Workload, max_tokens: int, pad_id: int) -> PeerResult:
    """transformers ``generate``: one left-padded batch per round, fp32 (or the model's dtype); n > 1 as
    ``num_return_sequences`` (each prompt repeated n times in the batch: nothing shared)."""
    w = as_workload(prompts)
    return _in_rounds(w, functools.partial(_hf_generate_round, hf, max_tokens=max_tokens, pad_id=pad_id, n=w.n))


@torch.inference_mode()
def _hf_generate_round(hf, prompts: list[list[int]], max_tokens: int, pad_id: int, n: int) -> PeerResult:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    # EOS ignored as kvlab's ignore_eos does it (no stop, no suppression): HF's min_new_tokens would forbid
    # EOS instead and change the tokens, so the peer runs with no EOS id at all.
    hf.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    out = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, pad_token_id=pad_id, **_hf_sampling(n)
    )
    dt = time.perf_counter() - t0
    name = "hf-generate" if hf.dtype == torch.float32 else f"hf-generate {str(hf.dtype).removeprefix('torch.')}"
    setup = f"batch {len(prompts)}, left-padded" + (f", num_return_sequences={n}" if n > 1 else "")
    return PeerResult(name, dt, [row[width:].tolist() for row in out], setup)


def run_hf_generate_batch(
    hf,
    prompts: Sequence[list[int]] | Workload,
    max_tokens: int,
    pad_id: int,
    max_batch_tokens: int = 2048,
    page_size: int = 16,
) -> PeerResult:
    """transformers continuous batching (``generate_batch``), one call per round, paged cache sized explicitly:
    its automatic sizing assumes a GPU and takes ~9 GiB of host memory here. n > 1 as ``num_return_sequences``
    (it forks the children)."""
    w = as_workload(prompts)
    run = functools.partial(
        _hf_generate_batch_round, hf, max_tokens=max_tokens, pad_id=pad_id, n=w.n,
        max_batch_tokens=max_batch_tokens, page_size=page_size,
    )  # fmt: skip
    return _in_rounds(w, run)


@torch.inference_mode()
def _hf_generate_batch_round(
    hf, prompts: list[list[int]], max_tokens: int, pad_id: int, n: int, max_batch_tokens: int, page_size: int
) -> PeerResult:
    import logging

    from transformers import ContinuousBatchingConfig, GenerationConfig

    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = len(prompts) * n * blocks_for(longest, page_size) + 1
    gen = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=pad_id, **_hf_sampling(n))
    cb = ContinuousBatchingConfig(
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        page_size=page_size,
        max_requests_per_batch=len(prompts) * n,
    )
    # Its logger warns about psutil and the disabled EOS on every call; the numbers are what matters here.
    cb_log = logging.getLogger("ContinuousBatchingLogger")
    level = cb_log.level
    cb_log.setLevel(logging.ERROR + 10)
    try:
        t0 = time.perf_counter()
        out = hf.generate_batch(
            inputs=list(prompts), generation_config=gen, continuous_batching_config=cb, warmup=False
        )
        dt = time.perf_counter() - t0
    finally:
        cb_log.setLevel(level)
    # A request's children ("<id>__child#<k>") come before it: each request's sequences in sample order.
    groups: dict[str, list[Any]] = {}
    for r in out.values():
        groups.setdefault(r.request_id.partition("__child#")[0], []).append(r)
    results = [
        r for g in groups.values() for r in sorted(g, key=lambda r: int(r.request_id.partition("__child#")[2] or -1))
    ]
    errors = [r.error for r in results if r.error]
    if len(results) != len(prompts) * n or errors:
        raise RuntimeError(f"generate_batch returned {len(results)}/{len(prompts) * n} results, errors: {errors[:3]}")
    setup = f"num_blocks={num_blocks} page_size={page_size} max_batch_tokens={max_batch_tokens}"
    setup += f", num_return_sequences={n}" if n > 1 else ""
    return PeerResult("hf-generate-batch", dt, [list(r.generated_tokens) for r in results], setup)


def run_llama_cpp(gguf: Path, prompts: Sequence[list[int]] | Workload, max_tokens: int, threads: int) -> PeerResult:
    """llama.cpp through ``llama-cpp-python`` on the GGUF file itself (quantized weights), requests one by
    one as its single-sequence API serves them (n > 1: each prompt n times in a row, greedy); it reuses the
    common prefix of consecutive prompts."""
    import llama_cpp

    w = as_workload(prompts)
    longest = max(len(p) for p in w.prompts) + max_tokens
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=longest + 16, n_threads=threads, verbose=False)
    outputs = []
    t0 = time.perf_counter()
    for p in (p for batch in w.rounds for p in batch for _ in range(w.n)):
        out: list[int] = []
        for tok in llm.generate(p, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == max_tokens:
                break
        outputs.append(out)
    dt = time.perf_counter() - t0
    setup = f"{gguf.name}, sequential, n_threads={threads}" + (f", each prompt {w.n} times" if w.n > 1 else "")
    return PeerResult("llama.cpp", dt, outputs, setup)


def agreement(reference: Sequence[list[int]], other: Sequence[list[int]]) -> tuple[int, float]:
    """(sequences identical, mean length of the common prefix) of another peer's outputs vs kvlab's."""
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(reference, other, strict=True)
    ]
    return same, sum(prefix) / len(prefix)


def run_vllm(peer: VLLMPeer, prompts: Sequence[list[int]] | Workload, max_tokens: int) -> PeerResult:
    """vLLM's ``LLM.generate`` in its own interpreter (``VLLMPeer``): EOS ignored, each round's prompts at once,
    on a cold prefix cache (reset before the run, as each kvlab run builds a new engine); the seconds are vLLM's
    own wall time around each ``generate``, summed, as ``run_kvlab`` measures its own."""
    w = as_workload(prompts)
    tokens, seconds = peer.run(
        w.rounds, max_tokens, n=w.n, temperature=w.temperature, top_k=w.top_k, seed=w.seed, reset_prefix_cache=True
    )
    dtype = str(peer.llm_kwargs.get("dtype", "float32"))
    name = f"vllm {peer.version}".strip() + ("" if dtype == "float32" else f" {dtype}")
    return PeerResult(name, seconds, tokens, peer.setup)


def vllm_knobs(
    prompts: Sequence[list[int]], max_tokens: int, max_len: int, max_num_batched_tokens: int, dtype: str = "float32"
) -> dict:
    """vLLM's engine arguments for the same workload as ``kvlab_knobs``: fp32 (or ``dtype``), prefix caching on
    with the smallest block vLLM's CPU attention takes (a multiple of 32; its default, 128, is longer than the
    shared system prompt: nothing would hit), the same sequence and token budgets (kvlab's block count has no
    vLLM twin: VLLM_CPU_KVCACHE_SPACE sizes its pool)."""
    knobs = kvlab_knobs(prompts, max_tokens, max_len, max_num_batched_tokens=max_num_batched_tokens)
    return {
        "dtype": dtype,
        "seed": 0,
        "enable_prefix_caching": True,
        "block_size": VLLM_CPU_BLOCK_SIZE,
        "max_model_len": knobs["max_model_len"],
        "max_num_seqs": knobs["max_num_seqs"],
        "max_num_batched_tokens": knobs["max_num_batched_tokens"],
    }


@dataclass(frozen=True)
class ThroughputRow:
    workload: str  # the workload's label: W16, chat 8x4, ...
    result: PeerResult
    vs_kvlab: float  # the first kvlab mode's tokens/s divided by this row's: how many times faster it was
    identical: int | None  # sequences identical to the first kvlab mode's (None for that mode itself)
    common_prefix: float | None
    # This row's tokens/s over the baseline's (HF generate fp32 when it ran, else the first kvlab mode).
    vs_baseline: float = 1.0
    kind: str = "shared-prefix"  # which of THROUGHPUT_WORKLOADS
    requests: int = 0  # prompts, over all rounds
    n: int = 1  # samples per prompt
    rounds: int = 1
    note: str = ""  # the workload's, printed under the table

    def as_dict(self) -> dict:
        r = self.result
        return {
            "workload": self.workload,
            "workload_kind": self.kind,
            "requests": self.requests,
            "n": self.n,
            "rounds": self.rounds,
            "peer": r.name,
            "setup": r.setup,
            "seconds": round(r.seconds, 4),
            "output_tokens": r.output_tokens,
            "tokens_per_second": round(r.tokens_per_second, 2),
            "kvlab_speedup": round(self.vs_kvlab, 3),
            "speed_vs_baseline": round(self.vs_baseline, 3),
            "identical_outputs": self.identical,
            "sequences": len(r.tokens),
            "mean_common_prefix": self.common_prefix,
            "resident_mib": None if r.resident_mib is None else round(r.resident_mib, 1),
        }


def throughput_table(rows: Sequence[ThroughputRow], model: str, max_tokens: int, threads: int) -> ResultTable:
    """The rows of ``compare_throughput`` as a table, its ratios against the baseline (HF generate fp32 when it
    ran) and the first kvlab mode (the first row), the workloads' notes under it."""
    first = rows[0].result.name if rows else "kvlab"
    baseline = "HF generate fp32" if any(r.result.name == "hf-generate" for r in rows) else first
    columns = ("workload", "peer", "seconds", "output tok/s", f"x {baseline}", f"{first} speed-up")
    return result_table(
        f"throughput: {model}, {max_tokens} tokens per sequence (greedy, EOS ignored), {threads} threads",
        (*columns, "identical", "common prefix", "resident MiB", "setup"),
        [
            (
                row.workload,
                row.result.name,
                f"{row.result.seconds:.2f}",
                f"{row.result.tokens_per_second:.1f}",
                f"{row.vs_baseline:.2f}x",
                f"{row.vs_kvlab:.2f}x",
                "-" if row.identical is None else f"{row.identical}/{len(row.result.tokens)}",
                "-" if row.common_prefix is None else f"{row.common_prefix:.1f}",
                "-" if row.result.resident_mib is None else f"{row.result.resident_mib:.0f}",
                row.result.setup,
            )
            for row in rows
        ],
        notes=[
            "identical / common prefix: sequences against the first kvlab mode's; resident MiB: the engine's "
            "weights (packed and quantised copies included) plus its KV pool; every run on a cold prefix cache",
            *dict.fromkeys(row.note for row in rows if row.note),
        ],
    )


def compare_throughput(
    loaded: LoadedModel,
    sizes: Sequence[int],
    max_tokens: int,
    peers: Sequence[str],
    hf_model=None,
    gguf: Path | None = None,
    threads: int = 1,
    repeats: int = 1,
    max_num_batched_tokens: int = 2048,
    modes: Sequence[Mode] = (Mode(),),
    model_in: Callable[[str], LoadedModel] | None = None,
    vllm_python: str | None = None,
    vllm_model: str | None = None,
    workloads: Sequence[str] = ("shared-prefix",),
    workload_sizes: WorkloadSizes = WorkloadSizes(),
) -> list[ThroughputRow]:
    """Every kvlab mode and each requested peer on each of ``workloads`` (``build_workloads``: shared-prefix is
    W<N> for every N in ``sizes``). ``model_in(dtype)`` gives the model in a mode's dtype (default: ``loaded``
    for float32 only). Peers that cannot run here (llama.cpp without ``llama-cpp-python`` or without a GGUF
    file) are left out by the caller. The ``vllm`` and ``vllm-bf16`` peers run ``vllm.LLM`` in ``vllm_python``
    (vLLM's own venv) on ``vllm_model`` (an HF directory of the same weights) in float32 and bfloat16: one worker
    process per dtype, sized for the largest workload, started for its peer's runs and ended after them. Each
    peer runs every workload before the next peer starts. Ratios: ``vs_kvlab`` against the first mode,
    ``vs_baseline`` against HF ``generate`` in fp32 when it is among the peers."""
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; known: {', '.join(PEERS)}")
    if not modes:
        raise ValueError("at least one kvlab mode")
    if VLLM_PEERS.keys() & set(peers) and not (vllm_python and vllm_model):
        raise ValueError("the vllm peers need vllm_python (vLLM's interpreter) and vllm_model (an HF directory)")
    plan = build_workloads(loaded, workloads, sizes, max_tokens, workload_sizes)

    def fp32_only(dtype: str) -> LoadedModel:
        if dtype != "float32":
            raise ValueError(f"no model in {dtype} was given (pass model_in)")
        return loaded

    model_of = model_in or fp32_only
    pad = loaded.tokenizer.eos_token_id or 0

    def llama_cpp(w: Workload) -> PeerResult:
        if gguf is None:
            raise ValueError("the llama.cpp peer needs a GGUF file")
        return run_llama_cpp(gguf, w, max_tokens, threads)

    @functools.cache
    def hf_bf16() -> Any:
        return copy.deepcopy(hf_model).to(torch.bfloat16)

    def kvlab(w: Workload, mode: Mode) -> PeerResult:
        return run_kvlab(model_of(mode.dtype), w, max_tokens, mode, max_num_batched_tokens=max_num_batched_tokens)

    runners: dict[str, Callable[[Workload], PeerResult]] = {
        f"kvlab {m.name}": functools.partial(kvlab, mode=m) for m in modes
    }
    vllm_peers: dict[str, VLLMPeer] = {}
    # What every vLLM worker is sized for: the longest prompt, as many times as the most sequences at once.
    peak = [max((p for w in plan for p in w.prompts), key=len)] * max(len(w.peak()) for w in plan)

    def vllm(w: Workload, peer: str) -> PeerResult:
        if peer not in vllm_peers:
            assert vllm_python is not None and vllm_model is not None
            max_len = loaded.config.max_position_embeddings
            knobs = vllm_knobs(peak, max_tokens, max_len, max_num_batched_tokens, dtype=VLLM_PEERS[peer])
            vllm_peers[peer] = VLLMPeer(vllm_python, vllm_model, knobs, threads=threads).start()
        return run_vllm(vllm_peers[peer], w, max_tokens)

    def close(peer: str) -> None:
        if peer in vllm_peers:
            vllm_peers.pop(peer).close()

    runners |= {peer: functools.partial(vllm, peer=peer) for peer in VLLM_PEERS}
    runners |= {
        "hf-generate": lambda w: run_hf_generate(hf_model, w, max_tokens, pad),
        "hf-generate-bf16": lambda w: run_hf_generate(hf_bf16(), w, max_tokens, pad),
        "hf-generate-batch": lambda w: run_hf_generate_batch(
            hf_model, w, max_tokens, pad, max_batch_tokens=max_num_batched_tokens
        ),
        "llama.cpp": llama_cpp,
    }
    order = [f"kvlab {m.name}" for m in modes] + list(peers)
    try:
        return _compare(plan, order, runners, repeats, close)
    finally:
        for peer in list(vllm_peers):
            close(peer)


def _compare(
    plan: Sequence[Workload],
    order: Sequence[str],
    runners: dict[str, Callable[[Workload], PeerResult]],
    repeats: int,
    close: Callable[[str], None] = lambda peer: None,
) -> list[ThroughputRow]:
    """Each runner of ``order`` on every workload (warm-up, then the best of ``repeats``), one runner after the
    other (``close(name)`` after its last workload); the rows workload by workload."""
    results: dict[tuple[str, str], PeerResult] = {}
    for name in order:
        run = runners[name]
        try:
            for w in plan:
                run(w.warmup())  # lazy initialisation, allocator growth, oneDNN kernel selection
                results[name, w.name] = best_of(repeats, functools.partial(run, w), strict=name.startswith("kvlab"))
        finally:
            close(name)
    rows = []
    for w in plan:
        first = results[order[0], w.name]
        base = results.get(("hf-generate", w.name), first)
        for name in order:
            res = results[name, w.name]
            same, pref = (None, None) if res is first else agreement(first.tokens, res.tokens)
            rows.append(
                ThroughputRow(
                    w.name,
                    res,
                    first.tokens_per_second / res.tokens_per_second,
                    same,
                    pref,
                    vs_baseline=res.tokens_per_second / base.tokens_per_second,
                    kind=w.kind,
                    requests=len(w.prompts),
                    n=w.n,
                    rounds=len(w.rounds),
                    note=w.note,
                )
            )
    return rows
