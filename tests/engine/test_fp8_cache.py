"""The fp8 KV cache (``kv_cache_dtype="fp8"`` = ``fp8_e4m3``, or ``fp8_e5m2``; vLLM's names, unscaled): the compiled
write rounds exactly as ``KVStorage.write``'s ``.to()`` does, the kernels widen every code exactly as ``.to()``
widens it, an engine over an fp8 cache gives the greedy tokens of the dense oracle with K/V rounded as the cache
stores them, on the kernel path as on the reference path, and a memory budget holds four times fp32's blocks."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.attention.kernels import kv_write_kernel, paged_attention_kernel
from kvlab.model.reference import dense_generate

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
write = kv_write_kernel()
kernel = paged_attention_kernel()
pytestmark = pytest.mark.skipif(write is None or kernel is None, reason="no C++ toolchain: the reference serves")


def _inputs() -> dict[str, torch.Tensor]:
    """Every bf16 bit pattern; 2^18 random fp32 bit patterns with the edges of both formats' ranges (saturation,
    overflow, subnormals, ties, inf, NaN, signed zero) and their negatives."""
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int64)
    edges = [448, 464, 464.0001, 463.9999, 480, 1e9, 57344, 61439.99, 61440, 65536, 2**-6, 2**-9, 2**-10, 3 * 2**-10]
    edges += [2**-14, 2**-16, 2**-17, 3 * 2**-17, 1e-45, 0.0, float("inf"), float("nan")]
    edge = torch.tensor(edges, dtype=torch.float32)
    fp32 = torch.cat([bits.to(torch.int32).view(torch.float32), edge, -edge])
    return {"bf16": every_bf16, "fp32": fp32}


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("source", ["bf16", "fp32"])
def test_the_compiled_write_rounds_every_value_as_torch_does(fp8: torch.dtype, source: str) -> None:
    assert write is not None
    x = _inputs()[source]
    width = 256  # 4 heads of 64: the write's 16-value steps
    x = torch.cat([x, x[: (-x.numel()) % width]]).view(-1, 4, 64)
    tokens = x.shape[0]
    k_cache = torch.zeros(tokens, 1, 4, 64, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))
    write(k_cache, v_cache, slots, x, -x)
    for cache, values in ((k_cache, x), (v_cache, -x)):
        want = torch.zeros(tokens, 4, 64, dtype=torch.uint8)
        want[slots] = values.to(fp8).view(torch.uint8)
        assert torch.equal(cache.view(tokens, 4, 64).view(torch.uint8), want)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_widens_every_code_as_torch_does(fp8: torch.dtype, q_dtype: torch.dtype) -> None:
    """Each row reads one slot, so its output is that slot's V exactly (a softmax over one key is 1): the 256 codes
    as 16 slots of 16 values, NaN where ``.to()`` gives NaN."""
    assert kernel is not None
    codes = torch.arange(256, dtype=torch.uint8).view(16, 1, 1, 16)  # 16 blocks of one slot, one head, D = 16
    v = codes.view(fp8)
    k = torch.zeros_like(codes).view(fp8)
    q = torch.zeros(16, 1, 16, dtype=q_dtype)
    got = kernel(q, k, v, torch.arange(16).view(16, 1), torch.ones(16, dtype=torch.long), 0.25)
    want = v.view(16, 1, 16).to(torch.float32).to(q_dtype)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_engine_on_an_fp8_cache_gives_its_reference_paths_tokens(kv_cache_dtype: str) -> None:
    """fp32 compute over an fp8 cache: the kernel path rounds into the cache by the compiled write and the reference
    by ``.to()``, and both attend their widened values. The two paths' fp32 K and V differ by ~1e-6 (another
    summation order), which moves a few values across a rounding edge (measured: 118 of 223,000 K bytes, in the last
    two layers), so the check is the greedy tokens: equal for these prompts, as on a bf16 cache."""
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 90))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    knobs = {"kv_cache_dtype": kv_cache_dtype, "block_size": 8, "max_num_batched_tokens": 128}
    fast = LLM("mini", attention_backend="cpp", **knobs)
    runner = fast.engine.runner
    assert runner.attention_kernel is not None and runner.kv_write is not None and runner.flash_kernel is not None
    reference = LLM("mini", **knobs)
    assert reference.engine.runner.attention_kernel is None
    want = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    assert fast.engine.storage.dtype == reference.engine.storage.dtype == want
    outs = fast.generate(prompts, params, use_tqdm=False)
    refs = reference.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]


@pytest.mark.parametrize("attention_backend", ["reference", "cpp"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_engine_on_an_fp8_cache_gives_the_rounding_oracles_tokens(kv_cache_dtype: str, attention_backend: str) -> None:
    """The dense oracle with K and V rounded as the cache stores them (no cache: ``DenseCausalAttention(kv_dtype=)``)
    chooses the engine's greedy tokens, on both attention paths; without the rounding it does not (the check can
    fail: an fp8 cache moves these tokens)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 70))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM("mini", kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend, block_size=8)
    model, dtype = llm.engine.loaded.model, llm.engine.storage.dtype
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == dense_generate(model, prompt, 10, kv_dtype=dtype)
    unrounded = [dense_generate(model, p, 10) for p in prompts]
    assert unrounded != [list(o.token_ids) for o in outs]


def test_every_kv_cache_dtype_name_but_auto_names_a_storage_dtype() -> None:
    from kvlab.config import KV_CACHE_DTYPES
    from kvlab.engine.sizing import STORAGE_DTYPES

    assert set(STORAGE_DTYPES) == set(KV_CACHE_DTYPES) - {"auto"}


def test_a_memory_budget_holds_four_times_the_blocks_of_fp32_in_fp8() -> None:
    """``kv_cache_memory_bytes`` (vLLM's argument) buys as many whole blocks as fit: a block of an fp8 pool is a
    quarter of an fp32 one's bytes, so the same budget holds 4x the tokens (2x bf16's)."""
    budget = 64 << 20
    blocks = {d: LLM("mini", kv_cache_memory_bytes=budget, kv_cache_dtype=d).engine.kv.num_blocks
              for d in ("auto", "bfloat16", "fp8", "fp8_e5m2")}  # fmt: skip
    assert blocks == {"auto": 1024, "bfloat16": 2048, "fp8": 4096, "fp8_e5m2": 4096}
