"""The compiled product of ``int8-w8a8`` (``csrc/int8_linear.cpp``), built on first use, and its weight layout.

``torch._int_mm`` is the exact int8 product this torch offers, and on a CPU without VNNI it runs a generic loop:
~1 GOP/s measured on an AVX2-only AMD EPYC, against ~75-90 GFLOP/s for an fp32 GEMM on the same core
(docs/performance.md, "int8-w8a8"). The kernel here widens the codes to int16 in registers and multiplies pairs
with AVX2's ``vpmaddwd`` into int32 (exact), reading the weights as int8: a quarter of fp32's bytes. It scales
each sum as the torch path does (``float(sum) * row_scale * column_scale``, in that order), so the two give the
same bits and ``torch._int_mm`` is both its fallback and its check. Where it cannot be built, or the CPU has no
AVX2, the layer keeps ``torch._int_mm`` after one log line.

On a CPU with AVX512-VNNI the op set's ``w8a8_vnni`` serves every size: ``vpdpbusd`` over codes packed 64 output
columns x 4 input features a vector, the activations quantised, multiplied and scaled back in one call, read and
written in the model's dtype. oneDNN's ``torch._int_mm`` is as fast on a hot product, but its int32 result is
written and read back, and its weights reordered at each call: ~2x slower at decode sizes and on prompts
(docs/performance.md, "int8-w8a8's own VNNI kernel"). Without that kernel (AVX-VNNI only, or input features
not a multiple of 4) the codes stay ``[N, K]`` as quantised and ``w8a8_mm`` makes a token's codes, calls
``torch._int_mm`` over their transposed view and scales back in one call. Every path gives the torch path's bits.

An MLP's gate-up linear (two halves, ``[gate | up]``) keeps its VNNI blocks in halves (``halves_columns``: each
block the same 32 columns of gate and of up), so that the kernel's epilogue can store ``silu(gate) * up`` directly
(``SILU_MUL``) as well as the two halves in place (``HALVES``).
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
VNNI_COLUMNS = 64  # the VNNI kernel's: four 16-lane int32 accumulators a row


@functools.cache
def int8_linear_ops() -> ModuleType | None:
    """The compiled op set, or None (after one log line) where it cannot be built or this CPU lacks AVX2."""
    module = native.build(
        "kvlab_int8_linear",
        native.source("int8_linear.cpp"),
        ["w8a8_linear", "w8a8_mm", "w8a8_vnni", "has_avx2", "has_vnni_kernel"],
        "int8-w8a8 linear",
    )
    if module is not None and not module.has_avx2():
        log.warning("int8-w8a8 linear unavailable (this CPU has no AVX2); using torch._int_mm")
        return None
    return module


def has_vnni() -> bool:
    """Does this CPU have the int8 dot product oneDNN's ``torch._int_mm`` runs on (AVX512-VNNI or AVX-VNNI)?"""
    return bool({"avx512_vnni", "avx_vnni"} & set(native.cpu_flags().split()))


def vnni_kernel_ready() -> bool:
    """Is the op set's ``w8a8_vnni`` built for this CPU (AVX512-VNNI)?"""
    ops = int8_linear_ops()
    return ops is not None and bool(ops.has_vnni_kernel())


W8A8Layout = Literal["vnni", "nk", "packed", "kn"]
W8A8_KERNELS: dict[W8A8Layout, str] = {
    "vnni": "kvlab w8a8_vnni",
    "nk": "torch._int_mm (oneDNN VNNI)",
    "packed": "kvlab w8a8_linear",
    "kn": "torch._int_mm",
}


def w8a8_layout(in_features: int) -> W8A8Layout:
    """How a W8A8 layer keeps its codes on this CPU: the VNNI kernel's blocks (it takes input features in fours),
    ``[N, K]`` where ``torch._int_mm`` runs on VNNI without that kernel (it reads their transposed view), the AVX2
    kernel's packed blocks (it takes input features in pairs), or ``[K, N]`` for ``torch._int_mm`` on a CPU with
    neither."""
    if has_vnni():
        return "vnni" if in_features % 4 == 0 and vnni_kernel_ready() else "nk"
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


