"""The compiled product of ``int8-w8a8`` (``csrc/int8_linear.cpp``), built on first use, and its weight layout.

``torch._int_mm`` is the exact int8 product this torch offers, and on a CPU without VNNI it runs a generic loop:
~1 GOP/s measured on an AVX2-only AMD EPYC, against ~75-90 GFLOP/s for an fp32 GEMM on the same core
(docs/performance.md, "int8-w8a8"). The kernel here widens the codes to int16 in registers and multiplies pairs
with AVX2's ``vpmaddwd`` into int32 (exact), reading the weights as int8: a quarter of fp32's bytes. It scales
each sum as the torch path does (``float(sum) * row_scale * column_scale``, in that order), so the two give the
same bits and ``torch._int_mm`` is both its fallback and its check. Where it cannot be built, or the CPU has no
AVX2, the layer keeps ``torch._int_mm`` after one log line.

On a CPU with VNNI ``torch._int_mm`` is oneDNN's VNNI GEMM: about twice the bf16 GEMM's speed on prompts, and
ahead of a VNNI kernel of kvlab's own at every size down to one row (docs/performance.md, "int8-w8a8 on the
VNNI machine"). There the codes stay ``[N, K]`` as quantised (``torch._int_mm`` reads their transposed view) and
the op set's ``w8a8_mm`` makes a token's codes, calls it and scales back in one call: in torch ops the way there
cost more than the product at decode sizes. The same bits as the torch path.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Literal

import torch

from kvlab import native

log = logging.getLogger(__name__)

BLOCK_COLUMNS = 16  # output columns per packed block: two 8-lane int32 accumulators a row


@functools.cache
def int8_linear_ops() -> ModuleType | None:
    """The compiled op set, or None (after one log line) where it cannot be built or this CPU lacks AVX2."""
    module = native.build(
        "kvlab_int8_linear",
        native.source("int8_linear.cpp"),
        ["w8a8_linear", "w8a8_mm", "has_avx2"],
        "int8-w8a8 linear",
    )
    if module is not None and not module.has_avx2():
        log.warning("int8-w8a8 linear unavailable (this CPU has no AVX2); using torch._int_mm")
        return None
    return module


def has_vnni() -> bool:
    """Does this CPU have the int8 dot product oneDNN's ``torch._int_mm`` runs on (AVX512-VNNI or AVX-VNNI)?"""
    return bool({"avx512_vnni", "avx_vnni"} & set(native.cpu_flags().split()))


W8A8Layout = Literal["nk", "packed", "kn"]
W8A8_KERNELS: dict[W8A8Layout, str] = {
    "nk": "torch._int_mm (oneDNN VNNI)",
    "packed": "kvlab w8a8_linear",
    "kn": "torch._int_mm",
}


def w8a8_layout(in_features: int) -> W8A8Layout:
    """How a W8A8 layer keeps its codes on this CPU: ``[N, K]`` where ``torch._int_mm`` runs on VNNI (it reads
    their transposed view), the AVX2 kernel's packed blocks (it takes input features in pairs), or ``[K, N]`` for
    ``torch._int_mm`` on a CPU with neither."""
    if has_vnni():
        return "nk"
    if in_features % 2 == 0 and int8_linear_ops() is not None:
        return "packed"
    return "kn"


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K even) -> the kernel's order ``[ceil(N / 16), K / 2, 16, 2]``: per block of 16 output
    columns, for each pair of input features the columns' two codes side by side; columns past N are zero."""
    n, k = q.shape
    pad = -n % BLOCK_COLUMNS
    padded = torch.nn.functional.pad(q, (0, 0, 0, pad))
    blocks = padded.view(-1, BLOCK_COLUMNS, k // 2, 2)  # [NB, 16, K/2, 2]
    return blocks.permute(0, 2, 1, 3).contiguous()


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """Column scales [N] -> [ceil(N / 16) * 16] fp32, zero past N."""
    return torch.nn.functional.pad(scale.float(), (0, -scale.numel() % BLOCK_COLUMNS)).contiguous()
