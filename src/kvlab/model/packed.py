"""Linear layers with weights prepacked for oneDNN: the engine's fast path on CPU.

At the batch sizes of decoding (1 to 64 rows) ``torch.nn.functional.linear`` goes through MKL's
general sgemm, which re-reads and re-blocks the whole weight on every call: at 16 rows SmolLM2's
LM head (49152 x 576) takes ~40 ms. oneDNN's inner-product primitive with a weight reordered once
into its blocked layout does the same product in ~14 ms (`kvlab bench linear` measures it). This is
the path ``torch.compile`` takes for CPU linears with dynamic batch sizes (inductor's weight-prepack
pass calls the same two ops); here it is applied directly, without compiling anything.

The packed copy is made once, when the engine is built; the dense reference and everything else keep
using the model's own ``nn.Linear`` layers, so the oracle stays independent of this kernel choice.
Summation order differs from MKL's: outputs differ from ``F.linear`` by a few ulps (~5e-6 absolute on
SmolLM2's activations), well inside the tolerances the tests state.

bf16 weights are packed the same way where oneDNN has bf16 kernels for this CPU (AVX512-BF16 or AMX):
the product accumulates in fp32 and rounds the output to bf16 once, as ``F.linear`` in bf16 does; the two
differ by at most one bf16 rounding of the output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeGuard, cast

import torch
from torch import nn

from kvlab.config import ConfigError
from kvlab.model.twin import remembered_twin

# Below this many weights a linear stays on F.linear: oneDNN's per-call overhead (~40 µs here) outweighs
# what packing saves on a matrix that fits in L2 (the mini model's largest is 128 x 768). SmolLM2's
# smallest projection, 576 x 576, is above it and gains from 16 rows on.
PACK_MIN_WEIGHTS = 1 << 18

# Row count the weights are packed for. oneDNN accepts any row count afterwards; the hint only picks
# the blocking, and 16 (a typical decode batch) was the best of 1/16/64/128 for 1 to 300 rows here.
PACK_ROWS_HINT = 16


def packing_available() -> bool:
    """oneDNN (mkldnn) inner product with prepacked weights is usable in this torch build."""
    return (
        torch.backends.mkldnn.is_available()
        and bool(torch.backends.mkldnn.enabled)
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """A bias-free ``nn.Linear`` whose product runs on a oneDNN-blocked copy of its weight.

    ``weight`` is the original parameter (shared, not copied), so ``state_dict`` names do not change.
    """

    weight: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("PackedLinear packs bias-free linears only (Llama projections have no bias)")
        self.weight = linear.weight
        self.in_features: int = linear.in_features
        self.out_features: int = linear.out_features
        self.packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS_HINT)

    def weight_nbytes(self) -> int:
        """Bytes of the weight as a product streams it: the packed copy."""
        return self.packed.numel() * self.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return _product(x, self.packed)

    def kernel_call(self) -> Rows:
        """``forward`` for rows that are always 2-D (``kvlab.model.fused``'s layer loop), without the module call."""
        packed = self.packed
        return lambda x: _product(x, packed)


def _product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [T, K] times a oneDNN-packed weight."""
    return cast(torch.Tensor, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))


Rows = Callable[[torch.Tensor], torch.Tensor]  # a linear's bare call: rows [T, K] -> [T, N]


def small_or_large(small: Rows, max_rows: int, dtype: torch.dtype, large: Rows) -> Rows:
    """A bare call that takes ``small`` for up to ``max_rows`` rows in ``dtype`` and ``large`` for the rest: a
    small-batch layer's ``forward`` over rows that are always 2-D."""

    def call(x: torch.Tensor) -> torch.Tensor:
        return small(x) if x.shape[0] <= max_rows and x.dtype == dtype else large(x)

    return call


def packable_dtype(dtype: torch.dtype) -> bool:
    """fp32 always; bf16 where oneDNN runs it natively on this CPU."""
    if dtype == torch.bfloat16:
        return _native_bf16()
    return dtype == torch.float32


@functools.cache
def _native_bf16() -> bool:
    # The CPU's answer, asked once: the weight-only quantised linears ask at every dense product.
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packable(model: nn.Module, min_weights: int = 0) -> bool:
    """CPU fp32 (or natively supported bf16) weights, a torch build with oneDNN, and a linear with at least
    ``min_weights`` weights."""
    p = next(model.parameters())
    return (
        packing_available()
        and p.device.type == "cpu"
        and packable_dtype(p.dtype)
        and any(_qualifies(m, min_weights) for m in model.modules())
    )


def _qualifies(module: nn.Module, min_weights: int) -> TypeGuard[nn.Linear]:
    return type(module) is nn.Linear and module.bias is None and module.weight.numel() >= min_weights


def packed_model(model: nn.Module, packed_weights: bool | None) -> nn.Module:
    """``model`` with prepacked linears, as ``ModeConfig.packed_weights`` asks (``kvlab.model.modes.engine_model``
    stacks it): ``True`` packs every linear, ``None`` those large enough to gain (none of the mini model's),
    ``False`` none; the given model itself is never changed."""
    if packed_weights is False:
        return model
    if packed_weights and not packable(model):
        raise ConfigError(
            "packed_weights=True needs CPU fp32 weights (or bf16 on a CPU with native bf16) and a torch build "
            "with oneDNN (mkldnn)"
        )
    min_weights = 0 if packed_weights else PACK_MIN_WEIGHTS
    return with_packed_linears(model, min_weights) if packable(model, min_weights) else model


def with_packed_linears(model: nn.Module, min_weights: int = 0) -> nn.Module:
    """A twin of ``model`` (``kvlab.model.twin``: sharing every tensor, remembered) whose bias-free
    ``nn.Linear`` layers with at least ``min_weights`` weights are ``PackedLinear``. The original is not
    modified."""

    def swap(twin: nn.Module) -> None:
        for parent in twin.modules():
            for name, child in list(parent.named_children()):
                if _qualifies(child, min_weights):
                    setattr(parent, name, PackedLinear(child))

    return remembered_twin(model, "packed", (min_weights,), swap)
