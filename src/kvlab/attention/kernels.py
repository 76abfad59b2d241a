"""A compiled paged attention that reads K/V where they lie in the pool (opt-in).

The reference path gathers every request's whole context into a new ``[B, ctx, Hkv, D]`` tensor each step
(``index_select``) and runs SDPA on it. This kernel walks a block table instead and reads each slot's K and V in
place. It computes rows, one query each, reading the first ``len`` slots of its table: a decode token is one
row, and so is each query of a short prefill chunk (query ``i`` of a chunk starting at ``start`` reads
``start + i + 1`` slots; ``kvlab.attention.paged.KernelAttentionMetadata``; long chunks go to a tiled kernel). One
task per row; within it, the query heads of one KV head (a GQA group, up to 4 at a time) walk the blocks together,
twice (scores, then the weighted sum of V), each slot's K and V loaded once for all of them, with their queries and
output accumulators held in SIMD registers (``head_dim`` and the group size are template constants, the vectors are
ATen's ``at::vec::Vectorized``, so exp is SLEEF's, as in PyTorch's own CPU kernels). The first group brings the
row's blocks into this core's cache, where the others find them; each walk fetches the block two ahead of the one it
reads (the table's blocks are scattered, and the hardware prefetcher stops at each block's end), and the next row's
first blocks are fetched meanwhile. Everything accumulates in fp32 whatever the storage dtype.

Measured at SmolLM2's shape (9 heads over 3 KV heads, head_dim 64; 16 requests of 141 tokens; 2 threads)
against the previous loop (one pass per request over all heads, scalar exp): a call whose blocks are in cache
fell from 199 to 79 us (fp32) and 227 to 82 us (bf16); with 30 layers' caches in turn, so that every call
starts cold as in a real step, from 360 to 209 us and 330 to 163 us. What is left is the first touch of
each block in memory.

It is a small C++ op (``csrc/paged_decode.cpp``) built on first use by ``kvlab.native`` (cached on disk, built
for this CPU; where it cannot be built, the engine falls back to the reference with one log line). Queries in fp32
or bf16, caches in fp32, bf16 or fp8 (e4m3fn, e5m2: widened exactly on load), the NHD layout, ``head_dim`` in
``KERNEL_HEAD_DIMS``; anything else, and any step with attention capture on, takes the reference path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import cast

import torch

from kvlab import native

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # of the queries
# of the caches: the kernels widen fp8 (e4m3fn, e5m2) exactly on load, and the compiled write rounds into it
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KERNEL_CACHE_DTYPES = KERNEL_DTYPES + FP8_DTYPES
# head_dim is a compile-time constant of the inner loops (a multiple of the SIMD width: 8 or 16 floats).
KERNEL_HEAD_DIMS = (16, 32, 64, 128)


# (q [R, H, D], k_cache, v_cache, block_tables [R, max_blocks], row_context_lens [R], scale) -> out [R, H, D]
PagedAttentionKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


# paged_decode_after_prefix: the same rows over their slots after a prefix they share, merged with their attention
# over it: (..., scale, prefix_out [R, H, D], prefix_lse [R, H], both fp32) -> out [R, H, D]
PagedAfterPrefixKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor],
    torch.Tensor,
]


# (k_cache, v_cache, slots [T] int64, k [T, Hkv, D], v [T, Hkv, D]) -> None: ``KVStorage.write`` for one layer of an
# NHD cache in the new tokens' own dtype, or an fp8 one (rounded as ``.to()`` rounds), K and V in one call; a slot
# outside the cache raises before anything is written.
KVWriteKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@functools.cache
def paged_decode_ops() -> ModuleType | None:
    """The compiled op set, built once per process (and cached on disk by torch); None, after one log line, where
    it cannot be built."""
    return native.build(
        "kvlab_paged_decode",
        native.source("paged_decode.cpp"),
        ["paged_decode", "paged_decode_after_prefix", "kv_write"],
        "paged decode kernel",
    )


def paged_attention_kernel() -> PagedAttentionKernel | None:
    """The compiled op, or None where it cannot be built. (The C++ op keeps its first name, ``paged_decode``.)"""
    module = paged_decode_ops()
    return None if module is None else cast(PagedAttentionKernel, module.paged_decode)


def paged_after_prefix_kernel() -> PagedAfterPrefixKernel | None:
    """The compiled op that finishes a shared-prefix (cascade) decode, or None where it cannot be built."""
    module = paged_decode_ops()
    return None if module is None else cast(PagedAfterPrefixKernel, module.paged_decode_after_prefix)


def kv_write_kernel() -> KVWriteKernel | None:
    """The compiled K/V write of the kernel path, or None where the op set cannot be built. ``KVStorage.write``
    stays the reference: a cast, two views and two ``index_copy_`` calls a layer, where this is one copy loop
    (measured in docs/performance.md, "The kernel path's K/V write")."""
    module = paged_decode_ops()
    return None if module is None else cast(KVWriteKernel, module.kv_write)
