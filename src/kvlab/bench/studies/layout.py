"""NHD vs HND: what the cache layout costs for the two operations every layer does every step.

* write: a decode step stores one token's K and V per request at scattered slots;
* decode read: each request gathers its whole context through its block table, then attends to it
  (``gather`` + ``decode_attention``, what ``PagedAttention`` runs).

Both layouts hold the same values (tests/kv check it); this measures only speed, with
``torch.utils.benchmark`` (median of adaptive repeats). The peer of each NHD figure is the HND figure
of the same shape, in the same run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch.utils import benchmark

from kvlab.attention.paged import decode_attention
from kvlab.bench.table import ResultTable, result_table
from kvlab.config import blocks_for
from kvlab.kv import KVStorage


@dataclass(frozen=True)
class LayoutTiming:
    op: str  # "write" or "decode-read"
    batch: int
    context: int
    nhd_us: float
    hnd_us: float

    @property
    def hnd_over_nhd(self) -> float:
        return self.hnd_us / self.nhd_us

    def as_dict(self) -> dict:
        return asdict(self) | {"hnd_over_nhd": round(self.hnd_over_nhd, 3)}


def layout_table(
    rows: Sequence[LayoutTiming], num_kv_heads: int, head_dim: int, num_heads: int, threads: int
) -> ResultTable:
    """The timings of ``compare_layouts`` as a table."""
    return result_table(
        f"layout: {num_kv_heads} KV heads x {head_dim}, {num_heads} query heads, one layer, {threads} threads",
        ("op", "batch", "context", "NHD µs", "HND µs", "HND / NHD"),
        [
            (r.op, str(r.batch), str(r.context), f"{r.nhd_us:.1f}", f"{r.hnd_us:.1f}", f"{r.hnd_over_nhd:.2f}")
            for r in rows
        ],
    )


def _median_us(fn, min_run_time: float) -> float:
    # Timer runs on one thread unless told otherwise; the layouts are compared on the threads the user set.
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def _random_tables(batch: int, context: int, block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    """[batch, context] slots: every request gets its own blocks, scattered over the pool as after churn."""
    per = blocks_for(context, block_size)
    blocks = random.Random(seed).sample(range(num_blocks), batch * per)
    table = torch.tensor(blocks, dtype=torch.long).view(batch, per)
    pos = torch.arange(context)
    return table[:, pos // block_size] * block_size + pos % block_size


def _time_one(
    store: KVStorage, slots: torch.Tensor, q: torch.Tensor, mask: torch.Tensor, min_run_time: float
) -> tuple[float, float]:
    """(write µs, decode-read µs) of one layout: one new token per request, then the whole context."""
    last = slots[:, -1].contiguous()
    k_new = torch.randn(slots.shape[0], store.num_kv_heads, store.head_dim)

    def attend() -> torch.Tensor:
        k, v = store.gather(0, slots)
        return decode_attention(q, k, v, mask)

    return _median_us(lambda: store.write(0, last, k_new, k_new), min_run_time), _median_us(attend, min_run_time)


def compare_layouts(
    batches: Sequence[int],
    contexts: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    num_heads: int,
    block_size: int = 16,
    min_run_time: float = 0.2,
) -> list[LayoutTiming]:
    results = []
    for context in contexts:
        for batch in batches:
            num_blocks = batch * blocks_for(context, block_size) + 8
            stores = {
                layout: KVStorage(1, num_blocks, block_size, num_kv_heads, head_dim, layout=layout)
                for layout in ("NHD", "HND")
            }
            slots = _random_tables(batch, context, block_size, num_blocks, seed=batch + context)
            q = torch.randn(batch, num_heads, head_dim)
            mask = torch.ones(batch, 1, 1, context, dtype=torch.bool)
            write, read = {}, {}
            for layout, store in stores.items():
                store.write(0, slots.reshape(-1), *(torch.randn(batch * context, num_kv_heads, head_dim),) * 2)
                write[layout], read[layout] = _time_one(store, slots, q, mask, min_run_time)
            results.append(LayoutTiming("write", batch, context, write["NHD"], write["HND"]))
            results.append(LayoutTiming("decode-read", batch, context, read["NHD"], read["HND"]))
    return results