def pack_scales(scale: torch.Tensor, columns: int = BLOCK_COLUMNS) -> torch.Tensor:
    """Column scales [N] -> [ceil(N / columns) * columns] fp32, zero past N."""
    return torch.nn.functional.pad(scale.float(), (0, -scale.numel() % columns)).contiguous()


def pack_vnni(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] (K a multiple of 4) -> the VNNI kernel's order ``[ceil(N / 64), K / 4, 64, 4]`` (per block
    of 64 output columns, for each four input features the columns' four codes side by side: one vector a step
    for 16 columns), and each column's offset ``128 x sum of its codes`` (int32, zero past N), which the kernel
    subtracts to undo its activations' shift to unsigned bytes."""
    n, k = q.shape
    pad = -n % VNNI_COLUMNS
    padded = torch.nn.functional.pad(q, (0, 0, 0, pad))
    blocks = padded.view(-1, VNNI_COLUMNS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    offsets = (padded.sum(dim=1, dtype=torch.int32) * 128).contiguous()
    return blocks, offsets


# The VNNI kernel's epilogues (csrc/int8_linear.cpp): what a block's columns are, and what is stored of them.
PLAIN, HALVES, SILU_MUL = 0, 1, 2
# The fp32 lanes of fused.cpp's silu_mul loop where the VNNI kernel builds (AVX512): a half of whole vectors is
# one the epilogue and that loop cover alike.
SILU_MUL_VECTOR = 16


def halves_columns(n: int) -> torch.Tensor:
    """For each column of the halves layout of a layer with ``n`` output features (two halves, gate and up: each
    block holds the same 32 columns of both, the gate's first), the layer's column it holds; -1 for padding."""
    half = n // 2
    first = torch.arange(0, half, VNNI_COLUMNS // 2)[:, None] + torch.arange(VNNI_COLUMNS // 2)[None, :]
    gate = torch.where(first < half, first, -1)
    return torch.cat([gate, torch.where(gate >= 0, gate + half, -1)], dim=1).reshape(-1)


def into_halves(columns: torch.Tensor) -> torch.Tensor:
    """A two-halves layer's values per output column (dim 0: its codes [n, K] or its scales [n]) in the halves
    layout's order (``halves_columns``), zero where a column is padding."""
    order = halves_columns(columns.shape[0])
    held = order >= 0
    out = columns.new_zeros(order.numel(), *columns.shape[1:])
    out[held] = columns[order[held]]
    return out


def from_halves(laid_out: torch.Tensor, n: int) -> torch.Tensor:
    """``into_halves`` undone: values per column of the halves layout (dim 0) back in the layer's order, [n, ...]."""
    order = halves_columns(n)
    held = order >= 0
    out = laid_out.new_empty(n, *laid_out.shape[1:])
    out[order[held]] = laid_out[held]
    return out


def pack_vnni_halves(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A two-halves layer's codes [n, K] and column scales [n] in the halves layout: the kernel's blocks and offsets
    (``pack_vnni``) and the scales."""
    blocks, offsets = pack_vnni(into_halves(q))
    return blocks, offsets, into_halves(scale.float())


def unpack_vnni(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_vnni``'s blocks -> the codes [K, N] (a copy), as ``torch._int_mm`` takes them."""
    nb, kq = blocks.shape[:2]
    return blocks.permute(1, 3, 0, 2).reshape(kq * 4, nb * VNNI_COLUMNS)[:, :n]


def unpack_vnni_halves(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_vnni_halves``' blocks -> the codes [K, n] in the layer's column order."""
    return from_halves(unpack_vnni(blocks, blocks.shape[0] * VNNI_COLUMNS).t(), n).t()
