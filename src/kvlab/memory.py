"""KV-cache memory calculator behind `kvlab memory`.

Three questions, each answered in exact integers (bytes, slots, tokens) so the figures can be checked
by hand and by tests; the human units are only for printing:

* how big is the cache of a model shape:  2 (K and V) x batch x layers x kv_heads x seq_len x head_dim
  x bytes per element, for MHA, the model's own KV-head count (GQA) and MQA side by side;
* how much a contiguous cache (every sequence reserves ``max_seq_len`` slots) wastes next to a paged
  one (each sequence holds ``ceil(len / block_size)`` blocks) for a given mix of lengths;
* how much prefix sharing saves when N requests start with the same P tokens.

The module knows nothing of torch or model weights, so the calculator works on a bare install.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kvlab.config import ConfigError

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
DEFAULT_BLOCK_SIZE = 16  # the CacheConfig default (DESIGN.md, "Knobs")


class MemoryInputError(ConfigError):
    """Bad input to the calculator; ``field`` lets the CLI point at the flag that carried it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _require_int(owner: str, name: str, value: Any, lo: int, hi: int | None = None) -> None:
    # bool is an int subclass; True layers is a typo, not a shape.
    if isinstance(value, bool) or not isinstance(value, int):
        raise MemoryInputError(name, f"{owner}.{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise MemoryInputError(name, f"{owner}.{name} must be {allowed}, got {value}")


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
        _require_int("KVShape", "num_kv_heads", self.num_kv_heads, 1, self.num_heads)
        _require_int("KVShape", "head_dim", self.head_dim, 1)
        if self.num_heads % self.num_kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise MemoryInputError(
                "num_kv_heads",
                f"KVShape.num_kv_heads must divide num_heads={self.num_heads} "
                f"(allowed: {divisors}), got {self.num_kv_heads}",
            )

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def with_kv_heads(self, num_kv_heads: int) -> KVShape:
        return replace(self, num_kv_heads=num_kv_heads)


PRESETS: dict[str, KVShape] = {
    "llama-2-7b": KVShape(num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, name="llama-2-7b"),
    "llama-2-70b": KVShape(num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, name="llama-2-70b"),
    "smollm2-135m": KVShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, name="smollm2-135m"),
    # The seed's MiniTransformer: d_model 128 over 4 heads.
    "mini": KVShape(num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32, name="mini"),
}


