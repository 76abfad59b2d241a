"""Attention capture: per layer and head attention probabilities for chosen requests.

Off by default, and free when off: the engine passes ``capture=None`` and the attention backend
never computes probabilities (SDPA does not expose them). When on, the probabilities are recomputed
explicitly, from the same K/V the step read from the cache, for the captured requests only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class AttentionRecord:
    step: int
    layer: int
    q_positions: list[int]  # absolute positions of the query tokens
    probs: torch.Tensor  # [H, L, ctx]: each row sums to 1 over the context it was allowed to see


class AttentionCapture:
    def __init__(self, request_ids: Iterable[str] | None = None, layers: Iterable[int] | None = None) -> None:
        self.request_ids = None if request_ids is None else set(request_ids)
        self.layers = None if layers is None else set(layers)
        self.records: dict[str, list[AttentionRecord]] = defaultdict(list)
        self.step = 0

    def wants(self, request_id: str, layer: int) -> bool:
        return (self.request_ids is None or request_id in self.request_ids) and (
            self.layers is None or layer in self.layers
        )

    def record(
        self,
        request_id: str,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        mask: torch.Tensor,
        q_positions: list[int],
    ) -> None:
        """q [L, H, D]; k [ctx, Hkv, D]; mask [L, ctx] True = may attend."""
        length, num_heads, dim = q.shape
        num_kv = k.shape[1]
        # Query heads grouped by the KV head they read (GQA/MQA), so K is never copied per query head.
        qg = q.float().reshape(length, num_kv, num_heads // num_kv, dim)
        scores = torch.einsum("lkgd,ckd->kglc", qg, k.float()).reshape(num_heads, length, -1) / dim**0.5
        scores = scores.masked_fill(~mask[None], float("-inf"))
        self.records[request_id].append(AttentionRecord(self.step, layer, q_positions, torch.softmax(scores, -1)))

    def decode_rows(self, request_id: str, layer: int) -> list[torch.Tensor]:
        """The [H, ctx] distribution of each single-token (decode) step of a request, in step order."""
        return [
            r.probs[:, 0, :] for r in self.records.get(request_id, []) if r.layer == layer and len(r.q_positions) == 1
        ]

    def clear(self) -> None:
        self.records.clear()
