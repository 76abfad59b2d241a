"""The file's own Q4_1 codes, for ``quantization="gguf"`` (``kvlab.model.quant``), which runs them rather
than their fp32 dequantisation."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvlab.model.gguf.checkpoint import checkpoint_names, gguf_model_config, unpermute_rope_rows
from kvlab.model.gguf.reader import GGUFTensorInfo, mapped, read_gguf
from kvlab.model.weights import PACKED_WEIGHTS

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
    with mapped(path) as buf:
        parsed = read_gguf(path, buf)
        cfg = gguf_model_config(parsed)
        rope_heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        parts: dict[str, Q4_1Blocks] = {}
        for gguf_name, name in checkpoint_names(cfg).items():
            info = parsed.tensors[gguf_name]
            if info.ggml_type != GGMLQuantizationType.Q4_1 or len(info.shape) != 2:
                continue
            blocks = _q4_1_blocks(buf, info)
            heads = rope_heads.get(gguf_name.split(".")[-2])
            if heads is not None:
                blocks = Q4_1Blocks(*(unpermute_rope_rows(t, heads) for t in (blocks.d, blocks.m, blocks.q)))
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
