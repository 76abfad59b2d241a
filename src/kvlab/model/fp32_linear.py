"""A compiled fp32 linear for the few rows of a decode step on an AVX2 CPU (opt-in, with the ``cpp`` kernels; the
C++ is ``csrc/fp32_linear.cpp``).

At decode a linear is a stream of its weights. On an AVX2-only CPU oneDNN's fp32 inner product streams them well
below what memory gives at 1 to 16 rows (docs/performance.md, "The fp32 small-batch linear"). The kernel reads the
weight where the model keeps it, ``[N, K]`` row-major: four output columns are four contiguous weight rows, walked
side by side in 8-lane vectors, with three input rows' fp32 accumulators for them in registers (AVX2 + FMA), then
each accumulator's lanes summed. No packed copy: the layer's memory does not grow. Input widths that are not a
multiple of 8 and output widths not of 4 stay oneDNN's (every SmolLM2 linear is both; the minis' LM head, 259
columns, is not).

Its sums run in another order than oneDNN's and MKL's (8 lanes, then across them): outputs differ from
``F.linear`` by a few ulps, within the tolerance ``tests/model/test_fp32_linear.py`` states (1e-5 of the sum of
the products' magnitudes).

Above ``SMALL_BATCH_MAX_ROWS`` rows oneDNN's blocked GEMM is the better kernel, and the layer keeps it
(``PackedLinear``). Where the build or the CPU lacks AVX2 + FMA the layer stays oneDNN's after one log line; on a
CPU with AVX-512 too, where oneDNN runs its AVX-512 kernels and is faster from 4 rows on (measured), likewise.
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

# Rows up to which the kernel runs; above, oneDNN's GEMM (the crossover: docs/performance.md).
SMALL_BATCH_MAX_ROWS = 16
# The kernel's blocks: input features in 8-lane vectors, output columns four at a time (no tails: a layer of
# another width stays oneDNN's).
LANES = 8
COLUMNS = 4


@functools.cache
def small_linear_fp32_ops() -> ModuleType | None:
    """The compiled op, or None (after one log line) where it cannot be built, this CPU lacks AVX2 + FMA, or it has
    AVX-512 (oneDNN's own kernels are faster there from 4 rows on: docs/performance.md)."""
    if "avx512f" in native.cpu_flags().split():
        log.warning("fp32 small-batch linear left to oneDNN: this CPU has AVX-512, where oneDNN's kernels are faster")
        return None
    module = native.build(
        "kvlab_fp32_linear",
        native.source("fp32_linear.cpp"),
        ["small_linear_fp32", "has_avx2_fma"],
        "fp32 small-batch linear",
    )
    if module is not None and not module.has_avx2_fma():
        log.warning("fp32 small-batch linear unavailable (this CPU has no AVX2 and FMA); using oneDNN's")
        return None
    return module


class SmallBatchFp32Linear(PackedLinear):
    """A ``PackedLinear`` in fp32 whose products of up to ``SMALL_BATCH_MAX_ROWS`` rows run on the kernel, over the
    layer's own weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_BATCH_MAX_ROWS and x.dtype == torch.float32:
            ops = small_linear_fp32_ops()
            assert ops is not None  # small_batch_fp32_model only installs this class where the op was built
            return native.call_labelled("kvlab::small_linear_fp32", ops.small_linear_fp32, x, self.weight)
        return super().forward(x)

    def kernel_call(self) -> Rows:
        """``forward`` for rows that are always 2-D (``kvlab.model.fused``'s layer loop): the kernel up to
        ``SMALL_BATCH_MAX_ROWS`` fp32 rows, oneDNN's packed product above, without the module call or the label."""
        ops = small_linear_fp32_ops()
        assert ops is not None
        small, weight = ops.small_linear_fp32, self.weight
        return small_or_large(lambda x: small(x, weight), SMALL_BATCH_MAX_ROWS, torch.float32, super().kernel_call())


def _qualifies(module: nn.Module) -> TypeGuard[PackedLinear]:
    return (
        type(module) is PackedLinear
        and module.weight.dtype == torch.float32
        and module.weight.is_contiguous()
        and module.in_features % LANES == 0
        and module.out_features % COLUMNS == 0
    )


def small_batch_fp32_model(model: nn.Module) -> nn.Module:
    """A twin of ``model`` (sharing every tensor, remembered) whose fp32 ``PackedLinear`` layers run small batches
    on the kernel; ``model`` itself where none qualifies or the kernel is not used here."""
    if not any(_qualifies(m) for m in model.modules()) or small_linear_fp32_ops() is None:
        return model

    def swap(twin: nn.Module) -> None:
        for m in twin.modules():
            if _qualifies(m):
                m.__class__ = SmallBatchFp32Linear

    return remembered_twin(model, "small-batch-fp32", (), swap)