def get_preset(name: str) -> KVShape:
    if name not in PRESETS:
        raise MemoryInputError("preset", f"unknown preset {name!r}; allowed presets: {', '.join(PRESETS)}")
    return PRESETS[name]


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
            # A zero-length request never enters a batch (DESIGN.md), so it has no place in the mix;
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
        return sum(-(-length // self.block_size) for length in self.lengths)

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


def _config_int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemoryInputError("config", f"{where}: field {key!r} must be an int >= 1, got {value!r}")
    return value


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

    num_layers = _config_int(cfg, "num_hidden_layers", str(file))
    num_heads = _config_int(cfg, "num_attention_heads", str(file))
    # HF's LlamaConfig falls back to MHA when num_key_value_heads is absent or null.
    num_kv_heads = (
        _config_int(cfg, "num_key_value_heads", str(file))
        if cfg.get("num_key_value_heads") is not None
        else num_heads
    )
    if cfg.get("head_dim") is not None:
        head_dim = _config_int(cfg, "head_dim", str(file))
    else:
        hidden_size = _config_int(cfg, "hidden_size", str(file))
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
                f"no model shape: give --preset (one of {', '.join(PRESETS)}), --config path/to/config.json, "
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


# ---------------------------------------------------------------------------------------------- CLI

# Which flag carried each field, so a bad value is reported against what the user typed.
_FIELD_FLAGS = {
    "num_layers": "--layers",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "seq_len": "--seq-len",
    "batch": "--batch",
    "dtype": "--dtype",
    "lengths": "--lengths",
    "block_size": "--block-size",
    "max_seq_len": "--max-seq-len",
    "prefix_len": "--shared-prefix",
    "requests": "--requests",
    "preset": "--preset",
    "config": "--config",
}


@contextmanager
def _bad_parameter() -> Iterator[None]:
    try:
        yield
    except MemoryInputError as e:
        field = e.field.split("[")[0]
        raise typer.BadParameter(str(e), param_hint=_FIELD_FLAGS.get(field)) from e


def _percent(fraction: Fraction) -> str:
    return f"{float(fraction) * 100:.2f}%"


def _ratio(fraction: Fraction) -> str:
    return str(fraction) if fraction.denominator != 1 else f"{fraction.numerator}"


def _variants_table(shape: KVShape, seq_len: int, batch: int, dtype: str) -> Table:
    variants = attention_variants(shape)
    mha_bytes = kv_cache_bytes(variants[0][1], seq_len, batch, dtype)
    table = Table(title=f"KV cache: {shape.name}")
    table.add_column("")
    for label, _ in variants:
        table.add_column(label, justify="right")
    shapes = [v for _, v in variants]
    totals = [kv_cache_bytes(v, seq_len, batch, dtype) for v in shapes]
    rows: list[tuple[str, list[str]]] = [
        ("kv_heads", [str(v.num_kv_heads) for v in shapes]),
        ("per token", [human_bytes(kv_bytes_per_token(v, dtype)) for v in shapes]),
        (f"per sequence ({seq_len} tok)", [human_bytes(t // batch) for t in totals]),
        (f"batch of {batch}", [human_bytes(t) for t in totals]),
        ("bytes", [f"{t:,}" for t in totals]),
        ("vs MHA", [_ratio(Fraction(t, mha_bytes)) for t in totals]),
    ]
    for name, cells in rows:
        table.add_row(name, *cells)
    return table


def _paging_table(cmp: PagingComparison, bytes_per_token: int) -> Table:
    table = Table(title="Paged vs contiguous")
    table.add_column("")
    table.add_column("contiguous", justify="right")
    table.add_column("paged", justify="right")
    for name, contiguous, paged in (
        ("blocks", "-", str(cmp.paged_blocks)),
        ("reserved slots", str(cmp.contiguous_slots), str(cmp.paged_slots)),
        ("used slots", str(cmp.used_slots), str(cmp.used_slots)),
        ("wasted slots", str(cmp.contiguous_waste), str(cmp.paged_waste)),
        ("utilisation", _percent(cmp.contiguous_utilisation), _percent(cmp.paged_utilisation)),
        (
            "reserved memory",
            human_bytes(cmp.contiguous_slots * bytes_per_token),
            human_bytes(cmp.paged_slots * bytes_per_token),
        ),
        (
            "wasted memory",
            human_bytes(cmp.contiguous_waste * bytes_per_token),
            human_bytes(cmp.paged_waste * bytes_per_token),
        ),
    ):
        table.add_row(name, contiguous, paged)
    return table


def _sharing_table(share: PrefixSharing, bytes_per_token: int) -> Table:
    table = Table(title="Prefix sharing")
    table.add_column("")
    table.add_column("prefix tokens", justify="right")
    table.add_column("memory", justify="right")
    for name, tokens in (
        ("without sharing (N x P)", share.tokens_unshared),
        ("with sharing (P)", share.tokens_shared),
        ("saved ((N-1) x P)", share.saved_tokens),
        (f"saved, whole blocks ({share.saved_blocks} blocks)", share.saved_block_tokens),
    ):
        table.add_row(name, str(tokens), human_bytes(tokens * bytes_per_token))
    return table


def memory_cli(
    preset: Annotated[
        str | None, typer.Option(help=f"Model shape preset: {', '.join(PRESETS)}.", show_default=False)
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="HF config.json (or its directory) of a Llama-family model.", show_default=False),
    ] = None,
    layers: Annotated[int | None, typer.Option(help="Layers (overrides the preset).")] = None,
    heads: Annotated[int | None, typer.Option(help="Query heads (overrides the preset).")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="KV heads (default: preset's, else --heads).")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Head dimension (overrides the preset).")] = None,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = DEFAULT_SEQ_LEN,
    batch: Annotated[int, typer.Option(help="Sequences in the batch.")] = 1,
    dtype: Annotated[str, typer.Option(help=f"KV element type: {', '.join(DTYPE_BYTES)}.")] = "fp16",
    lengths: Annotated[
        str | None, typer.Option(help="Sequence lengths for paged vs contiguous, e.g. 17,100,3,64.")
    ] = None,
    block_size: Annotated[
        int | None, typer.Option(help=f"Tokens per block (default {DEFAULT_BLOCK_SIZE}).", show_default=False)
    ] = None,
    max_seq_len: Annotated[
        int | None, typer.Option(help="Slots a contiguous cache reserves per sequence (default: --seq-len).")
    ] = None,
    shared_prefix: Annotated[int | None, typer.Option(help="Prefix tokens shared by all requests.")] = None,
    requests: Annotated[int | None, typer.Option(help="Requests sharing it (default: --batch).")] = None,
) -> None:
    """KV-cache size: MHA vs GQA vs MQA, paged vs contiguous, and prefix-sharing savings."""
    # A flag whose table is not printed would be silently ignored; say so instead.
    if lengths is None and max_seq_len is not None:
        raise typer.BadParameter("only meaningful with --lengths", param_hint="--max-seq-len")
    if shared_prefix is None and requests is not None:
        raise typer.BadParameter("only meaningful with --shared-prefix", param_hint="--requests")
    if lengths is None and shared_prefix is None and block_size is not None:
        raise typer.BadParameter(
            "only meaningful with --lengths or --shared-prefix", param_hint="--block-size"
        )

    with _bad_parameter():
        shape = resolve_shape(preset, config, layers, heads, kv_heads, head_dim)
        kv_cache_bytes(shape, seq_len, batch, dtype)  # validates seq_len, batch, dtype before printing
        bytes_per_token = kv_bytes_per_token(shape, dtype)
        bs = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        paging = (
            PagingComparison(parse_lengths(lengths), bs, seq_len if max_seq_len is None else max_seq_len)
            if lengths is not None
            else None
        )
        sharing = (
            PrefixSharing(batch if requests is None else requests, shared_prefix, bs)
            if shared_prefix is not None
            else None
        )

    console = Console()
    per_token = (
        f"{human_bytes(bytes_per_token)}/token ({shape.attention_kind}, kv_heads {shape.num_kv_heads})"
    )
    console.print(
        f"\n[bold]{shape.name}[/]: {shape.num_layers} layers, {shape.num_heads} heads, "
        f"head_dim {shape.head_dim}, {dtype} ({dtype_bytes(dtype)} B/element), "
        f"seq_len {seq_len}, batch {batch}"
    )
    console.print(_variants_table(shape, seq_len, batch, dtype))
    if paging is not None:
        console.print(
            f"\n[bold]{paging.num_sequences} sequences[/] of lengths {','.join(map(str, paging.lengths))}; "
            f"block_size {paging.block_size}, contiguous reserves max_seq_len {paging.max_seq_len} each; "
            f"memory at {per_token}"
        )
        console.print(_paging_table(paging, bytes_per_token))
    if sharing is not None:
        console.print(
            f"\n[bold]{sharing.requests} requests[/] sharing a {sharing.prefix_len}-token prefix "
            f"(N={sharing.requests}, P={sharing.prefix_len}); block_size {sharing.block_size}; "
            f"memory at {per_token}. Whole blocks stay shared; a partial last block of the prefix is "
            "copied on the first write."
        )
        console.print(_sharing_table(sharing, bytes_per_token))
