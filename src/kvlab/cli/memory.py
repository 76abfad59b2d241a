"""``kvlab memory``: the tables of the KV-cache memory calculator (kvlab.memory)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvlab.cli.common import console
from kvlab.memory import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_SEQ_LEN,
    DTYPE_BYTES,
    MODEL_SHAPES,
    KVShape,
    MemoryInputError,
    PagingComparison,
    PrefixSharing,
    attention_variants,
    dtype_bytes,
    human_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    parse_lengths,
    resolve_shape,
)

EXAMPLE_PRESET = "llama-2-7b"  # what a bare `kvlab memory` shows

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
    "requests": "--num-requests",
    "preset": "--preset",
    "config": "--config",
}


def memory_cli(
    preset: Annotated[
        str | None, typer.Option(help=f"Model shape preset: {', '.join(MODEL_SHAPES)}.", show_default=False)
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
        str | None, typer.Option(metavar="N,...", help="Sequence lengths for paged vs contiguous, e.g. 17,100,3,64.")
    ] = None,
    block_size: Annotated[
        int | None, typer.Option(help=f"Tokens per block (default {DEFAULT_BLOCK_SIZE}).", show_default=False)
    ] = None,
    max_seq_len: Annotated[
        int | None, typer.Option(help="Slots a contiguous cache reserves per sequence (default: --seq-len).")
    ] = None,
    shared_prefix: Annotated[int | None, typer.Option(help="Prefix tokens shared by all requests.")] = None,
    num_requests: Annotated[int | None, typer.Option(help="Requests sharing it (default: --batch).")] = None,
) -> None:
    """KV-cache size: MHA vs GQA vs MQA, paged vs contiguous, and prefix-sharing savings."""
    # A flag whose table is not printed would be silently ignored; say so instead.
    if lengths is None and max_seq_len is not None:
        raise typer.BadParameter("only meaningful with --lengths", param_hint="--max-seq-len")
    if shared_prefix is None and num_requests is not None:
        raise typer.BadParameter("only meaningful with --shared-prefix", param_hint="--num-requests")
    if lengths is None and shared_prefix is None and block_size is not None:
        raise typer.BadParameter("only meaningful with --lengths or --shared-prefix", param_hint="--block-size")

    if all(v is None for v in (preset, config, layers, heads, kv_heads, head_dim)):
        # A bare `kvlab memory` is someone finding out what it does: an example beats an error.
        preset = EXAMPLE_PRESET
        console.print(
            f"no model shape given: an example with --preset {preset} (give --preset, --config, or --layers "
            "--heads --head-dim)",
            style="dim",
        )
    with _bad_parameter():
        shape = resolve_shape(preset, config, layers, heads, kv_heads, head_dim)
        kv_cache_bytes(shape, seq_len, batch, dtype)  # validates seq_len, batch, dtype before printing
        bs = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        paging = (
            PagingComparison(parse_lengths(lengths), bs, seq_len if max_seq_len is None else max_seq_len)
            if lengths is not None
            else None
        )
        sharing = (
            PrefixSharing(batch if num_requests is None else num_requests, shared_prefix, bs)
            if shared_prefix is not None
            else None
        )
    _print_tables(shape, seq_len, batch, dtype, paging, sharing)


@contextmanager
def _bad_parameter() -> Iterator[None]:
    try:
        yield
    except MemoryInputError as e:
        field = e.field.split("[")[0]  # lengths[3] -> lengths
        raise typer.BadParameter(str(e), param_hint=_FIELD_FLAGS.get(field)) from e


def _print_tables(
    shape: KVShape,
    seq_len: int,
    batch: int,
    dtype: str,
    paging: PagingComparison | None,
    sharing: PrefixSharing | None,
) -> None:
    bytes_per_token = kv_bytes_per_token(shape, dtype)
    per_token = f"{human_bytes(bytes_per_token)}/token ({shape.attention_kind}, kv_heads {shape.num_kv_heads})"
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


def _percent(fraction: Fraction) -> str:
    return f"{float(fraction) * 100:.2f}%"


def _ratio(fraction: Fraction) -> str:
    return str(fraction) if fraction.denominator != 1 else f"{fraction.numerator}"


def _variants_table(shape: KVShape, seq_len: int, batch: int, dtype: str) -> Table:
    variants = attention_variants(shape)
    table = Table(title=f"KV cache: {shape.name}")
    table.add_column("")
    for label, _ in variants:
        table.add_column(label, justify="right")
    shapes = [v for _, v in variants]
    totals = [kv_cache_bytes(v, seq_len, batch, dtype) for v in shapes]
    mha_bytes = totals[0]
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
