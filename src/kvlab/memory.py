"""KV-cache memory calculator (the ``kvlab memory`` command prints it: kvlab.cli.memory).

Three questions, each answered in exact integers (bytes, slots, tokens) so the figures can be checked
by hand and by tests; the human units are only for printing:

* how big is the cache of a model shape:  2 (K and V) x batch x layers x kv_heads x seq_len x head_dim
  x bytes per element, for MHA, the model's own KV-head count (GQA) and MQA side by side;
* how much a contiguous cache (every sequence reserves ``max_seq_len`` slots) wastes next to a paged
  one (each sequence holds ``ceil(len / block_size)`` blocks) for a given mix of lengths;
* how much prefix sharing saves when N requests start with the same P tokens.

The module knows nothing of torch, model weights or the CLI, so the calculator works on a bare install.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvlab.config import CacheConfig, ConfigError, attention_kind, blocks_for, check_int, check_kv_heads

# Bytes per cached element. fp8/int8 are the quantised-KV options of vLLM/TensorRT-LLM; their scales
# are per tensor or per head, small enough to leave out of a size estimate.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}

# HF `model_type`s whose cache is one K and one V of [num_key_value_heads, head_dim] per layer and
# token. Families with sliding-window or mixed layers (gemma2, ...) would need another formula, so
# they are refused rather than mis-sized.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

DEFAULT_SEQ_LEN = 2048
DEFAULT_BLOCK_SIZE = CacheConfig.block_size


class MemoryInputError(ConfigError):
    """Bad input to the calculator; ``field`` lets the CLI point at the flag that carried it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _require_int(owner: str, name: str, value: Any, lo: int, hi: int | None = None) -> None:
    # config's rule and wording, tagged with the field so the CLI can name the flag that carried it.
    try:
        check_int(owner, name, value, lo, hi)
    except ConfigError as e:
        raise MemoryInputError(name, str(e)) from None


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV-cache dtype name (``fp32 fp16 bf16 int8 fp8``)."""
    if dtype not in DTYPE_BYTES:
        raise MemoryInputError("dtype", f"dtype must be one of {list(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class KVShape:
    """The part of a model's shape that sizes its KV cache."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    name: str = "custom"

    def __post_init__(self) -> None:
        _require_int("KVShape", "num_layers", self.num_layers, 1)
        _require_int("KVShape", "num_heads", self.num_heads, 1)
        try:
            check_kv_heads("KVShape", self.num_heads, self.num_kv_heads)
        except ConfigError as e:
            raise MemoryInputError("num_kv_heads", str(e)) from None
        _require_int("KVShape", "head_dim", self.head_dim, 1)

    @property
    def attention_kind(self) -> str:
        return attention_kind(self.num_heads, self.num_kv_heads)

    def with_kv_heads(self, num_kv_heads: int) -> KVShape:
        return replace(self, num_kv_heads=num_kv_heads)


# Named shapes for --preset. Only the cache-sizing part of each model: kvlab.model.loader's presets are the
# models kvlab can run, a different list.
MODEL_SHAPES: dict[str, KVShape] = {
    "llama-2-7b": KVShape(num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, name="llama-2-7b"),
    "llama-2-70b": KVShape(num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, name="llama-2-70b"),
    "smollm2-135m": KVShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, name="smollm2-135m"),
    # kvlab.model.mini: d_model 128 over 4 heads.
    "mini": KVShape(num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32, name="mini"),
}


