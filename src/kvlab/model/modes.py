"""The model an engine runs in a mode (``kvlab.config.ModeConfig``): the loaded model's twins, stacked.

In order: weight-only quantised linears (``quant``), then oneDNN-prepacked copies of the linears a mode leaves
dense (``packed``), then, with the compiled kernels, the fused norms, RoPE and SiLU (``fused``) and the small-batch
linear kernel under the packed linears (``bf16_linear`` in bf16; ``fp32_linear`` in fp32 on an AVX2 CPU). Each twin
shares every tensor with the one below it and is remembered (``twin``), so engines built one after another in the
same mode share one model. The loaded model itself is never changed: the dense reference keeps the plain kernels.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from kvlab.config import ModeConfig
from kvlab.model.bf16_linear import small_batch_model
from kvlab.model.fp32_linear import small_batch_fp32_model
from kvlab.model.fused import fused_model
from kvlab.model.llama import LlamaModel
from kvlab.model.loader import LoadedModel
from kvlab.model.packed import packed_model
from kvlab.model.quant import quantized_model


def engine_model(loaded: LoadedModel, mode: ModeConfig) -> LlamaModel:
    """The model an engine runs ``loaded`` with in ``mode``; ``loaded.model`` itself in the reference mode of a
    model too small to gain from packing (the mini models)."""
    model: nn.Module = loaded.model if mode.quantization is None else quantized_model(loaded, mode.quantization)
    model = packed_model(model, mode.packed_weights)
    if mode.compiled_kernels:
        # The compiled kernels come as a set: with the in-place paged attention, the fused norms, RoPE, SiLU.
        model = small_batch_fp32_model(small_batch_model(fused_model(model)))
    return cast(LlamaModel, model)  # every twin keeps the class of the model it copies
