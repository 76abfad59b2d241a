"""A GGUF's model: the ``ModelConfig`` its metadata describes (refusing what kvlab's decoder would
compute wrongly), llama.cpp's tensor names mapped to the ones ``build_model`` takes, and the weights
dequantised.

The config is read here rather than through transformers' ``GGUF_CONFIG_MAPPING``: that is a dozen key
renames behind an ``import transformers``, and kvlab must refuse more than it maps (scaled RoPE,
experts, sliding windows...).
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.config import ConfigError, ModelConfig
from kvlab.model.gguf.reader import GGUFFile, GGUFTensorInfo
from kvlab.model.weights import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama",)


def dequantize_tensor(buf: mmap.mmap, info: GGUFTensorInfo, path: Path) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    qtype = GGMLQuantizationType(info.ggml_type)
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    try:
        values = dequantize(raw.reshape(quant_shape_to_byte_shape(info.shape, qtype)), qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {info.name} is stored as {qtype.name}, which gguf.quants cannot dequantize"
        ) from None
    except ValueError as e:  # a row that is not a whole number of quantization blocks
        raise ModelLoadError(f"{path}: tensor {info.name}: {e}") from None
    if np.may_share_memory(values, raw):
        # F32 comes back as a view of the mapped file: copy so that nothing outlives the mapping.
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(info.shape)


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``convert_hf_to_gguf.LlamaModel.permute`` of the Q/K projection rows.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3)... while HF Llama checkpoints rotate
    halves (x_i, x_{i+d/2}); the converter reorders each head's rows from halves to pairs. We undo it
    like transformers' GGUF loader (``LlamaTensorProcessor._reverse_permute_weights``) so that
    kvlab's rotate-half RoPE sees the original row order.
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _meta(md: dict[str, Any], key: str, path: Path, default: Any = None, required: bool = False) -> Any:
    if key in md:
        return md[key]
    if required:
        raise ModelLoadError(f"{path}: GGUF metadata has no {key!r}, which kvlab needs to build the model")
    return default


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """Build a ``ModelConfig`` from the metadata, refusing anything kvlab's decoder would compute wrongly."""
    md, path = gguf.metadata, gguf.path
    arch = _meta(md, "general.architecture", path, required=True)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; kvlab runs Llama-family decoders "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if _meta(md, f"{arch}.expert_count", path, 0):
        raise ModelLoadError(
            f"{path}: {arch}.expert_count={md[f'{arch}.expert_count']} (mixture of experts) is not supported; "
            "kvlab runs dense Llama-family decoders"
        )
    scaling = _meta(md, f"{arch}.rope.scaling.type", path, "none")
    if scaling not in ("none", ""):
        factor = _meta(md, f"{arch}.rope.scaling.factor", path)
        raise ModelLoadError(
            f"{path}: rope scaling {scaling!r} (factor {factor}) is not supported; kvlab implements plain "
            "RoPE only (supported: none)"
        )
    if "rope_freqs.weight" in gguf.tensors:
        raise ModelLoadError(
            f"{path}: the file has a rope_freqs.weight tensor (Llama-3.1-style frequency scaling), which is "
            "not supported; kvlab implements plain RoPE only"
        )
    if _meta(md, f"{arch}.attention.sliding_window", path):
        raise ModelLoadError(f"{path}: sliding-window attention is not supported; kvlab attends to the full context")

    hidden = _meta(md, f"{arch}.embedding_length", path, required=True)
    heads = _meta(md, f"{arch}.attention.head_count", path, required=True)
    kv_heads = _meta(md, f"{arch}.attention.head_count_kv", path, heads)
    if isinstance(kv_heads, list) or isinstance(heads, list):
        raise ModelLoadError(f"{path}: per-layer head counts are not supported; kvlab needs one value for all layers")
    head_dim = _meta(md, f"{arch}.attention.key_length", path, hidden // heads)
    value_dim = _meta(md, f"{arch}.attention.value_length", path, head_dim)
    rope_dim = _meta(md, f"{arch}.rope.dimension_count", path, head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ModelLoadError(
            f"{path}: key_length={head_dim}, value_length={value_dim}, rope.dimension_count={rope_dim}; "
            "kvlab needs all three equal (no partial rotary, same K and V head size)"
        )
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor; this is not a complete Llama GGUF")
    vocab = _meta(md, f"{arch}.vocab_size", path, embed.shape[0])
    if vocab != embed.shape[0]:
        raise ModelLoadError(f"{path}: {arch}.vocab_size={vocab} but token_embd.weight has {embed.shape[0]} rows")
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            num_layers=int(_meta(md, f"{arch}.block_count", path, required=True)),
            num_heads=int(heads),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate_size=int(_meta(md, f"{arch}.feed_forward_length", path, required=True)),
            rope_theta=float(_meta(md, f"{arch}.rope.freq_base", path, 10000.0)),
            rms_norm_eps=float(_meta(md, f"{arch}.attention.layer_norm_rms_epsilon", path, required=True)),
            max_position_embeddings=int(_meta(md, f"{arch}.context_length", path, 2048)),
            # llama.cpp's converter writes no output.weight when the head is tied to the embedding.
            tie_word_embeddings="output.weight" not in gguf.tensors,
        )
    except ConfigError as e:
        raise ModelLoadError(f"{path}: the GGUF metadata gives an invalid model config: {e}") from e


# llama.cpp's tensor names (gguf.md, "Standardized tensor names") -> the Hugging Face names build_model takes.
_TENSOR_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def checkpoint_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> the name build_model takes, for every tensor a file for ``cfg`` must hold."""
    names = {f"{g}.weight": f"{h}.weight" for g, h in _TENSOR_NAMES.items()}
    if cfg.tie_word_embeddings:
        del names["output.weight"]  # llama.cpp's converter writes no output.weight for a tied head
    for i in range(cfg.num_layers):
        names |= {f"blk.{i}.{g}.weight": f"layers.{i}.{h}.weight" for g, h in _LAYER_TENSOR_NAMES.items()}
    return names


def gguf_checkpoint(gguf: GGUFFile, buf: mmap.mmap, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    path = gguf.path
    biases = sorted(n for n in gguf.tensors if n.endswith(".bias"))
    if biases:
        raise ModelLoadError(
            f"{path}: the file has bias tensors ({', '.join(biases[:4])}{'...' if len(biases) > 4 else ''}); "
            "kvlab's Llama decoder has no attention or MLP biases"
        )
    names = checkpoint_names(cfg)
    unknown = sorted(set(gguf.tensors) - set(names))
    missing = sorted(set(names) - set(gguf.tensors))
    if unknown or missing:
        raise ModelLoadError(
            f"{path}: tensors do not match a {cfg.num_layers}-layer Llama decoder; "
            f"unexpected: {unknown[:6]}, missing: {missing[:6]}"
        )
    rope_heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    checkpoint: dict[str, torch.Tensor] = {}
    for gguf_name, name in names.items():
        w = dequantize_tensor(buf, gguf.tensors[gguf_name], path)
        heads = rope_heads.get(gguf_name.split(".")[-2])
        if heads is not None:
            w = unpermute_rope_rows(w, heads)
        # Cast tensor by tensor: holding the whole model in fp32 first would double the peak memory.
        checkpoint[name] = w.to(dtype)
    return checkpoint
