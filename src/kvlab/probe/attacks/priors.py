"""The order in which the token strategy tries its candidates: a prior over the victim's next token.

A step of the token strategy tries candidate tokens until one hits; what it costs is the rank of the victim's
token in the order tried. Every candidate fits the alphabet, so the order decides the cost, not the outcome.
Three sources, each used where it exists, combined:

- the server's own ``logprobs`` after the known part (``HttpSender.top_tokens``): its top few, tried first;
- ``string_prior``: how often each candidate is the next token when the rest of the secret is a random
  string of the alphabet, by tokenizing sampled continuations (the tokenizer's merges decide which tokens a
  random string becomes; no request touches the cache). It is the right prior for a random secret;
- ``ModelPrior``: a local copy of the served model (a kvlab model: a preset, a GGUF or a Hugging Face
  directory), its next-token distribution after the known ids over the whole vocabulary (PromptPeek ranks
  by a local LLM). It is the right prior for a secret made of words.

``order_candidates`` tries the server's top first, then the candidates by the mean of the two priors
(either may be missing), then shortest text first, then by id (a BPE vocabulary's ids follow its merges:
frequent pieces first). The costs per order, for random and for natural-language secrets, are measured in
docs/security.md.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

STRING_SAMPLES = 512  # sampled random continuations per step


def string_prior(
    encode: Callable[[str], list[int] | None],
    known: Sequence[int],
    text: str,
    alphabet: str,
    lengths: Sequence[int],
    rng: random.Random,
    samples: int = STRING_SAMPLES,
) -> dict[int, float]:
    """P(next token = t) when the secret's unknown rest is a uniform random string of ``alphabet`` of one of
    ``lengths`` characters: ``text`` (what ``known`` spells, then the rest of the prefix) plus each sampled
    rest, tokenized; the token after ``known`` counted where the sample's tokens start with ``known`` (a
    continuation that re-merges the known part cannot be the victim's)."""
    counts: Counter[int] = Counter()
    want = list(known)
    for _ in range(samples):
        n = rng.choice(lengths)
        ids = encode(text + "".join(rng.choice(alphabet) for _ in range(n)))
        if ids is not None and len(ids) > len(want) and ids[: len(want)] == want:
            counts[ids[len(want)]] += 1
    total = sum(counts.values())
    return {t: c / total for t, c in counts.items()} if total else {}


class ModelPrior:
    """The next-token distribution of a local copy of the served model (loaded once, fp32, dense forward)."""

    def __init__(self, name: str) -> None:
        from kvlab.model.loader import load_model

        self.name = name
        self.loaded: Any = load_model(name)

    def __call__(self, known: Sequence[int], candidates: Sequence[int]) -> dict[int, float]:
        """P(t | known) of each candidate, renormalised over the candidates."""
        import torch

        from kvlab.model.reference import dense_logits

        vocab = self.loaded.model.config.vocab_size
        inside = [t for t in candidates if 0 <= t < vocab]
        if not known or not inside:
            return {}
        probs = torch.softmax(dense_logits(self.loaded.model, list(known), last_only=True)[0], dim=-1)
        picked = probs[torch.tensor(inside)]
        total = float(picked.sum())
        return {t: float(p) / total for t, p in zip(inside, picked.tolist(), strict=True)} if total > 0 else {}


def load_model_prior(name: str) -> tuple[ModelPrior | None, str]:
    """(the prior, what the report says): None where kvlab cannot load ``name`` as a model."""
    try:
        return ModelPrior(name), f"candidates ranked by a local copy of the model ({name})"
    except Exception as exc:  # any loader's failure: the attack carries on with the other priors
        return None, f"no local model for the candidates' order ({name}: {type(exc).__name__}: {exc})"


def order_candidates(
    cands: Sequence[int], vocab: dict[int, str], ranked: Sequence[int], priors: Sequence[dict[int, float]]
) -> list[int]:
    """``ranked`` (the server's likeliest, those among ``cands``) first, then by the mean of ``priors`` (empty
    ones left out), then shortest text first, then by id."""
    pool = set(cands)
    head = [t for t in dict.fromkeys(ranked) if t in pool]
    seen = set(head)
    used = [p for p in priors if p]

    def key(t: int) -> tuple[float, int, int]:
        score = sum(p.get(t, 0.0) for p in used) / len(used) if used else 0.0
        return (-score, len(vocab[t]), t)

    return head + sorted((t for t in cands if t not in seen), key=key)


__all__ = ["ModelPrior", "load_model_prior", "order_candidates", "string_prior"]
