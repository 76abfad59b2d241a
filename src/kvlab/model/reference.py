"""The dense oracle: full recompute of the whole sequence at every step, no cache at all.

Every generation path of kvlab is checked against this. It is deliberately naive: nothing is kept
between steps, so there is no state that could be shared or leaked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlab.model.attention_api import DenseCausalAttention
from kvlab.model.llama import LlamaModel


@torch.inference_mode()
def dense_logits(
    model: LlamaModel, token_ids: Sequence[int], last_only: bool = False, kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Logits [L, vocab] of every position of one sequence ([1, vocab] of the last with ``last_only``); with
    ``kv_dtype``, K and V rounded to it as a cache of that dtype stores them (``DenseCausalAttention``)."""
    if len(token_ids) == 0:
        raise ValueError("dense_logits needs at least one token")
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    positions = torch.arange(len(ids))
    attn = DenseCausalAttention([0, len(ids)], model.config.num_heads, kv_dtype)
    hidden = model(ids, positions, attn)
    return model.compute_logits(hidden[-1:] if last_only else hidden)


@torch.inference_mode()
def dense_generate(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    max_tokens: int,
    stop_token_ids: Sequence[int] = (),
    return_logits: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> list[int] | tuple[list[int], torch.Tensor]:
    """Greedy continuation by recomputing the full sequence for each new token.

    Stops after ``max_tokens`` or on a token in ``stop_token_ids`` (which is included in the output).
    With ``return_logits`` also returns the [n, vocab] logits each generated token was chosen from. With
    ``kv_dtype``, K and V are rounded to it at every pass, as a cache of that dtype holds them.
    """
    tokens = list(prompt_ids)
    out: list[int] = []
    step_logits = []
    for _ in range(max_tokens):
        logits = dense_logits(model, tokens, last_only=True, kv_dtype=kv_dtype)[-1]
        nxt = int(torch.argmax(logits))
        step_logits.append(logits)
        out.append(nxt)
        tokens.append(nxt)
        if nxt in stop_token_ids:
            break
    if return_logits:
        return out, torch.stack(step_logits) if step_logits else torch.empty(0, model.config.vocab_size)
    return out
