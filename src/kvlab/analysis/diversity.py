"""Head diversity: how differently the heads of one layer distribute their attention.

The number is the mean pairwise Jensen-Shannon divergence (base 2, so it lies in [0, 1]) between the
heads' attention distributions, averaged over every captured query row. Heads that all look alike
(small diversity) are the symptom the seed noticed when K/V is shared across many heads (MQA).

Under GQA/MQA the query heads come in KV groups (``num_heads // num_kv_heads`` consecutive query heads read
one KV head, as the model and the capture lay them out), so the pairs of heads split in two: pairs that share
a KV head (within a group) and pairs that do not (across groups). ``measure_diversity`` reports the mean
JSD of each kind besides the mean of all pairs: on a trained GQA model (SmolLM2) heads of one group attend
more alike than heads of different groups, the founding document's effect, which a random model lacks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def head_pairs(num_heads: int) -> list[tuple[int, int]]:
    """Every unordered pair of heads, in ``itertools.combinations`` order (the order of ``pair_divergences``)."""
    return list(itertools.combinations(range(num_heads), 2))


def kv_group(head: int, num_heads: int, num_kv_heads: int) -> int:
    """The KV head query head ``head`` reads: consecutive query heads share one (``repeat_kv``'s layout)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    return head // (num_heads // num_kv_heads)


def split_pairs(num_heads: int, num_kv_heads: int) -> tuple[list[int], list[int]]:
    """Indices into ``head_pairs(num_heads)`` of the pairs within one KV group and of the pairs across groups."""
    within: list[int] = []
    across: list[int] = []
    for k, (i, j) in enumerate(head_pairs(num_heads)):
        same = kv_group(i, num_heads, num_kv_heads) == kv_group(j, num_heads, num_kv_heads)
        (within if same else across).append(k)
    return within, across


def pair_divergences(probs: torch.Tensor) -> torch.Tensor:
    """probs [H, L, ctx] -> [P, L]: the JSD of each query row for every pair of ``head_pairs(H)``."""
    h = probs.shape[0]
    if h < 2:
        raise ValueError("head diversity needs at least two heads")
    return torch.stack([js_divergence(probs[i], probs[j]) for i, j in head_pairs(h)])


def rows_diversity(probs: torch.Tensor) -> torch.Tensor:
    """probs [H, L, ctx] -> [L]: mean over head pairs of the JSD of each query row."""
    return pair_divergences(probs).mean(0)


def head_diversity(records: Sequence[AttentionRecord]) -> float:
    """Mean pairwise JSD between heads over all query rows of the given records (prefill and decode).

    Rows whose query may see a single key are left out: every head must put all its weight there, so
    they say nothing about the heads and would only dilute the mean toward 0.
    """
    return float(_informative_pairs(records).mean())


def _informative_pairs(records: Sequence[AttentionRecord]) -> torch.Tensor:
    """[P, rows]: the JSD of every head pair on every query row that sees more than one key."""
    values = []
    for r in records:
        visible = (r.probs[0] > 0).sum(-1)  # [L]; a head's support is the causal window, shared by all heads
        keep = visible > 1
        if bool(keep.any()):
            values.append(pair_divergences(r.probs[:, keep, :]))
    if not values:
        raise ValueError("no attention rows with more than one visible key")
    return torch.cat(values, dim=1)


@dataclass(frozen=True)
class GroupDiversity:
    """Head diversity of one layer split by KV group: the mean JSD of the pairs of heads that share a KV head
    (``within``) and of the pairs that do not (``across``). None where there is no such pair: MHA has no
    within pairs (every head has its own KV head), MQA no across pairs (one group)."""

    within: float | None
    across: float | None
    within_pairs: int
    across_pairs: int


def group_diversity(records: Sequence[AttentionRecord], num_kv_heads: int) -> GroupDiversity:
    """``head_diversity`` over the pairs within a KV group and over the pairs across groups (same rows).

    Each is a mean over the same rows and pairs as ``head_diversity``'s, so
    ``within * within_pairs + across * across_pairs == head_diversity * all pairs``."""
    if not records:
        raise ValueError("no attention records")
    return _split(_informative_pairs(records), records[0].probs.shape[0], num_kv_heads)


def _split(jsd: torch.Tensor, num_heads: int, num_kv_heads: int) -> GroupDiversity:
    within, across = split_pairs(num_heads, num_kv_heads)
    return GroupDiversity(
        float(jsd[within].mean()) if within else None,
        float(jsd[across].mean()) if across else None,
        len(within),
        len(across),
    )


@dataclass(frozen=True)
class DiversityResult:
    model: str
    num_kv_heads: int
    per_layer: dict[int, float]
    by_group: dict[int, GroupDiversity] = field(default_factory=dict)  # per layer, within vs across KV groups
    tokens: tuple[int, ...] = ()  # the sequence the heads read: the prompt, then the tokens generated

    @property
    def mean(self) -> float:
        return sum(self.per_layer.values()) / len(self.per_layer)

    @property
    def grouped(self) -> bool:
        """Do some heads share a KV head and some not (GQA)? MHA has no groups, MQA one."""
        return any(g.within is not None and g.across is not None for g in self.by_group.values())

    @property
    def within_mean(self) -> float | None:
        """Mean over layers of the within-group diversity (None: no pair of heads shares a KV head)."""
        return _mean([g.within for g in self.by_group.values()])

    @property
    def across_mean(self) -> float | None:
        """Mean over layers of the across-group diversity (None: every pair of heads shares a KV head)."""
        return _mean([g.across for g in self.by_group.values()])


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present and len(present) == len(values) else None


def capture_prompt(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int = 8) -> tuple[AttentionCapture, str]:
    """Run one greedy request with capture on; returns the capture and the request id."""
    cap, rid, _ = _capture(loaded, prompt_ids, max_tokens)
    return cap, rid


def _capture(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int) -> tuple[AttentionCapture, str, list[int]]:
    cap = AttentionCapture()
    llm = LLM(loaded, capture=cap)
    rid = llm.engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.advance()
    return cap, rid, list(llm.engine.output(rid).token_ids)


def measure_diversity(
    loaded: LoadedModel, prompt_ids: list[int], layers: Sequence[int] | None = None, max_tokens: int = 8
) -> tuple[DiversityResult, AttentionCapture, str]:
    """Head diversity of each layer (all layers unless ``layers``) for one prompt run alone, overall and split
    by KV group."""
    cap, rid, generated = _capture(loaded, prompt_ids, max_tokens)
    n = loaded.config.num_layers
    kv = loaded.config.num_kv_heads
    chosen = range(n) if layers is None else [layer % n for layer in layers]
    per_layer: dict[int, float] = {}
    by_group: dict[int, GroupDiversity] = {}
    for layer in chosen:
        jsd = _informative_pairs([r for r in cap.records[rid] if r.layer == layer])  # once for both views
        per_layer[layer] = float(jsd.mean())
        by_group[layer] = _split(jsd, loaded.config.num_heads, kv)
    tokens = (*prompt_ids, *generated)
    return DiversityResult(loaded.name, kv, per_layer, by_group, tokens), cap, rid
