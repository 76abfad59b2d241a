"""The engine's modes as benchmarks name them: model dtype, weight quantisation, decode attention, KV dtype.

A mode is written as ``+``-joined words, e.g. ``fp32``, ``fp32+cpp``, ``bf16+cpp``, ``bf16+gguf+cpp+kv-bf16``:
``fp32``/``float32`` or ``bf16``/``bfloat16`` (the model's dtype; fp32 when absent), ``int8``/``int4``/``gguf``
(``quantization=``), ``cpp`` (``attention_backend="cpp"``: the in-place paged attention kernel and the fused
elementwise ops), ``kv-bf16`` or ``kv-fp32`` (``kv_cache_dtype=``; the model's dtype when absent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvlab.config import ConfigError
from kvlab.engine.engine import Engine
from kvlab.model.loader import LoadedModel, load_model

_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
_QUANT = ("int8", "int4", "gguf")
_KV = {"kv-bf16": "bfloat16", "kv-fp32": "float32"}


@dataclass(frozen=True)
class Mode:
    dtype: str = "float32"  # vLLM's string: "float32" | "bfloat16"
    quantization: str | None = None
    attention_backend: str = "reference"
    kv_cache_dtype: str = "auto"

    @property
    def name(self) -> str:
        parts = [self.dtype]
        if self.quantization:
            parts.append(self.quantization)
        if self.attention_backend != "reference":
            parts.append(self.attention_backend)
        if self.kv_cache_dtype != "auto":
            parts.append(f"kv {self.kv_cache_dtype}")
        return " + ".join(parts)

    def engine_knobs(self) -> dict[str, Any]:
        """Keyword arguments of ``LLM`` / ``Engine`` (besides the model, loaded in ``dtype``)."""
        knobs: dict[str, Any] = {"quantization": self.quantization, "attention_backend": self.attention_backend}
        if self.kv_cache_dtype != "auto":
            knobs["kv_cache_dtype"] = self.kv_cache_dtype
        return knobs


def parse_mode(text: str) -> Mode:
    """``"bf16+gguf+cpp"`` -> Mode; ConfigError naming the word it does not know or the clash."""
    dtype, quant, backend, kv = None, None, "reference", "auto"
    for word in (w.strip().lower() for w in text.split("+")):
        if word in _DTYPES and dtype is None:
            dtype = _DTYPES[word]
        elif word in _QUANT and quant is None:
            quant = word
        elif word == "cpp" and backend == "reference":
            backend = "cpp"
        elif word in _KV and kv == "auto":
            kv = _KV[word]
        else:
            allowed = "fp32|bf16, int8|int4|gguf, cpp, kv-bf16|kv-fp32"
            raise ConfigError(f"mode {text!r}: unknown or repeated word {word!r} (one of each group: {allowed})")
    return Mode(dtype or "float32", quant, backend, kv)


def parse_modes(text: str) -> list[Mode]:
    """A comma-separated list of modes, in order, without repeats."""
    modes = [parse_mode(m) for m in text.split(",") if m.strip()]
    if not modes:
        raise ConfigError(f"expected a comma-separated list of modes, got {text!r}")
    return list(dict.fromkeys(modes))


@dataclass
class ModelsByDtype:
    """One loaded model per dtype, loaded on first use from ``spec`` (the fp32 one may be given)."""

    spec: str
    loaded: dict[str, LoadedModel] = field(default_factory=dict)
    loader: Callable[..., LoadedModel] = load_model

    def __call__(self, dtype: str) -> LoadedModel:
        if dtype not in self.loaded:
            self.loaded[dtype] = self.loader(self.spec, dtype=getattr(torch, dtype))
        return self.loaded[dtype]


def _tensors_of(module: nn.Module) -> Iterator[torch.Tensor]:
    for m in module.modules():
        yield from m.parameters(recurse=False)
        yield from m.buffers(recurse=False)
        # Prepacked and quantised copies are plain tensor attributes, not parameters.
        yield from (v for v in vars(m).values() if isinstance(v, torch.Tensor))


def engine_resident_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of every distinct tensor the engine's model holds, packed copies included; bytes of the KV pool).
    Tensors sharing storage (tied embeddings, a packed twin's shared parameters) count once."""
    seen: dict[int, int] = {}
    for t in _tensors_of(engine.model):
        if t.layout != torch.strided:  # oneDNN's opaque packed tensors report no storage pointer
            seen[id(t)] = t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()), engine.storage.nbytes()
