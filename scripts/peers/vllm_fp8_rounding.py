"""How vLLM's CPU backend rounds K/V into an fp8 cache, against torch's ``.to()`` (what kvlab stores).

    ~/.cache/kvlab-peers/vllm/bin/python scripts/peers/vllm_fp8_rounding.py   # the venv scripts/peers/vllm.sh makes

Runs in vLLM's venv (it calls ``vllm._custom_ops.cpu_attn_reshape_and_cache``, the op vLLM's CPU attention writes
its cache with, scale 1 as with no calibrated scales). 8,192 finite bf16 values below 1,000 in magnitude are each
written as one token (every one of its values the same) into a block of its own, in fp32 and in bf16, for
``fp8`` (e4m3) and ``fp8_e5m2``; each block's code is compared with torch's round-to-nearest-even ``.to()`` and with
rounding toward zero (the largest code not above the value's magnitude, saturating at the largest finite one).
Prints one line per format and input dtype: how many codes equal each.
"""

from __future__ import annotations

import torch
import vllm._custom_ops as ops  # type: ignore[import-not-found]

HEAD_DIM, BLOCK = 32, 32  # vLLM's CPU attention takes blocks of a multiple of 32 slots
FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def sample_values(count: int = 8192) -> torch.Tensor:
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    finite = every_bf16[torch.isfinite(every_bf16) & (every_bf16.abs() < 1000)]
    return finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))[:count]]


def vllm_codes(values: torch.Tensor, dtype: torch.dtype, kv_cache_dtype: str) -> torch.Tensor:
    """Each value's byte as vLLM stores it: one token a block, so the block's nonzero bytes are that token's."""
    tokens = values.numel()
    key = values[:, None, None].expand(tokens, 1, HEAD_DIM).contiguous().to(dtype)
    cache = torch.zeros(tokens, 1, 2 * BLOCK, HEAD_DIM, dtype=torch.uint8)  # vLLM's CPU layout: K then V per block
    k_cache, v_cache = cache.chunk(2, dim=2)
    slots = torch.arange(tokens) * BLOCK
    ops.cpu_attn_reshape_and_cache(key, key, k_cache, v_cache, slots, "vec", 1.0, 1.0, kv_cache_dtype)
    return k_cache.reshape(tokens, -1).max(dim=1).values  # a negative value's code has the top bit: the maximum


def truncated_codes(values: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Round toward zero: the largest non-negative code whose value is at most |x|, with x's sign."""
    codes = torch.arange(128, dtype=torch.uint8)
    magnitudes = codes.view(fp8).float()
    finite = torch.isfinite(magnitudes)
    codes, magnitudes = codes[finite], magnitudes[finite]
    below = (torch.searchsorted(magnitudes, values.abs(), right=True) - 1).clamp(min=0)
    sign = torch.where(values < 0, 128, 0).to(torch.uint8)
    return codes[below] | sign


def main() -> None:
    values = sample_values()
    for name, fp8 in FORMATS.items():
        nearest = values.to(fp8).view(torch.uint8)
        toward_zero = truncated_codes(values, fp8)
        zero = toward_zero & 127 == 0  # +0 and -0: vLLM's block is all zeros either way
        for dtype in (torch.float32, torch.bfloat16):
            got = vllm_codes(values, dtype, name)
            same_trunc = int(((got == toward_zero) | (zero & (got == 0))).sum())
            same_nearest = int(((got == nearest) | ((nearest & 127 == 0) & (got == 0))).sum())
            print(
                f"{name:9s} {str(dtype).removeprefix('torch.'):9s} {values.numel()} values: "
                f"round toward zero {same_trunc}, torch's round to nearest even {same_nearest}"
            )


if __name__ == "__main__":
    main()
