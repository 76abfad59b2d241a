"""Compiled tiled (flash) attention for long prefill chunks, fp32 and bf16 (opt-in, with the ``cpp`` kernels;
the C++ is ``csrc/flash_prefill.cpp``).

A chunk of many queries over a long context is a product of matrices: every query against every key it sees,
then the weighted sum of V. PyTorch's CPU flash kernel tiles it, but runs bf16 at its fp32 speed and fp32 at a
third of this CPU's FMA rate (docs/performance.md, "Long context"). Both loops here follow the flash-attention
scheme: a tile of queries of one head walks the tiles of keys it sees with an online softmax in fp32 (running
maximum and sum, the output rescaled when the maximum moves), causal tiles past its last query's key never
computed; tiles are tasks, head-major, so the heads of one GQA group follow each other on a core and find their KV
head's K and V in its cache. The context's K and V are read once per call from the paged cache through the
chunk's slots.

- **bf16** on AVX512-BF16's ``vdpbf16ps`` (a pair of bf16 values times a pair, both products added to fp32, 16
  lanes at once): K and V packed per tile of 32 keys in the order the products read them, K as
  ``[D / 2][32 keys][2]`` (a vector holds one pair of dimensions of 16 keys), V as ``[16 key pairs][D][2]``;
  8 queries x 32 keys of scores in registers, the probabilities rounded to bf16 for the product with V (as
  PyTorch's kernel rounds them for its bf16 GEMM), the output accumulated in fp32 and rounded once.
- **fp32** on FMAs, transposed so that nothing but the query tile is: the queries are the 16 vector lanes, each
  key's values are broadcast; 16 score vectors a tile of 16 keys, the softmax lane-wise (no horizontal
  reduction), the output accumulated as ``[D][16 queries]`` in L1. K and V are first copied into rows of fp32
  per KV head (a bf16 or fp8 cache widened, exactly).

Query ``i`` of the chunk sees keys ``0 .. start + i`` of the context (its cached prefix, then the chunk up to
itself). Tested against SDPA on the same values (``tests/engine/test_flash_prefill.py``). Where the op set cannot
be built, or the CPU lacks AVX-512 (fp32) or AVX512-BF16 (bf16), the chunks keep PyTorch's SDPA after one log
line (``flash_prefill_kernel`` returns None).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from kvlab import native

log = logging.getLogger(__name__)

FLASH_DTYPES = (torch.float32, torch.bfloat16)
FLASH_HEAD_DIMS = (16, 32, 64, 128)  # head_dim / 16 is a compile-time constant of the inner loops


# (q [L, H, D], k_cache, v_cache, slots [ctx], start, scale) -> out [L, H, D] in q's dtype
FlashPrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
# (q [R, H, D], k_cache, v_cache, slots [P], scale) -> (out [R, H, D], lse [R, H]), fp32: every query against
# every slot (a prefix that rows share), normalised, with the log-sum-exp of its scaled scores for a later merge
FlashPrefixKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


@functools.cache
def flash_ops() -> ModuleType | None:
    """The compiled op set (both loops), or None after one log line where it cannot be built."""
    return native.build(
        "kvlab_flash_prefill",
        native.source("flash_prefill.cpp"),
        ["flash_prefill", "flash_prefix", "has_bf16_dot", "has_avx512"],
        "flash prefill kernels",
    )


@functools.cache
def flash_prefill_kernel(dtype: torch.dtype) -> FlashPrefillKernel | None:
    """The compiled op for queries in ``dtype``, or None where it cannot be built (one log line from the build) or
    this CPU lacks what that dtype's loop needs (AVX-512 for fp32, AVX512-BF16 for bf16; one log line)."""
    if dtype not in FLASH_DTYPES:
        return None
    module = flash_ops()
    if module is None:
        return None
    if not (module.has_bf16_dot() if dtype == torch.bfloat16 else module.has_avx512()):
        log.warning("%s flash prefill unavailable on this CPU; using PyTorch's SDPA", dtype)
        return None
    op: FlashPrefillKernel = module.flash_prefill
    return op


@functools.cache
def flash_prefix_kernel(dtype: torch.dtype) -> FlashPrefixKernel | None:
    """The compiled shared-prefix op for queries in ``dtype`` (the same loops as ``flash_prefill_kernel``'s, so
    where that one is, this one is), or None."""
    module = flash_ops() if flash_prefill_kernel(dtype) is not None else None
    if module is None:
        return None
    op: FlashPrefixKernel = module.flash_prefix
    return op
