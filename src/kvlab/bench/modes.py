"""The engine's modes as benchmarks name them: model dtype, the engine's mode (``ModeConfig``), KV dtype.

A mode is written as ``+``-joined words, e.g. ``fp32``, ``fp32+cpp``, ``bf16+cpp``, ``bf16+gguf+cpp+kv-bf16``:
``fp32``/``float32`` or ``bf16``/``bfloat16`` (the model's dtype; fp32 when absent), a ``ModeConfig.quantization``
(``int8``/``int4``/``gguf``/``int8-w8a8``/``int8-w8a8-head``), a ``ModeConfig.attention_backend`` other than the
reference (``cpp``: the in-place paged attention kernel and the fused elementwise ops), ``kv-bf16``, ``kv-fp32``,
``kv-fp8`` (e4m3), ``kv-fp8_e4m3`` or ``kv-fp8_e5m2`` (``CacheConfig.kv_cache_dtype``; the model's dtype when
absent). The words come from the configs' own choice lists, and a mode's ``name`` (``"bfloat16 + int4 + cpp + kv
bfloat16"``) parses back into the same mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvlab.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_MODES, ConfigError, ModeConfig, check_choice
from kvlab.engine.engine import Engine
from kvlab.model.loader import LoadedModel, load_model
from kvlab.model.quant import linear_dtype

_DTYPE_WORDS = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
_DEFAULT = ModeConfig()


@dataclass(frozen=True)
class Mode:
    """A model dtype, the engine's mode (``ModeConfig``: validated by it) and the KV cache's dtype."""

    dtype: str = "float32"  # vLLM's string: "float32" | "bfloat16"
    quantization: str | None = None
    attention_backend: str = "reference"
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        # The dtype is the loaded model's (bench step names a model's own, whatever it is).
        ModeConfig(quantization=self.quantization, attention_backend=self.attention_backend)  # its own checks
        check_choice("Mode", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)

    @property
    def config(self) -> ModeConfig:
        """The engine's mode (``Engine(mode=)``); the dtype is the loaded model's, the KV dtype the cache's."""
        return ModeConfig(quantization=self.quantization, attention_backend=self.attention_backend)

    @property
    def linear_dtype(self) -> str:
        """The dtype name whose matmul peak this mode's linears (nearly all of a step's arithmetic) run at."""
        return linear_dtype(self.quantization, self.dtype)

    @property
    def peak_dtypes(self) -> tuple[str, ...]:
        """The dtype names whose matmul peaks this mode's work runs at: the model's and its linears'."""
        return tuple(dict.fromkeys((self.dtype, self.linear_dtype)))

    @property
    def name(self) -> str:
        parts = [self.dtype]
        if self.quantization:
            parts.append(self.quantization)
        if self.attention_backend != _DEFAULT.attention_backend:
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


def _words() -> dict[str, tuple[str, str]]:
    """Each word a mode may hold -> (the Mode field it sets, the value), from the configs' choice lists."""
    words = {w: ("dtype", d) for w, d in _DTYPE_WORDS.items()}
    words |= {q: ("quantization", q) for q in QUANTIZATION_MODES}
    words |= {b: ("attention_backend", b) for b in ATTENTION_BACKENDS if b != _DEFAULT.attention_backend}
    for w, d in _DTYPE_WORDS.items():
        if d in KV_CACHE_DTYPES:  # "kv-bf16" as typed, "kv bfloat16" as a name prints it
            words[f"kv-{w}"] = words[f"kv {w}"] = ("kv_cache_dtype", d)
    for d in KV_CACHE_DTYPES:
        if d.startswith("fp8"):  # "kv-fp8", "kv-fp8_e5m2": as vLLM names them
            words[f"kv-{d}"] = words[f"kv {d}"] = ("kv_cache_dtype", d)
    return words


_WORDS = _words()


def _allowed() -> str:
    """The words by field, for an error message: "fp32|float32|bf16|bfloat16, int8|int4|..., cpp, ..."."""
    by_field: dict[str, list[str]] = {}
    for word, (name, _) in _WORDS.items():
        if " " not in word:
            by_field.setdefault(name, []).append(word)
    return ", ".join("|".join(ws) for ws in by_field.values())


def parse_mode(text: str) -> Mode:
    """``"bf16+gguf+cpp"`` (or a mode's ``name``) -> Mode; ConfigError naming the word it does not know or the
    clash."""
    values: dict[str, str] = {}
    for word in (w.strip().lower() for w in text.split("+")):
        known = _WORDS.get(" ".join(word.split()))
        if known is None or known[0] in values:
            raise ConfigError(f"mode {text!r}: unknown or repeated word {word!r} (one of each group: {_allowed()})")
        values[known[0]] = known[1]
    return Mode(**values)


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
