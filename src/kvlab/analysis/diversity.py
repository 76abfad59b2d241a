"""Head diversity: how differently the heads of one layer distribute their attention.

The number is the mean pairwise Jensen-Shannon divergence (base 2, so it lies in [0, 1]) between the
heads' attention distributions, averaged over every captured query row. Heads that all look alike
(small diversity) are the symptom the seed noticed when K/V is shared across many heads (MQA).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.engine.llm import LLM
from kvlab.engine.sampling import SamplingParams
from kvlab.instrument.attention import AttentionCapture, AttentionRecord
from kvlab.model.loader import LoadedModel

_EPS = 1e-12


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in bits between distributions along the last axis (broadcasting)."""
    p = p.double()
    q = q.double()
    m = 0.5 * (p + q)

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # 0 * log(0 / x) is 0: masked (future) keys carry exactly zero probability in every head.
        return torch.where(a > 0, a * (torch.log2(a + _EPS) - torch.log2(b + _EPS)), torch.zeros_like(a)).sum(-1)

    return (0.5 * kl(p, m) + 0.5 * kl(q, m)).clamp_min(0.0)


def rows_diversity(probs: torch.Tensor) -> torch.Tensor:
    """probs [H, L, ctx] -> [L]: mean over head pairs of the JSD of each query row."""
    h = probs.shape[0]
    if h < 2:
        raise ValueError("head diversity needs at least two heads")
    pairs = [js_divergence(probs[i], probs[j]) for i, j in itertools.combinations(range(h), 2)]
    return torch.stack(pairs).mean(0)


def head_diversity(records: Sequence[AttentionRecord]) -> float:
    """Mean pairwise JSD between heads over all query rows of the given records (prefill and decode).

    Rows whose query may see a single key are left out: every head must put all its weight there, so
    they say nothing about the heads and would only dilute the mean toward 0.
    """
    values = []
    for r in records:
        visible = (r.probs[0] > 0).sum(-1)  # [L]; a head's support is the causal window, shared by all heads
        keep = visible > 1
        if bool(keep.any()):
            values.append(rows_diversity(r.probs[:, keep, :]))
    if not values:
        raise ValueError("no attention rows with more than one visible key")
    return float(torch.cat(values).mean())


@dataclass(frozen=True)
class DiversityResult:
    model: str
    num_kv_heads: int
    per_layer: dict[int, float]

    @property
    def mean(self) -> float:
        return sum(self.per_layer.values()) / len(self.per_layer)


def capture_prompt(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int = 8) -> tuple[AttentionCapture, str]:
    """Run one greedy request with capture on; returns the capture and the request id."""
    cap = AttentionCapture()
    llm = LLM(loaded, capture=cap)
    rid = llm.engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.advance()
    return cap, rid


def measure_diversity(
    loaded: LoadedModel, prompt_ids: list[int], layers: Sequence[int] | None = None, max_tokens: int = 8
) -> tuple[DiversityResult, AttentionCapture, str]:
    """Head diversity of each layer (all layers unless ``layers``) for one prompt run alone."""
    cap, rid = capture_prompt(loaded, prompt_ids, max_tokens)
    n = loaded.config.num_layers
    chosen = range(n) if layers is None else [layer % n for layer in layers]
    per_layer = {layer: head_diversity([r for r in cap.records[rid] if r.layer == layer]) for layer in chosen}
    return DiversityResult(loaded.name, loaded.config.num_kv_heads, per_layer), cap, rid
