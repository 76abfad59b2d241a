"""Load a local Hugging Face Llama-family directory: config.json, *.safetensors, tokenizer.json.

Only local files are read (no hub, no ``trust_remote_code``, no pickled ``.bin`` weights). The config
is checked against what kvlab's decoder computes; anything it would silently compute differently
(biases, RoPE scaling, sliding windows, quantized weights) is refused with the field that says so.

The files are read with ``safetensors`` and ``tokenizers`` rather than transformers' ``AutoConfig`` /
``AutoTokenizer``: measured here, ``import transformers`` plus a first ``AutoConfig.from_pretrained``
take ~2 s, against ~0.1 s for this whole load of a small directory (the tests check both agree).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvlab.config import ConfigError, ModelConfig
from kvlab.model.llama import LlamaModel
from kvlab.model.weights import INSTALL_HINT, ModelLoadError, build_model
from kvlab.tokenizer import HFTokenizer

# SmolLM/SmolLM2, TinyLlama, Llama 1/2, Mistral 7B v0.2+ (sliding_window null) all say one of these.
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
_SUPPORTED_ROPE_TYPES = ("default",)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object, got {type(data).__name__}")
    return data


def _rope_settings(hf: dict[str, Any], where: Path) -> float:
    """rope_theta, refusing scaled RoPE. transformers 4 writes ``rope_theta`` + ``rope_scaling``,
    transformers 5 a ``rope_parameters`` dict holding both."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for source in (params, scaling):
        if not isinstance(source, dict):
            raise ModelLoadError(f"{where}: rope settings {source!r} are not a JSON object")
        rope_type = source.get("rope_type", source.get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"{where}: RoPE scaling {rope_type!r} ({source}) is not supported; kvlab implements plain "
                f"RoPE (supported rope_type: {', '.join(_SUPPORTED_ROPE_TYPES)})"
            )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(
            f"{where}: partial_rotary_factor={hf['partial_rotary_factor']} is not supported; kvlab "
            "rotates the whole head"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def hf_model_config(hf: dict[str, Any], where: Path) -> ModelConfig:
    """A ``ModelConfig`` from an HF ``config.json`` dict, or a ``ModelLoadError`` naming what does not fit."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = hf.get("architectures")
        raise ModelLoadError(
            f"{where}: model_type {model_type!r} (architectures {archs}) is not supported; kvlab loads "
            f"Llama-family decoders (supported model_type: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    refusals = {
        "quantization_config": "quantized checkpoints are not supported; use fp32/fp16/bf16 safetensors",
        "attention_bias": "attention biases are not supported; kvlab's Llama attention has none",
        "mlp_bias": "MLP biases are not supported; kvlab's Llama MLP has none",
        "sliding_window": "sliding-window attention is not supported; kvlab attends to the full context",
    }
    for key, why in refusals.items():
        if hf.get(key):
            raise ModelLoadError(f"{where}: {key}={hf[key]!r}: {why}")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{where}: hidden_act={act!r} is not supported; kvlab's MLP is SwiGLU (silu)")
    rope_theta = _rope_settings(hf, where)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in hf:
            raise ModelLoadError(f"{where}: config.json has no {key!r}, which kvlab needs to build the model")
    heads = hf["num_attention_heads"]
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            # Mistral-style configs may state a head_dim that is not hidden_size / heads.
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # LlamaConfig's default
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except ConfigError as e:
        raise ModelLoadError(f"{where}: invalid model config: {e}") from e


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} lists shards that are missing: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
    if pickles:
        raise ModelLoadError(
            f"{path} has only pickled weights ({', '.join(pickles[:3])}); kvlab reads safetensors only "
            "(unpickling can run code). Convert once with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"{path} has no *.safetensors weights")


def _hf_checkpoint(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in ``dtype``, named as build_model takes them (no ``model.`` prefix)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ModelLoadError(f"loading {path} needs the 'safetensors' package; {INSTALL_HINT}") from None
    checkpoint: dict[str, torch.Tensor] = {}
    for file in _safetensor_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = key.removeprefix("model.")
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from rope_theta; old checkpoints store it
                if name.endswith(".bias"):
                    raise ModelLoadError(
                        f"{file}: {key} is a bias; kvlab's Llama decoder has no biases (config.json did not "
                        "say attention_bias/mlp_bias, but the weights have them)"
                    )
                checkpoint[name] = f.get_tensor(key).to(dtype)
    if cfg.tie_word_embeddings:
        # transformers ties the head to the embedding whatever the file holds; do the same.
        checkpoint.pop("lm_head.weight", None)
    return checkpoint


def _special(cfg: dict[str, Any], key: str) -> str | None:
    value = cfg.get(key)
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, tok_cfg: dict[str, Any]) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")  # transformers >= 4.47 layout
    if template is None and (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def hf_tokenizer(path: Path, hf: dict[str, Any], model_vocab_size: int) -> HFTokenizer:
    """The tokenizer of an HF directory, from tokenizer.json and tokenizer_config.json."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ModelLoadError(f"loading {path} needs the 'tokenizers' package; {INSTALL_HINT}") from None
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        hint = ""
        if (path / "tokenizer.model").is_file():
            hint = (
                " (only a SentencePiece tokenizer.model: convert it once with transformers, "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
            )
        raise ModelLoadError(f"{path} has no tokenizer.json{hint}")
    try:
        backend = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises plain Exception subclasses for malformed files
        raise ModelLoadError(f"{tok_file} could not be read by tokenizers: {e}") from None
    tok_cfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}

    def token_for(name: str) -> str | None:
        token = _special(tok_cfg, name)
        config_id = hf.get(f"{name}_id")
        if token is None and isinstance(config_id, int):
            token = backend.id_to_token(config_id)
        return token

    gen_cfg = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    stops = gen_cfg.get("eos_token_id", hf.get("eos_token_id"))
    stops = [stops] if isinstance(stops, int) else [s for s in (stops or []) if isinstance(s, int)]
    try:
        return HFTokenizer(
            backend,
            chat_template=_chat_template(path, tok_cfg),
            bos_token=token_for("bos_token"),
            eos_token=token_for("eos_token"),
            unk_token=_special(tok_cfg, "unk_token"),
            pad_token=_special(tok_cfg, "pad_token"),
            # tokenizer.json's post-processor decides whether BOS/EOS are added; transformers 5 ignores
            # add_bos_token/add_eos_token in tokenizer_config.json too (the tests hold us to it).
            add_bos_token=None,
            add_eos_token=None,
            extra_stop_token_ids=stops,
            model_vocab_size=model_vocab_size,
        )
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def load_tokenizer(spec: str, model_vocab_size: int) -> HFTokenizer:
    """Another tokenizer for a model (vLLM's ``tokenizer=``): a local directory with tokenizer.json, read as
    the model's own would be; a hub name is refused, since nothing here downloads."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"tokenizer {spec!r} is not a local directory with tokenizer.json (kvlab never downloads from a hub)"
        )
    hf = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    return hf_tokenizer(path, hf, model_vocab_size)


def load_hf_dir(path: Path | str, dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, HFTokenizer]:
    """Load a local HF Llama-family directory into kvlab's decoder, with its tokenizer and chat template."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{path} has no config.json; a Hugging Face model directory needs config.json, *.safetensors "
            "and tokenizer.json"
        )
    hf = _read_json(config_file)
    cfg = hf_model_config(hf, config_file)
    tokenizer = hf_tokenizer(path, hf, cfg.vocab_size)
    return build_model(cfg, _hf_checkpoint(path, cfg, dtype), path, dtype), tokenizer
