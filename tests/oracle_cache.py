from __future__ import annotations

import functools

from kvlab.model import dense_generate, load_model
from kvlab.model.loader import LoadedModel


@functools.cache
def mini(name: str = "mini") -> LoadedModel:
    return load_model(name)


@functools.cache
def oracle(name: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """Greedy tokens of the dense no-cache reference for one request run alone (memoised across tests)."""
    return tuple(dense_generate(mini(name).model, list(prompt), max_tokens))
