"""A Llama-family decoder over a flat batch of tokens.

Tokens of all requests in a step are concatenated ([T] ids, [T] positions), as in vLLM's varlen
batches; the attention backend knows the request boundaries. Module names follow Hugging Face's
``LlamaForCausalLM`` so that checkpoints map onto them one to one (q/k/v and gate/up are fused here,
and the loaders concatenate them).
"""

from __future__ import annotations

import torch
from torch import nn

from kvlab.config import ModelConfig
from kvlab.model.attention_api import AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One call instead of six from Python (pow, mean, add, rsqrt, mul, mul; on CPU torch still runs them
        # as separate kernels): the decode step normalises 61 times. In fp32 it is bit-identical to that
        # formula (checked in tests/test_foundation.py).
        if x.dtype != torch.float32:
            # Normalise in fp32 like the reference implementations, so low-precision runs match them.
            normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
            return self.weight * normed.to(x.dtype)
        return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream with ``delta`` added (when given), and its normalised form: one seam that a fused
        kernel can take over (``kvlab.model.fused``)."""
        if delta is not None:
            h = h + delta
        return h, self(h)


class RotaryEmbedding(nn.Module):
    """RoPE with the rotate-half convention of Hugging Face Llama checkpoints."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend, layer: int
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k = self.rope(qkv, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = attn(layer, q, k, v)
        return self.o_proj(out.reshape(t, self.q_size))

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated Q [T, H, D] and K [T, Hkv, D] of the fused projection's output."""
        t = qkv.shape[0]
        # Q and K heads side by side take one rotation instead of two.
        qk = apply_rope(
            qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` is the residual stream before the previous layer's MLP output ``delta`` is added; returns the
        stream and this layer's MLP output, so that each add meets the norm that follows it (the pairs a fused
        kernel takes in one pass). The arithmetic is the textbook ``h + attn(norm(h))``, ``h + mlp(norm(h))``."""
        h, x = self.input_layernorm.add_norm(h, delta)
        h, x = self.post_attention_layernorm.add_norm(h, self.self_attn(x, cos, sin, attn, layer))
        return h, self.mlp(x)


class LlamaModel(nn.Module):
    """Decoder + LM head. ``forward`` returns final hidden states; ``compute_logits`` projects them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cos, sin, attn, i)
        return self.norm.add_norm(h, delta)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
