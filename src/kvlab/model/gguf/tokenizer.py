"""A GGUF's tokenizer, rebuilt offline from its ``tokenizer.*`` metadata.

Byte-level BPE vocabularies are built here with ``tokenizers`` directly: transformers' converter is
slower (it needs an ``import transformers``) and drops the digit-splitting pre-tokenizer of SmolLM2's
``tokenizer.ggml.pre = "smollm"``. SentencePiece vocabularies go through transformers' converter (see
``_sentencepiece_bpe``).
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Any

from kvlab.model.gguf.reader import GGUFFile
from kvlab.model.weights import INSTALL_HINT, ModelLoadError
from kvlab.tokenizer import HFTokenizer


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
