"""kvlab's fp8 cache rounding toward zero, as vLLM's CPU backend does (``vllm_fp8_rounding.py``), against vLLM's
fp8 tokens: how much of the difference between the two is that rounding.

    .venv/bin/python scripts/peers/fp8_like_vllm.py [kvlab bench throughput options]

Runs ``kvlab bench throughput`` (default: ``--model smollm2 --workloads shared-prefix,long-context --requests 16
--modes fp32+kv-fp8 --peers vllm-kv-fp8 --repeats 1``) with ``KVStorage.write`` storing each K/V value of an fp8
cache rounded toward zero instead of to nearest: the reference path's write (the fp32 mode's), in this process
only. The vLLM row's "identical" column then counts vLLM's sequences equal to those of kvlab rounding as it does.
"""

from __future__ import annotations

import sys

import torch

from kvlab.cli import app
from kvlab.kv import storage

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT = [
    *("bench", "throughput", "--model", "smollm2", "--threads", "2", "--workloads", "shared-prefix,long-context"),
    *("--requests", "16", "--modes", "fp32+kv-fp8", "--peers", "vllm-kv-fp8", "--repeats", "1"),
]


def toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to ``dtype`` toward zero: the nearest code, one step nearer zero where it lies beyond x (the codes
    of one sign are ordered by magnitude, so the step is the byte minus one)."""
    x = x.float()
    nearest = x.to(dtype)
    beyond = nearest.float().abs() > x.abs()
    code = nearest.view(torch.uint8)
    return torch.where(beyond, code - 1, code).view(dtype)


def main() -> None:
    write = storage.KVStorage.write

    def truncating_write(
        self: storage.KVStorage, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if self.dtype in FP8:  # fp8 values are exact in fp32, so write's own .to() keeps them
            k, v = toward_zero(k, self.dtype).float(), toward_zero(v, self.dtype).float()
        write(self, layer, slot_mapping, k, v)

    storage.KVStorage.write = truncating_write  # type: ignore[method-assign]
    sys.argv = ["kvlab", *(sys.argv[1:] or DEFAULT)]
    app()


if __name__ == "__main__":
    main()
