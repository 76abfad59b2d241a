"""Codes: what a quantised weight is, independently of how a kernel packs it (``kvlab.model.quant`` runs them).

- ``Int8Codes``: symmetric int8 in groups along a row (llama.cpp's Q8_0 blocks), the weight-only ``int8`` mode's;
- ``W8A8Codes``: symmetric int8 with one scale per output channel (``int8-w8a8``'s weights), and
  ``quantize_tokens``, the same mode's dynamic per-token activation codes;
- ``Int4Codes``: the int4 kernel's asymmetric groups (``int4``), or a GGUF file's own Q4_1 blocks (``gguf``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvlab.model.gguf import Q4_1_BLOCK, Q4_1Blocks

COMPUTE_DTYPE = torch.bfloat16
# llama.cpp's 4-bit block size, and the only group size at which Q4_1 codes map one to one.
INT4_GROUP_SIZE = Q4_1_BLOCK
# llama.cpp's Q8_0 block: int8 scales per group of this many weights along a row.
INT8_GROUP_SIZE = 32


@dataclass(frozen=True)
class Int8Codes:
    """``w[n, g*G + i] = scale[n, g] * q[n, g*G + i]``: symmetric, one scale per group of G weights along a row."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // G]
    group_size: int = INT8_GROUP_SIZE

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.float().view(n, k // self.group_size, self.group_size) * self.scale[..., None]).view(n, k)


def quantize_int8(
    w: torch.Tensor, scale_dtype: torch.dtype = COMPUTE_DTYPE, group_size: int = INT8_GROUP_SIZE
) -> Int8Codes:
    """Round-to-nearest per group; the scale is rounded to ``scale_dtype`` first (the kernel multiplies in the
    activations' dtype) and the codes are computed against that rounded scale, so the pair is consistent."""
    n, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"int8: {k} input features are not a whole number of groups of {group_size}")
    g = w.detach().float().view(n, k // group_size, group_size)
    scale = (g.abs().amax(dim=-1) / 127).clamp_min(1e-12).to(scale_dtype).float()
    q = torch.round(g / scale[..., None]).clamp(-128, 127).to(torch.int8)
    return Int8Codes(q.view(n, k), scale, group_size)


@dataclass(frozen=True)
class W8A8Codes:
    """``w[n, k] = scale[n] * q[n, k]``: symmetric int8 with one scale per output channel (vLLM's W8A8 weights:
    the int32 sum over a whole row needs one scale for the row)."""

    q: torch.Tensor  # int8 [N, K], -127..127
    scale: torch.Tensor  # float32 [N]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def quantize_w8a8(w: torch.Tensor) -> W8A8Codes:
    """Round-to-nearest per output channel, symmetric over -127..127 (so that negation is exact)."""
    g = w.detach().float()
    scale = (g.abs().amax(dim=-1) / 127).clamp_min(1e-12)
    return W8A8Codes(torch.round(g / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token int8: ``x[m] ~ scale[m] * q[m]`` with ``scale[m] = max |x[m]| / 127``; a row of
    zeros gets codes 0. Only the row's own values set its scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127).clamp_min(1e-30)
    return torch.round(xf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


@dataclass(frozen=True)
class Int4Codes:
    """The int4 kernel's convention: ``w[n, g*G + i] = (q[n, g*G + i] - 8) * scale[n, g] + zero[n, g]``."""

    q: torch.Tensor  # uint8 [N, K], codes 0..15
    scale: torch.Tensor  # float32 [N, K // G]
    zero: torch.Tensor  # float32 [N, K // G]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = (self.q.float() - 8).view(n, k // self.group_size, self.group_size) * self.scale[..., None]
        return (w + self.zero[..., None]).view(n, k)

    def rounded(self, dtype: torch.dtype) -> Int4Codes:
        """The same codes with scale and zero rounded to ``dtype``: what the kernel sees in that dtype."""
        return replace(self, scale=self.scale.to(dtype).float(), zero=self.zero.to(dtype).float())

    @classmethod
    def from_q4_1(cls, blocks: Q4_1Blocks) -> Int4Codes:
        """Q4_1's ``d * q + m`` is ``(q - 8) * d + (m + 8 d)``: same codes, scale d, zero m + 8d. ``8 d`` is exact;
        the sum is exact in fp32 whenever it fits 24 significant bits (fp16 d and m have 11), which holds for
        every SmolLM2 block (tests/test_quant.py checks it in float64)."""
        d, m = blocks.d.float(), blocks.m.float()
        return cls(blocks.q, d, m + 8 * d, Q4_1_BLOCK)


def quantize_int4(
    w: torch.Tensor, group_size: int = INT4_GROUP_SIZE, scale_dtype: torch.dtype = COMPUTE_DTYPE
) -> Int4Codes:
    """Asymmetric min/max per group (torchao's and Q4_1's scheme): scale = (max - min) / 15, zero the group's
    centre; codes are computed against the scale and zero rounded to ``scale_dtype``."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: {k} input features are not a whole number of groups of {group_size}")
    g = w.detach().float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12).to(scale_dtype).float()
    zero = (lo + 8 * scale).to(scale_dtype).float()
    q = torch.round((g - zero[..., None]) / scale[..., None]) + 8
    return Int4Codes(q.clamp(0, 15).to(torch.uint8).view(n, k), scale, zero, group_size)
