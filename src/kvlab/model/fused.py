"""Fused CPU ops for the decoder's elementwise work: residual add + RMSNorm, RoPE, SiLU * up (opt-in; the C++
is ``csrc/fused.cpp``).

Between its linears a decode step runs many small ops on a few rows: at 16 rows of SmolLM2 each RMSNorm,
RoPE or SiLU * up costs 15-25 us, mostly ATen's per-op dispatch and temporaries rather than arithmetic, and
bf16 adds a widening and a narrowing copy around each norm. Three C++ ops do each in one pass over the rows:

- ``add_rms_norm(h, delta, w, eps)``: ``h += delta`` in place, rounded to h's dtype as ``h + delta`` is, then
  returns ``rms_norm(h) * w``. In bf16 the normalised value is rounded to bf16 before the weight multiplies
  it, as the reference (normalise in fp32, round, multiply in bf16) does.
- ``rope_(qkv, cos, sin, heads)``: rotates the first ``heads`` heads of each row of the fused QKV output in
  place (rotate-half convention), in fp32, rounding once.
- ``silu_mul(gate_up)``: ``silu(gate) * up`` of the fused gate/up output, in fp32, rounding once (its exp is
  SLEEF's 2-ulp one, torch's silu takes the 1-ulp one).

and two for the sampler: ``argmax_rows(logits)``, ``torch.argmax(dim=-1)``'s indices for the greedy rows
(``compiled_argmax``): at 64 rows of a 49k vocabulary 0.31-0.44 ms against ATen's 0.92-1.03; ``topk_rows(logits,
m)``, ``torch.topk``'s values for the top_k rows' shortlists (``compiled_topk``).

Each loop runs on ATen's SIMD vectors (bf16 widened and rounded by the vector conversions, round to nearest
even like c10's). At 16 rows of SmolLM2, fp32 / bf16: add + RMSNorm 2.8 / 5.0 us against 15 / 23 us for ATen's
``rms_norm`` alone, RoPE 1.9 / 4.4 us against 20 / 23, SiLU * up 8.0 / 8.8 us against 19 / 24.

They are used by the engine's twin of a model when it runs the ``cpp`` kernels (``fused_model``), never by
the dense reference. That twin also runs its decoder layers as one loop (``FusedLlamaModel``): each layer's
norms, RoPE and SiLU * up straight on these ops and each linear on its bare compiled call where it has one
(``int8-w8a8``'s VNNI kernel, oneDNN's packed product, the small-batch kernels), with none of the per-layer module
calls, checks and wrappers in between, which cost a decode step more than its norms do (docs/performance.md, "The
decoder layers as one loop"). The loop gives the modules' bits; a profiler running, the modules run instead, so
that their labelled calls show.
Against the reference ops (``tests/model/test_fused.py``): fp32 within 1e-5 relative, bf16 within one bf16
rounding (the reference rounds after every op, these once).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch
from torch import nn

from kvlab import native
from kvlab.model.attention_api import AttentionBackend
from kvlab.model.llama import MLP, Attention, DecoderLayer, LlamaModel, RMSNorm
from kvlab.model.packed import Rows
from kvlab.model.twin import remembered_twin

FUSED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def fused_ops() -> ModuleType | None:
    """The compiled ops (built once per process, cached on disk), or None after one log line."""
    return native.build(
        "kvlab_fused",
        native.source("fused.cpp"),
        ["add_rms_norm", "rope_", "silu_mul", "argmax_rows", "topk_rows"],
        "fused CPU ops",
    )


def compiled_argmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``torch.argmax(logits, dim=-1)`` of fp32 logits ``[rows, n]`` on the compiled op (the same indices: the first
    maximum, a NaN counting as the largest), for the engine's greedy rows in the ``cpp`` mode; None where the ops
    are not built. ATen's argmax keeps an index beside the value at every step: ~1 ms of a 64-row step at a 49k
    vocabulary, several times the one pass for the maximum and one to find it that the op makes."""
    ops = fused_ops()
    return None if ops is None else cast(Callable[[torch.Tensor], torch.Tensor], ops.argmax_rows)


TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def compiled_topk() -> TopK | None:
    """``torch.topk(logits, m)`` of finite fp32 logits ``[rows, n]`` on the compiled op: the same values, in
    descending order, with an index of each (among equal values maybe others than topk's: the sampler reads an
    index set only where the m-th value is unique); None where the ops are not built. ATen's topk: ~1.3 ms for
    m = 2 over 64 rows of a 49k vocabulary, most of a sampled step's sampling."""
    ops = fused_ops()
    if ops is None:
        return None

    def topk(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = ops.topk_rows(logits, m)
        return values, indices

    return topk


class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():
            return super().forward(x)
        return self.add_norm(x, None)[1]  # without a delta, x is only read

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops()
        assert ops is not None  # fused_model only installs this class where the ops were built
        # h is the residual stream this forward owns: updated in place, as the reference rebinds it.
        return h, ops.add_rms_norm(h, delta, self.weight, self.eps)


class FusedAttention(Attention):
    def rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops()
        assert ops is not None
        t = qkv.shape[0]
        ops.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        return q, k


class FusedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A gate-up linear that gives silu(gate) * up from its own call (int8-w8a8's VNNI kernel, its gate and up
        # columns side by side): the [T, 2 x inter] product is then never written and read back.
        product = getattr(self.gate_up_proj, "silu_mul_product", None)
        act = product(x) if product is not None else None
        return self.down_proj(act) if act is not None else super().forward(x)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        ops = fused_ops()
        assert ops is not None
        return ops.silu_mul(gate_up)


def _bare(linear: nn.Module, name: str = "kernel_call") -> Rows | None:
    """The linear's bare compiled call (``kernel_call``, or ``W8A8Linear.silu_mul_call``), or None."""
    make = getattr(linear, name, None)
    return cast(Rows | None, make()) if make is not None else None


def _call(linear: nn.Module) -> Rows:
    """How the loop calls a linear: its bare call where it has one, else the module itself."""
    return _bare(linear) or linear


@dataclass(frozen=True)
class LayerCalls:
    """One decoder layer as ``FusedLlamaModel``'s loop calls it: its norms' weights and epsilons, and each linear's
    bare call where it has one, else the module itself (its forward, as the layer would call it)."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: Rows
    o: Rows
    act: Rows  # the gate-up product and silu(gate) * up of it
    down: Rows

    @classmethod
    def of(cls, layer: DecoderLayer, ops: ModuleType) -> LayerCalls:
        attn, mlp = layer.self_attn, layer.mlp
        act = _bare(mlp.gate_up_proj, "silu_mul_call")
        if act is None:
            gate_up = _call(mlp.gate_up_proj)
            act = lambda x: ops.silu_mul(gate_up(x))  # noqa: E731 -- FusedMLP's two ops
        return cls(
            input_norm=layer.input_layernorm.weight,
            input_eps=layer.input_layernorm.eps,
            post_norm=layer.post_attention_layernorm.weight,
            post_eps=layer.post_attention_layernorm.eps,
            qkv=_call(attn.qkv_proj),
            o=_call(attn.o_proj),
            act=act,
            down=_call(mlp.down_proj),
        )


# Each fused model's layers as its loop calls them, made at its first forward (a twin's modules are not swapped
# once it is built). Kept beside the model, not in it: a twin made of the model later must build its own (the calls
# hold the tensors of the model they were made of).
_LAYER_CALLS: weakref.WeakKeyDictionary[nn.Module, tuple[LayerCalls, ...]] = weakref.WeakKeyDictionary()


class FusedLlamaModel(LlamaModel):
    """The fused twin's model: its forward runs the decoder layers as one loop over the fused ops and the linears'
    bare calls (``LayerCalls``), call for call what the fused modules do; while a profiler records, the modules."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        ops = fused_ops()
        assert ops is not None
        if native.profiling():
            return super().forward(input_ids, positions, attn)
        layers = _LAYER_CALLS.get(self)
        if layers is None:
            layers = _LAYER_CALLS[self] = tuple(LayerCalls.of(cast(DecoderLayer, layer), ops) for layer in self.layers)
        cfg = self.config
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * d, kv_heads * d
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        t = h.shape[0]
        delta: torch.Tensor | None = None
        # DecoderLayer.forward with FusedRMSNorm, FusedAttention and FusedMLP, call for call.
        for i, layer in enumerate(layers):
            qkv = layer.qkv(ops.add_rms_norm(h, delta, layer.input_norm, layer.input_eps))
            ops.rope_(qkv, cos, sin, heads + kv_heads, d)
            q = qkv[:, :q_size].view(t, heads, d)
            k = qkv[:, q_size : q_size + kv_size].view(t, kv_heads, d)
            v = qkv[:, q_size + kv_size :].view(t, kv_heads, d)
            out = layer.o(attn(i, q, k, v).reshape(t, q_size))
            delta = layer.down(layer.act(ops.add_rms_norm(h, out, layer.post_norm, layer.post_eps)))
        return cast(torch.Tensor, ops.add_rms_norm(h, delta, self.norm.weight, self.norm.eps))


_FUSED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: FusedRMSNorm,
    Attention: FusedAttention,
    MLP: FusedMLP,
    LlamaModel: FusedLlamaModel,
}


def fused_model(model: nn.Module) -> nn.Module:
    """A twin of ``model`` (``kvlab.model.twin``: sharing every tensor, packed weights included, remembered) whose
    norms, RoPE and SiLU * up run on the fused ops; ``model`` itself where they do not apply (a dtype other than
    fp32/bf16, or no compiler: one log line then)."""
    if not isinstance(model, LlamaModel) or model.dtype not in FUSED_DTYPES or fused_ops() is None:
        return model

    def swap(twin: nn.Module) -> None:
        for m in twin.modules():
            fused = _FUSED_CLASSES.get(type(m))
            if fused is not None:
                m.__class__ = fused

    return remembered_twin(model, "fused", (), swap)
