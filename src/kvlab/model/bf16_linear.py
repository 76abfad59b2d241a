"""A compiled bf16 linear for the few rows of a decode step (opt-in, with the ``cpp`` kernels; the C++ is
``csrc/bf16_linear.cpp``).

At decode a linear is a stream of its weights: a few rows multiply every weight once, and the step is as fast
as the weights can be read. oneDNN's bf16 inner product streams them well below what memory gives (docs/performance.md,
"Small-batch linears"). This kernel is built to stream them at the bandwidth:

- the weight is packed once into the order the loop reads it: 64 output columns at a time, for each pair of
  input features the 64 columns' two weights side by side (``[N / 64][K / 2][64][2]``), so each step of the
  loop loads four 64-byte vectors in a row and each block's bytes are read front to back;
- AVX512-BF16's ``vdpbf16ps`` multiplies a pair of bf16 inputs by a pair of bf16 weights for 16 columns at once
  and adds both products to fp32 accumulators: up to 6 rows x 64 columns of accumulators stay in registers for
  a whole block, the output is rounded to bf16 once (as ``F.linear`` in bf16 rounds its fp32 sum);
- both cores split the 64-column blocks; a block's weights (a few hundred KB at most) stay in L2 while
  the rows pass over it 6 at a time.

Above ``SMALL_BATCH_MAX_ROWS`` rows (prefill) the product is compute-bound and oneDNN's blocked GEMM is the
better kernel, so the layer keeps it (``PackedLinear``) and calls it there. The kernel needs AVX512-BF16 (and
an even input width); where the build or the CPU lacks it, the layer stays oneDNN's after one log line.
Against ``F.linear`` in bf16 (``tests/model/test_bf16_linear.py``): within one bf16 rounding of the output.

``small_linear_int8`` is the same walk over int8 codes with a scale per group of input features (the ``int8``
quantisation mode, ``kvlab.model.quant``): each code times its scale is rounded to bf16 (exactly the dequantised
weight of the dense path) in registers as the walk reads it, up to two passes of 6 rows, or once per block into a
scratch the passes then read, from 13 rows.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import TypeGuard

import torch
from torch import nn

from kvlab import native
from kvlab.model.packed import PackedLinear, Rows, small_or_large
from kvlab.model.twin import remembered_twin

log = logging.getLogger(__name__)

# Rows up to which the kernel runs; above, oneDNN's GEMM (the crossover: docs/performance.md "Small-batch linears").
SMALL_BATCH_MAX_ROWS = 64
BLOCK_COLUMNS = 64  # output columns per packed block: four 16-lane fp32 accumulators per row


@functools.cache
def small_linear_ops() -> ModuleType | None:
    """The compiled op, or None (after one log line) where it cannot be built or this CPU lacks AVX512-BF16."""
    module = native.build(
        "kvlab_bf16_linear",
        native.source("bf16_linear.cpp"),
        ["small_linear", "small_linear_int8", "has_bf16_dot"],
        "bf16 small-batch linear",
    )
    if module is not None and not module.has_bf16_dot():
        log.warning("bf16 small-batch linear unavailable (this CPU has no AVX512-BF16); using oneDNN's")
        return None
    return module


def _column_blocks(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` [N, R, *S] in ``dtype``, zero-padded to whole blocks of 64 output columns and blocked as
    ``[ceil(N / 64), R, 64, *S]``: the order the kernels walk a block in."""
    n, *rest = rows.shape
    blocks = -(-n // BLOCK_COLUMNS)
    padded = torch.zeros(blocks * BLOCK_COLUMNS, *rest, dtype=dtype)
    padded[:n] = rows.detach().to(dtype)
    return padded.view(blocks, BLOCK_COLUMNS, *rest).transpose(1, 2).contiguous()


def unblock(blocked: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of the packing: ``[N / 64, R, 64, *S]`` back to the first ``n`` rows, ``[N, R * prod(S)]``."""
    return blocked.transpose(1, 2).reshape(blocked.shape[0] * BLOCK_COLUMNS, -1)[:n]


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight`` [N, K] (K even) in the kernel's order ``[ceil(N / 64), K / 2, 64, 2]``, zero-padded columns,
    in ``dtype`` (bf16 weights, or int8 codes for ``small_linear_int8``)."""
    n, k = weight.shape
    return _column_blocks(weight.reshape(n, k // 2, 2), dtype)


def pack_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """Group scales [N, K / G] in ``small_linear_int8``'s order ``[ceil(N / 64), K / G, 64]``, fp32, zero-padded."""
    return _column_blocks(scale, torch.float32)


class SmallBatchLinear(PackedLinear):
    """A ``PackedLinear`` in bf16 whose products of up to ``SMALL_BATCH_MAX_ROWS`` rows run on the kernel."""

    small_packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_BATCH_MAX_ROWS and x.dtype == torch.bfloat16:
            ops = small_linear_ops()
            assert ops is not None  # small_batch_model only installs this class where the op was built
            return native.call_labelled(
                "kvlab::small_linear", ops.small_linear, x, self.small_packed, self.out_features
            )
        return super().forward(x)

    def kernel_call(self) -> Rows:
        """``forward`` for rows that are always 2-D (``kvlab.model.fused``'s layer loop): the kernel up to
        ``SMALL_BATCH_MAX_ROWS`` bf16 rows, oneDNN's packed product above, without the module call or the label."""
        ops = small_linear_ops()
        assert ops is not None
        small, small_packed, n = ops.small_linear, self.small_packed, self.out_features
        return small_or_large(
            lambda x: small(x, small_packed, n), SMALL_BATCH_MAX_ROWS, torch.bfloat16, super().kernel_call()
        )


def _qualifies(module: nn.Module) -> TypeGuard[PackedLinear]:
    return type(module) is PackedLinear and module.weight.dtype == torch.bfloat16 and module.in_features % 2 == 0


def small_batch_model(model: nn.Module) -> nn.Module:
    """A twin of ``model`` (sharing every tensor, remembered) whose bf16 ``PackedLinear`` layers run small batches
    on the kernel; ``model`` itself where none qualifies or the kernel cannot be built here."""
    if not any(_qualifies(m) for m in model.modules()) or small_linear_ops() is None:
        return model

    def swap(twin: nn.Module) -> None:
        for m in twin.modules():
            if _qualifies(m):
                m.small_packed = pack_weight(m.weight)
                m.__class__ = SmallBatchLinear

    return remembered_twin(model, "small-batch", (), swap)
