"""Shared-prefix serving throughput: kvlab vs Hugging Face transformers on the same weights.

Workload W<N>: N requests sharing a ~100-token system prompt, each with its own question, 32 greedy
tokens each with EOS ignored. Every peer runs in the same process, one after another, so the ratios
compare like with like; outputs are checked token by token against kvlab's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.model.loader import LoadedModel

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


def run_kvlab(loaded: LoadedModel, prompts: Sequence[list[int]], max_tokens: int, **knobs) -> PeerResult:
    from kvlab import LLM, SamplingParams

    longest = max(len(p) for p in prompts) + max_tokens
    knobs.setdefault("max_model_len", min(loaded.config.max_position_embeddings, max(longest, 128)))
    knobs.setdefault("num_blocks", max(256, len(prompts) * (-(-longest // 16) + 1)))
    knobs.setdefault("max_num_seqs", max(64, len(prompts)))
    knobs.setdefault("max_num_batched_tokens", 4096)
    llm = LLM(loaded, **knobs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return PeerResult("kvlab", dt, [list(o.token_ids) for o in outs])


@torch.inference_mode()
def run_hf_generate(hf, prompts: Sequence[list[int]], max_tokens: int, pad_id: int) -> PeerResult:
    """transformers ``generate``: one left-padded batch, greedy, fp32."""
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
        input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id
    )
    dt = time.perf_counter() - t0
    return PeerResult("hf-generate", dt, [row[width:].tolist() for row in out])


def agreement(reference: Sequence[list[int]], other: Sequence[list[int]]) -> tuple[int, float]:
    """(sequences identical, mean length of the common prefix) of another peer's outputs vs kvlab's."""
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(reference, other, strict=True)
    ]
    return same, sum(prefix) / len(prefix)
