"""Weight-only quantised linears on PyTorch's own CPU kernels, and the quantised twin of a model.

``quantization=`` (vLLM's argument name) picks a mode; the loaded model is never changed (the dense oracle
keeps its plain fp32 kernels), the engine runs a twin whose linears hold packed weights, like
``kvlab.model.packed`` does for oneDNN. Embeddings, norms, RoPE and attention stay in the model's dtype.

- ``int8``: symmetric int8 in groups of 32 weights along a row (llama.cpp's Q8_0 blocks), ``w = scale[n, g] *
  q[n, k]``, on kvlab's own kernel (``kvlab.model.bf16_linear.small_linear_int8``: the codes dequantised to
  bf16 as the bf16 small-batch walk reads them, up to 12 rows; from 13, each block of 64 columns once into a
  scratch); where it cannot be built or the CPU lacks AVX512-BF16, every product takes the dense path below
  (one log line). Per-channel scales (PyTorch's
  ``aten._weight_int8pack_mm``, one scale per row) let a few outlying weights stretch a whole channel's scale and
  lost to int4 in fidelity (docs/performance.md, "Fidelity").
- ``int4``: asymmetric 4-bit in groups of 32 weights along a row, on ``aten._weight_int4pack_mm_for_cpu``
  (packed by ``aten._convert_weight_to_int4pack_for_cpu``).
- ``gguf``: the GGUF file's own Q4_1 codes on the same int4 kernel (see below); what the file does not store
  as Q4_1 stays a dense linear in the model's dtype.
- ``int8-w8a8`` (vLLM's "INT8 W8A8"): int8 weights with one scale per output channel, times int8 activations
  quantised per token at run time (dynamic, symmetric: a row's scale is its own largest magnitude over 127), the
  product summed exactly in int32 (kvlab's AVX2 or AVX512-VNNI kernel, ``kvlab.model.int8_linear``, or
  ``torch._int_mm``: the same bits) and scaled back in fp32. Per token, not per tensor: a tensor-wide scale would
  let one request's activations set the rounding of every other request in its batch, so its outputs would depend on
  who it shares a step with; with a scale per row and an exact integer sum, a row's output is bitwise the same in
  any batch (tests/model/test_w8a8.py). The reference is the dequantised product in fp32 (``W8A8Linear.reference``).

The LM head stays dense in the model's dtype in every mode but ``int8-w8a8-head`` (see ``LM_HEAD``); on SmolLM2 it
is the tied Q8_0 embedding.

The int4 kernel's convention, measured here (tests/test_quant.py checks it against a dequantised
reference): ``w = (q - 8) * scale + zero`` with ``q`` in 0..15, one ``(scale, zero)`` per group of
``group_size`` weights along the input dimension; ``group_size`` must be 32, 64, 128 or 256, the output
dimension a multiple of 16 (smaller layers are padded with zero rows; the padding is cut off the output).

Mapping Q4_1 onto it: a Q4_1 block is ``w = d * q + m`` (fp16 ``d`` and ``m``, 32 weights, 4-bit ``q``), so
``scale = d`` and ``zero = m + 8 d`` with the same codes and group size 32. What is exact and what is rounded:
- codes and grouping: exact (the file's 4-bit codes, unchanged; group 32 = Q4_1's block).
- ``scale = d``: exact in fp32 (fp16 is a subset); rounded to bfloat16 (8 significant bits instead of
  fp16's 11: relative error up to 2^-8, 0.39% measured on SmolLM2) when the kernel runs in bf16.
- ``zero = m + 8 d``: exact in fp32 for every one of SmolLM2's 3,317,760 blocks (checked in float64);
  rounded to bfloat16 in bf16. It is centred on the block, so its rounding error is small next to ``d``.
In fp32 the twin's weights are bit-identical to ``load_gguf``'s dequantised ones (checked in the tests).

Why the kernels run in bfloat16 by default: on this CPU (AVX512-BF16) the int4 kernel is vectorised for bf16
activations only; with fp32 activations it takes a scalar path, measured 20-50x slower than bf16 (e.g.
SmolLM2's 3072 x 576 gate/up at 16 rows: ~50 ms fp32 against ~5 ms bf16), and kvlab's int8 kernel multiplies
bf16 pairs. So a quantised linear casts its input to ``compute_dtype`` (bf16 unless told otherwise) and its
output back to the model's dtype; fp32 compute (the dequantised GEMM, for int8) is kept for the exactness tests.

From ``DENSE_ROWS`` rows on (prefill), a linear dequantises its weight to bf16 and runs torch's GEMM instead.
That path rounds each dequantised weight to bf16 once more, so a request's numerics may differ in the last
bf16 bits between a step where it shares a large prefill batch and one where it runs alone: rounding drift,
like any reduced-precision batch-dependent kernel choice, never a change of which weights are used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from kvlab import native
from kvlab.config import ConfigError, ModeConfig
from kvlab.model.bf16_linear import pack_group_scales, pack_weight, small_linear_ops, unblock
from kvlab.model.codes import (
    COMPUTE_DTYPE,
    INT4_GROUP_SIZE,
    INT8_GROUP_SIZE,
    Int4Codes,
    Int8Codes,
    W8A8Codes,
    quantize_int4,
    quantize_int8,
    quantize_tokens,
    quantize_w8a8,
)
from kvlab.model.gguf import Q4_1Blocks, gguf_q4_1_linears
from kvlab.model.int8_linear import (
    BLOCK_COLUMNS,
    HALVES,
    PLAIN,
    SILU_MUL,
    SILU_MUL_VECTOR,
    VNNI_COLUMNS,
    W8A8_KERNELS,
    from_halves,
    int8_linear_ops,
    pack_codes,
    pack_scales,
    pack_vnni,
    pack_vnni_halves,
    unpack_vnni,
    unpack_vnni_halves,
    w8a8_layout,
)
from kvlab.model.llama import LlamaModel
from kvlab.model.loader import LoadedModel
from kvlab.model.packed import Rows, packable_dtype
from kvlab.model.twin import remembered_twin

log = logging.getLogger(__name__)

_INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
_INT4_ROWS_MULTIPLE = 16  # what _convert_weight_to_int4pack_for_cpu accepts
_INT4_KERNELS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
# The aten ops a mode needs (int8 runs on kvlab's own kernel, or dequantises: none).
KERNELS: dict[str, tuple[str, ...]] = {
    "int8": (),
    "int4": _INT4_KERNELS,
    "gguf": _INT4_KERNELS,
    "int8-w8a8": ("_int_mm",),
    "int8-w8a8-head": ("_int_mm",),
}
# From this many rows on (prefill chunks), a quantised linear dequantises its weight to the compute dtype and
# runs torch's dense GEMM: the int4 kernel redoes the dequantisation for every block of rows and is compute-bound
# there (measured here, one thread, 3072 x 576 at 1024 rows: int4 kernel ~100 ms, the per-channel int8 kernel
# int8 used then ~110 ms, dequantise + bf16 GEMM ~38 ms). Below it the kernels are faster than dequantising
# (~1 ns per weight alone); whole SmolLM2 linears, one thread, the dense path won from 64-128 rows on.
DENSE_ROWS = 128
# The modes whose linears multiply int8 activations, and those of them that quantise the LM head too.
W8A8_MODES = ("int8-w8a8", "int8-w8a8-head")
HEAD_QUANTISED_MODES = ("int8-w8a8-head",)
# Rows of every GGUF linear compared with the loaded model's weights (all rows would cost ~2 s on SmolLM2).
_CHECKED_ROWS = 64


def check_quantization(mode: str) -> None:
    """Refuse an unknown mode (``ModeConfig``'s check), or a mode whose kernels this torch build or CPU cannot run,
    naming the mode."""
    ModeConfig(quantization=mode)
    missing = [op for op in KERNELS[mode] if not hasattr(torch.ops.aten, op)]
    if missing:
        raise ConfigError(
            f"quantization={mode!r} needs torch.ops.aten.{', '.join(missing)}, which this torch build "
            f"({torch.__version__}) lacks"
        )
    try:  # an op can exist and still refuse this CPU or dtype: try it on a tiny layer
        probe = nn.Linear(32, 16, bias=False)
        LINEARS[mode].from_linear(probe)(torch.zeros(1, 32))
    except RuntimeError as exc:
        raise ConfigError(f"quantization={mode!r} cannot run on this CPU/torch build: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# The linears


class _QuantLinear(nn.Module):
    """Shared plumbing: flatten to 2-D, cast to the kernel's dtype and back, cut padded output rows, and
    switch to dequantise + dense GEMM from ``dense_rows`` rows on."""

    in_features: int
    out_features: int
    compute_dtype: torch.dtype
    kernel: str
    dense_rows: int = DENSE_ROWS

    @property
    def gemm_dtype(self) -> torch.dtype:
        """The dtype the dense path multiplies in: the compute dtype where oneDNN runs it natively, else fp32 (on a
        CPU without bf16 instructions torch's bf16 GEMM is a generic loop, ~60x slower than fp32:
        docs/performance.md). The operands are the compute dtype's values either way, so only the summation's
        rounding differs."""
        return self.compute_dtype if packable_dtype(self.compute_dtype) else torch.float32

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (in the compute dtype) times the dequantised weight, in ``gemm_dtype``."""
        dtype = self.gemm_dtype
        return nn.functional.linear(x.to(dtype), self.dequantized().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()
        rows = x2.shape[0]
        if rows >= self.dense_rows:
            y = self.dense_product(x2)
        elif rows:
            y = self._mm(x2)[:, : self.out_features]
        else:  # the kernels refuse empty inputs
            y = x2.new_zeros(0, self.out_features)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype, as the dense path multiplies it."""
        raise NotImplementedError

    def weight_nbytes(self) -> int:
        """Bytes the kernel streams for one product: its codes and their scales (and zeros)."""
        raise NotImplementedError


class Int8Linear(_QuantLinear):
    """A bias-free linear on int8 codes with group scales: kvlab's ``small_linear_int8`` below ``dense_rows`` rows
    (bf16 activations), dequantise + dense GEMM above it, and everywhere the kernel is missing."""

    kernel = "kvlab small_linear_int8"
    codes: torch.Tensor
    group_scales: torch.Tensor

    def __init__(self, codes: Int8Codes, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.q.shape
        self.compute_dtype = compute_dtype
        self.group_size = codes.group_size
        # The op set is looked up at each call (it is cached), not held: twins deep-copy their modules.
        self.on_kernel = compute_dtype == torch.bfloat16 and small_linear_ops() is not None
        if not self.on_kernel:
            self.kernel = "dequantised GEMM"
        # The kernel's layout holds the only copy of the codes and scales (the scales in fp32, already rounded to the
        # compute dtype, so its own copy of them is exact); the dense path unpacks them.
        self.register_buffer("codes", pack_weight(codes.q, torch.int8), persistent=False)
        self.register_buffer("group_scales", pack_group_scales(codes.scale.to(compute_dtype)), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int8Linear:
        return cls(quantize_int8(linear.weight, compute_dtype), compute_dtype)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        ops = small_linear_ops() if self.on_kernel else None
        if ops is None:
            return self.dense_product(x)
        return native.call_labelled(
            "kvlab::small_linear_int8",
            ops.small_linear_int8,
            x,
            self.codes,
            self.group_scales,
            self.out_features,
            self.group_size,
        )

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.group_scales))

    def dequantized(self) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        q = unblock(self.codes, n).to(self.compute_dtype).view(n, k // g, g)
        return q.mul_(unblock(self.group_scales, n).to(self.compute_dtype)[..., None]).view(n, k)


class Int4Linear(_QuantLinear):
    """A bias-free linear on ``aten._weight_int4pack_mm_for_cpu`` (4-bit codes packed by the kernel's own op)."""

    kernel = "aten._weight_int4pack_mm_for_cpu"
    packed: torch.Tensor
    scale_zeros: torch.Tensor
    halves: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def __init__(self, codes: Int4Codes, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> None:
        super().__init__()
        if codes.group_size not in _INT4_GROUP_SIZES:
            raise ValueError(f"int4: group size {codes.group_size} is not one of {_INT4_GROUP_SIZES}")
        self.out_features, self.in_features = codes.q.shape
        self.compute_dtype = compute_dtype
        self.group_size = codes.group_size
        pad = -self.out_features % _INT4_ROWS_MULTIPLE
        # Padded rows: code 8, scale 0, zero 0, i.e. zero weights; their outputs are cut off in forward.
        q = nn.functional.pad(codes.q.to(torch.int32), (0, 0, 0, pad), value=8)
        scale = nn.functional.pad(codes.scale, (0, 0, 0, pad))
        zero = nn.functional.pad(codes.zero, (0, 0, 0, pad))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), persistent=False)
        # The kernel takes [K // G, N, 2] (scale, zero) in the activations' dtype.
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(compute_dtype)
        self.register_buffer("scale_zeros", sz, persistent=False)
        # The dense path's copy of the codes (the kernel's layout is blocked for its own loads): column k in
        # the low nibble, column k + K/2 in the high one, so that unpacking is two byte ops and a cat.
        half = self.in_features // 2
        halves = codes.q[:, :half] | (codes.q[:, half:] << 4)
        self.register_buffer("halves", halves.contiguous(), persistent=False)
        self.register_buffer("scale", codes.scale.to(compute_dtype), persistent=False)
        self.register_buffer("zero", codes.zero.to(compute_dtype), persistent=False)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, compute_dtype: torch.dtype = COMPUTE_DTYPE, group_size: int = INT4_GROUP_SIZE
    ) -> Int4Linear:
        return cls(quantize_int4(linear.weight, group_size, compute_dtype), compute_dtype)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zeros)

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zeros))

    def dequantized(self) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        q = torch.cat([self.halves & 15, self.halves >> 4], dim=1).view(n, k // g, g)
        # In place, one pass each: (q - 8) * scale + zero, the kernel's formula.
        w = q.to(self.compute_dtype).sub_(8).mul_(self.scale[..., None]).add_(self.zero[..., None])
        return w.view(n, k)


class W8A8Linear(_QuantLinear):
    """A bias-free linear on int8 weights (a scale per output channel) and int8 activations (a scale per token),
    summed exactly in int32 at every batch size, the same bits on every path: the mode's point is integer
    arithmetic where the product is compute-bound, so it never switches to a dequantised GEMM. Which path
    (``kernel``) follows the CPU (``kvlab.model.int8_linear``):

    - AVX512-VNNI: kvlab's ``w8a8_vnni`` (codes, ``vpdpbusd`` product and scaling in one call, in the model's
      dtype) over its packed blocks;
    - other VNNI: ``torch._int_mm`` (oneDNN's VNNI GEMM) over the codes ``[N, K]``, reached through the op set's
      ``w8a8_mm`` (codes, product and scaling in one call) where it is built;
    - AVX2: kvlab's ``vpmaddwd`` kernel at every size, over its packed blocks;
    - else ``torch._int_mm`` over the codes ``[K, N]``.

    A layer whose output is two halves, gate and up of an MLP (``halves=True``), keeps its VNNI blocks in the
    halves layout (``int8_linear.halves_columns``) where each half is whole vectors: then ``silu_mul_product``
    returns ``silu(gate) * up`` from the same call, as ``kvlab.model.fused``'s ``silu_mul`` of its output would."""

    dense_rows = 2**62  # never: see the class docstring
    codes: torch.Tensor
    scale: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(self, codes: W8A8Codes, halves: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.q.shape
        self.compute_dtype = torch.float32  # the activations' scales and the int32 sums are scaled in fp32
        # The op set is looked up at each call (it is cached), not held: twins deep-copy their modules.
        self.layout = w8a8_layout(self.in_features)
        self.kernel = W8A8_KERNELS[self.layout]
        # One copy of the codes, in the layout the path reads: either kernel's blocks, [N, K] as quantised, or
        # [K, N] (torch._int_mm's operand without a copy).
        offsets = None
        # silu_mul's vector loop covers a half when it is whole vectors; so does the epilogue, the same bits.
        self.halves = halves and self.layout == "vnni" and self.out_features % (2 * SILU_MUL_VECTOR) == 0
        if self.halves:
            q, offsets, scale = pack_vnni_halves(codes.q, codes.scale)
        elif self.layout == "vnni":
            (q, offsets), scale = pack_vnni(codes.q), pack_scales(codes.scale, VNNI_COLUMNS)
        elif self.layout == "packed":
            q, scale = pack_codes(codes.q), pack_scales(codes.scale)
        else:
            q = (codes.q if self.layout == "nk" else codes.q.t()).contiguous()
            scale = codes.scale.float().contiguous()
        self.register_buffer("codes", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> W8A8Linear:
        """``compute_dtype`` is accepted for the other linears' signature: W8A8 scales in fp32 whatever it is."""
        return cls(quantize_w8a8(linear.weight))

    @classmethod
    def from_gate_up(cls, linear: nn.Linear) -> W8A8Linear:
        """An MLP's gate and up projections in one linear (output ``[gate | up]``), laid out for silu_mul_product."""
        return cls(quantize_w8a8(linear.weight), halves=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this 120 times (SmolLM2): rows already as every path takes them skip the shared
        # plumbing's casts, slices and reshapes, ~10 us a call (docs/performance.md, "int8-w8a8 on the VNNI
        # machine"); every path's product is exactly out_features wide.
        if x.dim() == 2 and x.shape[0] and (x.dtype == torch.float32 or self._takes_bf16(x)):
            return self._mm(x)
        return super().forward(x)

    def _takes_bf16(self, x: torch.Tensor) -> bool:
        # The VNNI kernel reads bf16 rows and writes bf16 as the plumbing's casts would (exact widening, one
        # rounding to nearest even): the same bits without two passes over the activations.
        return x.dtype == torch.bfloat16 and self.layout == "vnni"

    def silu_mul_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this layer's output for rows ``x`` [T, K] in one call, or None where this layer
        cannot give it (not laid out in halves, or rows the kernel does not take as they are)."""
        if not (self.halves and x.dim() == 2 and x.shape[0] and x.dtype in (torch.float32, torch.bfloat16)):
            return None
        return self._vnni(x, SILU_MUL)

    def kernel_call(self) -> Rows | None:
        """This layer's product as the bare compiled call, for a caller whose rows are always 2-D, contiguous, in
        fp32 or the model's dtype (``kvlab.model.fused``'s layer loop): ``forward``'s bits without its checks, its
        profiler label or a module call; None where the layer has no such call (not on the VNNI kernel)."""
        return self._bare_vnni(self._product_epilogue) if self.layout == "vnni" else None

    def silu_mul_call(self) -> Rows | None:
        """``silu_mul_product`` as the bare compiled call (as ``kernel_call``), or None where it has none."""
        return self._bare_vnni(SILU_MUL) if self.halves else None

    @property
    def _product_epilogue(self) -> int:
        # What the VNNI kernel stores of the plain product: the halves layout's columns go back to their halves.
        return HALVES if self.halves else PLAIN

    def _bare_vnni(self, epilogue: int) -> Rows:
        ops = int8_linear_ops()
        assert ops is not None and self.offsets is not None
        product, codes, offsets, scale, n = ops.w8a8_vnni, self.codes, self.offsets, self.scale, self.out_features
        return lambda x: product(x, codes, offsets, scale, n, epilogue)

    def _vnni(self, x: torch.Tensor, epilogue: int) -> torch.Tensor:
        # The op called with the layer's tensors directly, not through a _bare_vnni closure: the module path (every
        # linear of a mode without the fused loop) would build one per call.
        ops = int8_linear_ops()
        assert ops is not None and self.offsets is not None
        return native.call_labelled(
            "kvlab::w8a8_vnni", ops.w8a8_vnni, x, self.codes, self.offsets, self.scale, self.out_features, epilogue
        )

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "vnni":
            return self._vnni(x, self._product_epilogue)
        ops = int8_linear_ops() if self.layout == "nk" else None
        if ops is not None:
            return native.call_labelled("kvlab::w8a8_mm", ops.w8a8_mm, x, self.codes, self.scale)
        q, row_scale = quantize_tokens(x)
        if self.layout == "packed":
            ops = int8_linear_ops()
            assert ops is not None
            return native.call_labelled(
                "kvlab::w8a8_linear", ops.w8a8_linear, q, row_scale, self.codes, self.scale, self.out_features
            )
        acc = native.call_labelled("aten::_int_mm", torch._int_mm, q, self.weight_t())
        return acc.float().mul_(row_scale[:, None]).mul_(self.column_scales())

    def weight_t(self) -> torch.Tensor:
        """The codes [K, N] (``torch._int_mm``'s second operand; a view where the layer keeps them otherwise)."""
        if self.layout == "kn":
            return self.codes
        if self.layout == "nk":
            return self.codes.t()
        if self.halves:
            return unpack_vnni_halves(self.codes, self.out_features)
        if self.layout == "vnni":
            return unpack_vnni(self.codes, self.out_features)
        nb, kp = self.codes.shape[:2]
        return self.codes.permute(1, 3, 0, 2).reshape(kp * 2, nb * BLOCK_COLUMNS)[:, : self.out_features]

    def column_scales(self) -> torch.Tensor:
        """The weights' scales [N], in the order of the layer's output columns."""
        return from_halves(self.scale, self.out_features) if self.halves else self.scale[: self.out_features]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """What ``forward`` computes, in plain fp32: the dequantised activations times the dequantised weights."""
        x2 = x.reshape(-1, self.in_features)
        q, row_scale = quantize_tokens(x2)
        y = (q.float() * row_scale[:, None]) @ self.dequantized().T
        return y.reshape(*x.shape[:-1], self.out_features)

    def weight_nbytes(self) -> int:
        held = (self.codes, self.scale) if self.offsets is None else (self.codes, self.scale, self.offsets)
        return sum(t.numel() * t.element_size() for t in held)

    def dequantized(self) -> torch.Tensor:
        return self.weight_t().t().float() * self.column_scales()[:, None]


# Each mode's linear (gguf's Q4_1 codes run on the int4 kernel).
LINEARS: dict[str, type[Int8Linear] | type[Int4Linear] | type[W8A8Linear]] = {
    "int8": Int8Linear,
    "int4": Int4Linear,
    "gguf": Int4Linear,
    "int8-w8a8": W8A8Linear,
    "int8-w8a8-head": W8A8Linear,
}


# ---------------------------------------------------------------------------------------------
# The twin


@dataclass(frozen=True)
class QuantPlan:
    """Which linears a mode quantises (name -> builder) and which stay dense (name -> why)."""

    quantised: dict[str, Callable[[nn.Linear], nn.Module]]
    dense: dict[str, str]


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and m.bias is None}


# The LM head stays in the model's dtype in every mode but int8-w8a8-head, as vLLM's quantisation methods leave it
# by default: the kernels return bf16, and bf16 logits (8 significant bits: steps of 0.03 at 5) tie often enough
# that greedy picks split by index (measured on mini: every int8/int4 divergence from the quantised model's own
# oracle was such a tie). In the gguf mode it is SmolLM2's tied Q8_0 embedding anyway, which no kernel here can
# take. int8-w8a8-head quantises it as the other linears (a scale per vocabulary row, the tied embedding itself
# left as it is): at decode it is the step's largest weight (docs/performance.md, "The LM head in int8").
LM_HEAD = "lm_head"
GATE_UP = "mlp.gate_up_proj"  # kvlab.model.llama.MLP's gate and up projections, one linear
_LM_HEAD_REASON = "the LM head stays in the model's dtype"


def _plan(loaded: LoadedModel, mode: str, compute_dtype: torch.dtype) -> QuantPlan:
    linears = _linears(loaded.model)
    head: dict[str, str] = {}
    if mode not in HEAD_QUANTISED_MODES and linears.pop(LM_HEAD, None) is not None:
        head[LM_HEAD] = _LM_HEAD_REASON
    if mode in W8A8_MODES:  # one scale per channel: any input width
        build: dict[str, Callable[[nn.Linear], nn.Module]] = {
            n: W8A8Linear.from_gate_up if n.endswith(GATE_UP) else W8A8Linear.from_linear for n in linears
        }
        return QuantPlan(build, head)
    if mode in ("int8", "int4"):
        group = INT8_GROUP_SIZE if mode == "int8" else INT4_GROUP_SIZE
        kind = LINEARS[mode]
        quantised: dict[str, Callable[[nn.Linear], nn.Module]] = {}
        dense = head
        for n, lin in linears.items():
            if lin.in_features % group:
                dense[n] = f"{lin.in_features} input features, not a multiple of the group size {group}"
            else:
                quantised[n] = lambda lin: kind.from_linear(lin, compute_dtype)
        return QuantPlan(quantised, dense)
    blocks = _gguf_blocks(loaded)
    quantised = {}
    for n in linears:
        if f"{n}.weight" in blocks:
            codes = Int4Codes.from_q4_1(blocks[f"{n}.weight"])
            quantised[n] = lambda lin, codes=codes: Int4Linear(codes, compute_dtype)  # type: ignore[misc]
    dense = {n: "not stored as Q4_1 in the file (kept dequantised)" for n in linears if n not in quantised}
    return QuantPlan(quantised, head | dense)


def _gguf_blocks(loaded: LoadedModel) -> dict[str, Q4_1Blocks]:
    source = loaded.source
    if source is None or source.suffix != ".gguf":
        raise ConfigError(
            f"quantization='gguf' keeps a GGUF file's own codes, but model {loaded.name!r} was not loaded from a "
            "GGUF file (use smollm2 or a .gguf path; int8 and int4 quantise any model)"
        )
    blocks = gguf_q4_1_linears(source)
    state = loaded.model.state_dict()
    for name, b in blocks.items():
        w = state[name]
        rows = torch.arange(0, w.shape[0], max(1, w.shape[0] // _CHECKED_ROWS))
        sample = Q4_1Blocks(b.d[rows], b.m[rows], b.q[rows]).dequantize().to(w.dtype)
        if not torch.equal(sample, w[rows]):
            raise ConfigError(
                f"quantization='gguf': {name} of model {loaded.name!r} differs from the Q4_1 codes in {source} "
                "(weights changed after loading?); the file's codes would run a different model"
            )
    return blocks


def quantized_model(loaded: LoadedModel, mode: str, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> LlamaModel:
    """A twin of ``loaded.model`` (``kvlab.model.twin``: sharing every tensor, remembered per mode and compute
    dtype) whose linears run on the mode's kernels (see the module docstring); linears a mode cannot express
    stay ``nn.Linear``. The loaded model is not modified."""
    check_quantization(mode)
    built: list[QuantPlan] = []  # planned only when the twin is built, not when it is remembered

    def swap(twin: nn.Module) -> None:
        plan = _plan(loaded, mode, compute_dtype)
        built.append(plan)
        with torch.no_grad():
            for name, lin in _linears(twin).items():
                if name in plan.quantised:
                    parent, _, attr = name.rpartition(".")
                    setattr(twin.get_submodule(parent) if parent else twin, attr, plan.quantised[name](lin))

    twin = remembered_twin(loaded.model, "quant", (mode, compute_dtype), swap)
    if built:
        log.info("%s", describe(twin, mode, built[0].dense))
    return cast(LlamaModel, twin)


def linear_dtype(quantization: str | None, dtype: str) -> str:
    """The dtype name whose matmul peak a mode's linears run at: "int8" where they multiply int8 activations."""
    return "int8" if quantization in W8A8_MODES else dtype


def head_dtype(quantization: str | None, dtype: str) -> str:
    """The dtype name whose matmul peak a mode's LM head runs at: "int8" where it is quantised with the linears."""
    return "int8" if quantization in HEAD_QUANTISED_MODES else dtype


# How each mode's scales are laid out, as its startup line says it.
GRANULARITY = {
    "int8": f"group {INT8_GROUP_SIZE}",
    "int4": f"group {INT4_GROUP_SIZE}",
    "gguf": f"group {INT4_GROUP_SIZE}",
    "int8-w8a8": "weights per channel, activations per token",
    "int8-w8a8-head": "weights per channel, activations per token",
}


def describe(twin: nn.Module, mode: str, dense: dict[str, str] | None = None) -> str:
    """The startup line: which kernels the mode runs on, and what stays dense and why."""
    quant = [m for m in twin.modules() if isinstance(m, _QuantLinear)]
    kernels = sorted({m.kernel for m in quant})
    cd = "/".join(sorted({str(m.compute_dtype).removeprefix("torch.") for m in quant}))
    dtype = str(next(twin.parameters()).dtype).removeprefix("torch.")
    text = f"quantization={mode}: {len(quant)} linears on {', '.join(kernels) or 'no kernel'} ({cd} activations"
    text += f", {GRANULARITY[mode]})"
    if any(m.gemm_dtype != m.compute_dtype for m in quant):
        text += "; their dense GEMM sums in float32 (no native bf16 GEMM on this CPU)"
    if dense:
        why = sorted(set(dense.values()))
        text += f"; {len(dense)} dense in {dtype} ({', '.join(sorted(dense))[:120]}: {'; '.join(why)})"
    return text + f"; embeddings and norms in {dtype}"