def get_preset(name: str) -> KVShape:
    """The KV shape of a named model (``MODEL_SHAPES``)."""
    if name not in MODEL_SHAPES:
        raise MemoryInputError("preset", f"unknown preset {name!r}; allowed presets: {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]


def kv_bytes_per_token(shape: KVShape, dtype: str = "fp16") -> int:
    """Bytes one token occupies in the cache, K and V over all layers."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes(dtype)


def kv_cache_bytes(shape: KVShape, seq_len: int, batch: int = 1, dtype: str = "fp16") -> int:
    """2 x batch x layers x kv_heads x seq_len x head_dim x bytes, exactly."""
    _require_int("kv_cache_bytes", "seq_len", seq_len, 1)
    _require_int("kv_cache_bytes", "batch", batch, 1)
    return batch * seq_len * kv_bytes_per_token(shape, dtype)


def attention_variants(shape: KVShape) -> list[tuple[str, KVShape]]:
    """The shape as MHA, as itself, and as MQA: the three columns of the comparison."""
    return [
        ("MHA", shape.with_kv_heads(shape.num_heads)),
        (f"{shape.attention_kind} (this model)", shape),
        ("MQA", shape.with_kv_heads(1)),
    ]


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(num_bytes: int) -> str:
    """Binary units, two decimals: 2**30 -> '1.00 GiB', 1536 -> '1.50 KiB', 100 -> '100 B'."""
    if num_bytes < 0:
        raise MemoryInputError("num_bytes", f"num_bytes must be >= 0, got {num_bytes}")
    if num_bytes < 1024:
        return f"{num_bytes} B"
    exponent = min((num_bytes.bit_length() - 1) // 10, len(_UNITS) - 1)
    return f"{num_bytes / 1024**exponent:.2f} {_UNITS[exponent]}"


def parse_lengths(text: str) -> tuple[int, ...]:
    """'17,100,3,64' -> (17, 100, 3, 64)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise MemoryInputError(
            "lengths", f"lengths must be comma-separated positive integers like 17,100,3,64, got {text!r}"
        )
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class PagingComparison:
    """Slots a contiguous cache and a paged cache reserve for the same sequences.

    A contiguous cache reserves ``max_seq_len`` slots per sequence up front because it cannot grow a
    sequence in place; a paged cache holds only the blocks a sequence has touched, so its waste is at
    most ``block_size - 1`` slots per sequence.
    """

    lengths: tuple[int, ...]
    block_size: int
    max_seq_len: int

    def __post_init__(self) -> None:
        _require_int("PagingComparison", "block_size", self.block_size, 1)
        _require_int("PagingComparison", "max_seq_len", self.max_seq_len, 1)
        if not isinstance(self.lengths, tuple) or not self.lengths:
            raise MemoryInputError(
                "lengths", f"PagingComparison.lengths must be a non-empty tuple, got {self.lengths!r}"
            )
        for i, length in enumerate(self.lengths):
            # A zero-length request never enters a batch (SchedulerConfig.filter_empty), so it has no place here;
            # one longer than max_seq_len would not fit the contiguous reservation being compared.
            if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= self.max_seq_len:
                raise MemoryInputError(
                    "lengths",
                    f"PagingComparison.lengths[{i}] must be an int in [1, max_seq_len={self.max_seq_len}], "
                    f"got {length!r}",
                )

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def used_slots(self) -> int:
        return sum(self.lengths)

    @property
    def contiguous_slots(self) -> int:
        return self.num_sequences * self.max_seq_len

    @property
    def paged_blocks(self) -> int:
        return sum(blocks_for(length, self.block_size) for length in self.lengths)

    @property
    def paged_slots(self) -> int:
        return self.paged_blocks * self.block_size

    @property
    def contiguous_waste(self) -> int:
        return self.contiguous_slots - self.used_slots

    @property
    def paged_waste(self) -> int:
        return self.paged_slots - self.used_slots

    @property
    def contiguous_utilisation(self) -> Fraction:
        return Fraction(self.used_slots, self.contiguous_slots)

    @property
    def paged_utilisation(self) -> Fraction:
        return Fraction(self.used_slots, self.paged_slots)


@dataclass(frozen=True)
class PrefixSharing:
    """Cache tokens saved when ``requests`` requests share one ``prefix_len``-token prefix.

    Ideally the prefix is stored once instead of N times: (N - 1) x P tokens saved. In a paged cache
    only whole blocks stay shared for the life of the requests: with block granularity a partial last
    block is never shared, and with token granularity it is copied on the first write (CoW). So the
    lasting saving is (N - 1) x floor(P / block_size) blocks.
    """

    requests: int
    prefix_len: int
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        _require_int("PrefixSharing", "requests", self.requests, 1)
        _require_int("PrefixSharing", "prefix_len", self.prefix_len, 1)
        _require_int("PrefixSharing", "block_size", self.block_size, 1)

    @property
    def tokens_unshared(self) -> int:
        return self.requests * self.prefix_len

    @property
    def tokens_shared(self) -> int:
        return self.prefix_len

    @property
    def saved_tokens(self) -> int:
        return (self.requests - 1) * self.prefix_len

    @property
    def shared_full_blocks(self) -> int:
        return self.prefix_len // self.block_size

    @property
    def saved_blocks(self) -> int:
        return (self.requests - 1) * self.shared_full_blocks

    @property
    def saved_block_tokens(self) -> int:
        return self.saved_blocks * self.block_size


def _config_int(cfg: dict[str, Any], key: str, file: Path) -> int:
    value: Any = cfg.get(key)
    try:
        check_int("config", key, value, 1)
    except ConfigError as e:
        raise MemoryInputError("config", f"{file}: {e}") from None
    return int(value)


def load_hf_config(path: str | Path) -> KVShape:
    """KV shape of a Hugging Face Llama-family ``config.json`` (or a model directory holding one)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise MemoryInputError("config", f"config file not found: {file}")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MemoryInputError("config", f"{file}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise MemoryInputError("config", f"{file}: expected a JSON object, got {type(cfg).__name__}")

    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    # model_type decides when present: a config's architectures list is free text copied between forks.
    supported = (
        model_type in SUPPORTED_MODEL_TYPES
        if model_type is not None
        else any(a in SUPPORTED_ARCHITECTURES for a in architectures)
    )
    if not supported:
        raise MemoryInputError(
            "config",
            f"{file}: unsupported architecture (model_type={model_type!r}, architectures={architectures!r}); "
            f"kvlab memory reads Llama-family configs, model_type one of {list(SUPPORTED_MODEL_TYPES)}",
        )

    num_layers = _config_int(cfg, "num_hidden_layers", file)
    num_heads = _config_int(cfg, "num_attention_heads", file)
    # HF's LlamaConfig falls back to MHA when num_key_value_heads is absent or null.
    num_kv_heads = (
        _config_int(cfg, "num_key_value_heads", file) if cfg.get("num_key_value_heads") is not None else num_heads
    )
    if cfg.get("head_dim") is not None:
        head_dim = _config_int(cfg, "head_dim", file)
    else:
        hidden_size = _config_int(cfg, "hidden_size", file)
        if hidden_size % num_heads:
            raise MemoryInputError(
                "config",
                f"{file}: hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads} "
                "and there is no head_dim field",
            )
        head_dim = hidden_size // num_heads
    name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    try:
        return KVShape(num_layers, num_heads, num_kv_heads, head_dim, name=name)
    except MemoryInputError as e:
        raise MemoryInputError("config", f"{file}: {e}") from e


def resolve_shape(
    preset: str | None = None,
    config: str | Path | None = None,
    layers: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> KVShape:
    """A preset or config.json as the base, then explicit values on top of it."""
    if preset is not None and config is not None:
        raise MemoryInputError("preset", "give --preset or --config, not both")
    if preset is not None:
        base: KVShape | None = get_preset(preset)
    elif config is not None:
        base = load_hf_config(config)
    else:
        base = None

    if base is None:
        given = {"--layers": layers, "--heads": heads, "--head-dim": head_dim}
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise MemoryInputError(
                "preset",
                f"no model shape: give --preset (one of {', '.join(MODEL_SHAPES)}), --config path/to/config.json, "
                f"or all of --layers --heads --head-dim (missing: {' '.join(missing)})",
            )
        assert layers is not None and heads is not None and head_dim is not None
        # Without a base, MHA is the only kv_heads that needs no further assumption.
        return KVShape(layers, heads, heads if kv_heads is None else kv_heads, head_dim)

    explicit = {"num_layers": layers, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}
    overrides = {k: v for k, v in explicit.items() if v is not None}
    if not overrides:
        return base
    return replace(base, name=f"{base.name} (modified)", **overrides)
