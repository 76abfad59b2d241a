"""The peers kvlab is measured against: their names, which of them can run here (``plan_peers``, checked
before any model loads), and the Hugging Face transformers model of the same weights the HF peers run.
Importing this module imports neither torch nor transformers (the CLI lists ``PEERS`` in its --help)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvlab.config import ModelConfig
    from kvlab.model.llama import LlamaModel
    from kvlab.model.loader import LoadedModel

PEERS = (
    "hf-generate",
    "hf-generate-bf16",
    "hf-generate-batch",
    "llama.cpp",
    "vllm",
    "vllm-bf16",
    "vllm-w8a8",
    "vllm-w8a8-bf16",
    "vllm-kv-fp8",
    "vllm-bf16-kv-fp8",
    "vllm-w8a8-bf16-kv-fp8",
)
HF_PEERS = frozenset({"hf-generate", "hf-generate-bf16", "hf-generate-batch"})  # run on hf_peer_model's model


@dataclass(frozen=True)
class VLLMPeerKind:
    """What one vLLM peer's worker loads (one worker process per peer): its HF directory in ``dtype``; with a
    ``quantization``, the directory of the same weights as that mode's codes (``int8-w8a8``: kvlab's own
    ``quantize_w8a8`` codes in compressed-tensors format, the codes kvlab's mode runs), else the fp32 one; its KV
    cache in ``kv_cache_dtype`` (vLLM's argument: ``fp8`` is e4m3, unscaled, as kvlab's ``kv-fp8``)."""

    dtype: str
    quantization: str | None = None
    kv_cache_dtype: str = "auto"


VLLM_PEERS = {
    "vllm": VLLMPeerKind("float32"),
    "vllm-bf16": VLLMPeerKind("bfloat16"),
    "vllm-w8a8": VLLMPeerKind("float32", "int8-w8a8"),
    "vllm-w8a8-bf16": VLLMPeerKind("bfloat16", "int8-w8a8"),
    "vllm-kv-fp8": VLLMPeerKind("float32", kv_cache_dtype="fp8"),
    "vllm-bf16-kv-fp8": VLLMPeerKind("bfloat16", kv_cache_dtype="fp8"),
    "vllm-w8a8-bf16-kv-fp8": VLLMPeerKind("bfloat16", "int8-w8a8", "fp8"),
}


class PeerError(ValueError):
    """A peer that was asked for cannot run as given; the message says why and what to pass."""


@dataclass(frozen=True)
class PeerPlan:
    """What ``compare_throughput`` runs besides kvlab's modes: ``peers`` in order, and what they run on.
    ``skipped``: (peer, why) of each peer asked for that cannot run here and was left out."""

    peers: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    gguf: Path | None = None
    vllm_python: str | None = None
    vllm_model: str | None = None
    vllm_w8a8_model: str | None = None

    @property
    def needs_hf(self) -> bool:
        return bool(HF_PEERS & set(self.peers))


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_of(model: str) -> Path | None:
    """The GGUF file of a model spec (smollm2's, or a path ending in .gguf), else None."""
    if model == "smollm2":
        from kvlab.model.gguf import smollm2_gguf_path

        return smollm2_gguf_path()
    return Path(model) if model.endswith(".gguf") else None


def plan_peers(
    model: str,
    peers: Sequence[str],
    vllm_python: str | None = None,
    vllm_model: str | None = None,
    vllm_w8a8_model: str | None = None,
) -> PeerPlan:
    """The peers of ``model`` to run, checked before any model loads: PeerError for an unknown name, or for
    vllm without its interpreter (default: ``default_vllm_python``) or an HF directory of the weights (default:
    ``default_vllm_model``; vllm-bf16 loads the same directory in bfloat16; the W8A8 peers the directory of
    ``default_vllm_w8a8_model``, which must hold a quantisation config); llama.cpp is skipped, with its reason,
    without llama-cpp-python or a GGUF file."""
    wanted = list(dict.fromkeys(peers))
    if bad := sorted(set(wanted) - set(PEERS)):
        raise PeerError(f"unknown peer(s) {bad}; known: {', '.join(PEERS)}")
    if vllm := [p for p in wanted if p in VLLM_PEERS]:
        from kvlab.bench.peers.vllm_peer import default_vllm_model, default_vllm_python, default_vllm_w8a8_model

        vllm_python = vllm_python or default_vllm_python()
        if vllm_python is None:
            raise PeerError(f"--peers {vllm[0]} needs --vllm-python (scripts/peers/vllm.sh makes one)")
        if plain := [p for p in vllm if VLLM_PEERS[p].quantization is None]:
            vllm_model = _checked_dir(
                plain[0],
                "--vllm-model",
                vllm_model or default_vllm_model(model),
                f"an HF directory of {model}'s weights",
            )
        if w8a8 := [p for p in vllm if VLLM_PEERS[p].quantization is not None]:
            vllm_w8a8_model = _checked_dir(
                w8a8[0],
                "--vllm-w8a8-model",
                vllm_w8a8_model or default_vllm_w8a8_model(model),
                f"an HF directory of {model}'s weights as W8A8 int8 codes",
                quantised=True,
            )
    gguf = gguf_of(model)
    skipped: list[tuple[str, str]] = []
    if "llama.cpp" in wanted and not (llama_cpp_available() and gguf is not None):
        why = "llama-cpp-python is not installed" if not llama_cpp_available() else "the model is not a GGUF file"
        skipped.append(("llama.cpp", f"{why} (kvlab never installs it)"))
        wanted.remove("llama.cpp")
    return PeerPlan(tuple(wanted), tuple(skipped), gguf, vllm_python, vllm_model, vllm_w8a8_model)


def _checked_dir(peer: str, flag: str, directory: str | None, what: str, quantised: bool = False) -> str:
    """``directory`` if it is a directory (with ``quantised``: whose HF config holds a quantisation config, what
    vLLM reads to run int8 codes), else PeerError naming ``peer``'s missing ``flag``."""
    if directory is not None:
        path = Path(directory).expanduser()
        if path.is_dir() and (not quantised or _has_quantisation_config(path)):
            return directory
    raise PeerError(
        f"--peers {peer} needs {flag}: {what} ({directory or 'none'} is not one; "
        "scripts/peers/vllm.sh writes smollm2's)"
    )


def _has_quantisation_config(path: Path) -> bool:
    try:
        return "quantization_config" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def hf_peer_model(plan: PeerPlan, loaded: LoadedModel) -> Any:
    """The ``transformers.LlamaForCausalLM`` the HF peers of ``plan`` run (from the GGUF file itself when the
    model is one, else from ``loaded``'s weights), or None when it has none."""
    if not plan.needs_hf:
        return None
    return hf_from_gguf(plan.gguf) if plan.gguf is not None else hf_llama_from(loaded.model)


@contextlib.contextmanager
def _no_tqdm_in(module: Any) -> Iterator[None]:
    original = getattr(module, "tqdm", None)
    if original is None:  # a transformers version without the bar
        yield
        return
    module.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        module.tqdm = original


def hf_from_gguf(path: Path) -> Any:
    """A ``transformers.LlamaForCausalLM`` (fp32) from a GGUF file, through transformers' own GGUF path
    (config from metadata, dequantize, un-permute Q/K).

    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` refuses to run without the
    ``accelerate`` package; for Llama it calls exactly ``load_gguf_checkpoint`` and loads the result,
    which is what this does.
    """
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    # transformers wraps this load in a bare tqdm bar ("de-quantizing GGUF tensors") that ignores its own
    # disable_progress_bar() and writes hundreds of carriage-return updates into a piped log; kvlab's commands
    # show their own progress, so the module's tqdm is swapped for a pass-through for this one call.
    with _no_tqdm_in(gguf_utils):
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"GGUF tensors do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if "lm_head.weight" in missing and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("GGUF has no output.weight but the HF config does not tie the embeddings")
    return hf


def hf_config(cfg: ModelConfig) -> Any:
    import transformers

    # rope_theta, not rope_parameters: 4.x only knows the former, and 5.x still takes it through the
    # **kwargs its dataclass-generated signature does not show (it moves it into rope_parameters).
    return transformers.LlamaConfig(  # type: ignore[call-arg]  # 5.x stub omits the legacy kwargs
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=1,
    )


def to_hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """kvlab names -> LlamaForCausalLM names, splitting the fused projections."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            base = "model." + name.removesuffix("qkv_proj.weight")
            for part, w in zip("qkv", t.split([q, kv, kv]), strict=True):
                out[f"{base}{part}_proj.weight"] = w.clone()
        elif name.endswith("gate_up_proj.weight"):
            base = "model." + name.removesuffix("gate_up_proj.weight")
            gate, up = t.chunk(2)
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = gate.clone(), up.clone()
        elif name == "lm_head.weight":
            out[name] = t.clone()
        else:
            out["model." + name] = t.clone()
    return out


def hf_llama_from(model: LlamaModel) -> Any:
    """A ``transformers.LlamaForCausalLM`` holding exactly the weights of a kvlab ``LlamaModel``."""
    import transformers

    hf = transformers.LlamaForCausalLM(hf_config(model.config)).float().eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return hf
