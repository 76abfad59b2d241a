"""The compiled flash prefill kernels against SDPA on the same values, and the engine that uses them.

fp32: within 1e-5 of the exact (fp64) attention, as SDPA in fp32 is (both measured at most 2e-6).
bf16, per output element: one bf16 rounding of the exact output (2^-8 relative: the kernel rounds its fp32 result
once, as SDPA in bf16 does) plus one of each probability, rounded to bf16 before its product with V (2^-9 relative
each, so at most 2^-9 of the same attention over |V|; 2^-8 of it allowed, for the fp32 sums' order).
"""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab import LLM, SamplingParams
from kvlab.attention import flash
from kvlab.attention.flash import FLASH_HEAD_DIMS, flash_prefill_kernel
from kvlab.attention.paged import KernelAttentionMetadata, tiled_queries
from kvlab.attention.varlen import prefill_attention
from oracle_cache import assert_bf16_paths_agree, check_against_oracle, mini

kernel = flash_prefill_kernel(torch.bfloat16)
kernel32 = flash_prefill_kernel(torch.float32)
needs_bf16 = pytest.mark.skipif(kernel is None, reason="no AVX512-BF16 or no C++ toolchain: SDPA serves")
needs_fp32 = pytest.mark.skipif(kernel32 is None, reason="no AVX-512 or no C++ toolchain: SDPA serves")
CHUNKS = [
    (1, 0),  # a one-token prompt: a lone row, one key
    (37, 0),  # a fresh prompt: tiles of queries and keys, both cut short
    (64, 0),  # whole tiles, the causal edge on their diagonals
    (13, 50),  # a chunk after a cached prefix that ends inside a key tile
    (8, 96),  # one query tile after whole key tiles
    (70, 190),  # several query tiles over a longer prefix
]


def _cache(
    gen: torch.Generator, ctx: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches of 8-slot blocks holding a context at scattered slots (read in place), and those slots."""
    bs = 8
    num_blocks = ctx // bs + 4
    k = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    return k, v, torch.randperm(num_blocks * bs, generator=gen)[:ctx]


def _within_rounding(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
    """``got`` against SDPA in fp32 over the same bf16 values q [L, H, D], k, v [ctx, Hkv, D]."""
    assert got.dtype == torch.bfloat16
    positions = torch.arange(start, k.shape[0])
    want = prefill_attention(q.float(), k.float(), v.float(), positions, start == 0)
    over_abs_v = prefill_attention(q.float(), k.float(), v.float().abs(), positions, start == 0)
    err = (got.float() - want).abs()
    bound = 2**-8 * (want.abs() + over_abs_v)
    assert bool((err <= bound).all()), float((err / bound).max())


@needs_bf16
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("dim", FLASH_HEAD_DIMS)  # each is its own compiled loop
@pytest.mark.parametrize(("queries", "start"), CHUNKS)
def test_bf16_kernel_equals_sdpa_on_the_same_values(
    queries: int, start: int, dim: int, heads: int, kv_heads: int, cache_dtype: torch.dtype
) -> None:
    assert kernel is not None
    gen = torch.Generator().manual_seed(queries * 1000 + start + dim + heads)
    k, v, slots = _cache(gen, start + queries, kv_heads, dim, cache_dtype)
    q = (torch.randn(queries, heads, dim, generator=gen) * 2).to(torch.bfloat16)  # peaked softmaxes too
    got = kernel(q, k, v, slots, start, dim**-0.5)
    # The reference reads the bf16 values the kernel multiplies (an fp32 cache rounded to bf16, an fp8 one widened).
    kb = k.to(torch.bfloat16).view(-1, kv_heads, dim)[slots]
    vb = v.to(torch.bfloat16).view(-1, kv_heads, dim)[slots]
    _within_rounding(got, q, kb, vb, start)


@needs_fp32
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("dim", FLASH_HEAD_DIMS)
@pytest.mark.parametrize(("queries", "start"), [*CHUNKS, (16, 0), (33, 15)])  # 16 query lanes: whole and cut
def test_fp32_kernel_equals_exact_attention(
    queries: int, start: int, dim: int, heads: int, kv_heads: int, cache_dtype: torch.dtype
) -> None:
    assert kernel32 is not None
    gen = torch.Generator().manual_seed(queries * 1000 + start + dim + heads + 1)
    k, v, slots = _cache(gen, start + queries, kv_heads, dim, cache_dtype)
    q = torch.randn(queries, heads, dim, generator=gen) * 2
    got = kernel32(q, k, v, slots, start, dim**-0.5)
    assert got.dtype == torch.float32
    # A bf16 or fp8 cache is widened exactly on both sides.
    kd = k.double().view(-1, kv_heads, dim)[slots]
    vd = v.double().view(-1, kv_heads, dim)[slots]
    want = prefill_attention(q.double(), kd, vd, torch.arange(start, start + queries), start == 0)
    assert (got.double() - want).abs().max() < 1e-5


@needs_bf16
@needs_fp32
def test_a_long_document_in_one_call() -> None:
    """SmolLM2's shape over 2,048 fresh tokens, then 300 queries after 1,700 cached: the online softmax over many
    key tiles keeps its running maximum and sum right."""
    assert kernel is not None and kernel32 is not None
    gen = torch.Generator().manual_seed(3)
    for queries, start in ((2048, 0), (300, 1700)):
        ctx = start + queries
        k = torch.randn(ctx, 3, 64, generator=gen).to(torch.bfloat16)
        v = torch.randn(ctx, 3, 64, generator=gen).to(torch.bfloat16)
        q = (torch.randn(queries, 9, 64, generator=gen) * 2).to(torch.bfloat16)
        _within_rounding(kernel(q, k, v, torch.arange(ctx), start, 0.125), q, k, v, start)
        qd, kd, vd = q.double(), k.double(), v.double()
        exact = prefill_attention(qd, kd, vd, torch.arange(start, ctx), start == 0)
        assert (kernel32(q.float(), k.float(), v.float(), torch.arange(ctx), start, 0.125) - exact).abs().max() < 1e-5


@needs_bf16
def test_bad_arguments_are_refused_with_a_message() -> None:
    assert kernel is not None
    k = torch.zeros(4, 8, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="q \\[L, H, D\\] in fp32 or bf16"):
        kernel(q.half(), k, k, torch.arange(3), 0, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be 16, 32, 64 or 128"):
        kernel(
            torch.zeros(3, 4, 48, dtype=torch.bfloat16),
            k[..., :48].contiguous(),
            k[..., :48].contiguous(),
            torch.arange(3),
            0,
            0.125,
        )
    with pytest.raises(RuntimeError, match="queries after start < ctx"):
        kernel(q, k, k, torch.arange(3), 3, 0.125)
    with pytest.raises(RuntimeError, match="scale > 0"):  # the bf16 loop takes maxima before scaling
        kernel(q, k, k, torch.arange(3), 0, 0.0)
    with pytest.raises(RuntimeError, match="H a multiple of Hkv"):
        kernel(torch.zeros(3, 3, 64, dtype=torch.bfloat16), k, k, torch.arange(3), 0, 0.125)


@given(
    prompt=st.integers(1, 3000),
    generated=st.integers(0, 200),
    cuts=st.lists(st.integers(1, 3199), max_size=12),
    flash=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_positions_route_depends_on_its_request_alone_not_on_the_chunks(
    prompt: int, generated: int, cuts: list[int], flash: bool, dtype: torch.dtype
) -> None:
    """However a request's context is cut into chunks (chunked prefill, a cache hit ending anywhere, a preemption's
    recompute, a draft's verification), only its prompt's queries are ever tiled, the first ones of a chunk; with the
    flash kernels every prompt position is, every generated one a row: a position's route, hence its K/V's bits, is a
    function of the position and its request's prompt length, not of the chunking (docs/serving.md)."""
    total = prompt + generated
    bounds = sorted({0, total, *(c for c in cuts if c < total)})
    tiled_positions: set[int] = set()
    for start, end in itertools.pairwise(bounds):
        tiled = tiled_queries(start, end - start, prompt, dtype, flash)
        assert tiled in (0, max(0, min(end, prompt) - start))
        tiled_positions.update(range(start, start + tiled))
    assert all(p < prompt for p in tiled_positions)
    if flash:
        assert tiled_positions == set(range(prompt))


def _flash_calls(llm: LLM, dtype: torch.dtype) -> list[KernelAttentionMetadata]:
    """Records the steps whose metadata sends segments to the flash kernel, checking each chunk's routing."""
    metas: list[KernelAttentionMetadata] = []
    prepare = llm.engine.runner.prepare

    def recording(batch):  # type: ignore[no-untyped-def]
        prep = prepare(batch)
        assert isinstance(prep.meta, KernelAttentionMetadata)
        segments = {seg.row_start: seg.row_end for seg in prep.meta.prefills}
        row = 0
        for e in (e for e in batch.scheduled if e.num_tokens):
            tiled = tiled_queries(e.start, e.num_tokens, e.request.num_prompt_tokens, dtype, flash=True)
            assert segments.get(row, row) == row + tiled  # the chunk's prompt queries, and only they
            row += e.num_tokens
        if prep.meta.prefills:
            assert prep.meta.flash is not None
            metas.append(prep.meta)
        return prep

    llm.engine.runner.prepare = recording  # type: ignore[method-assign]
    return metas


def _document_prompts(seed: int) -> list[list[int]]:
    """Short prompts, and a 300-token document with questions after it (its blocks cached once prefilled)."""
    rng = random.Random(seed)
    document = [rng.randrange(256) for _ in range(300)]
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 7))] for _ in range(3)]
    return prompts + [document + [rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(4)]


def _check_routing(metas: list[KernelAttentionMetadata]) -> None:
    assert any(m.rows is not None and m.rows.numel() for m in metas)  # kernel rows beside flash segments
    assert any(int(seg.q_positions[0]) > 0 for m in metas for seg in m.prefills)  # after a cached prefix
    assert any(seg.row_end - seg.row_start < 8 and seg.fresh for m in metas for seg in m.prefills)  # short prompts


@needs_bf16
def test_bf16_engine_prefills_through_the_kernel_within_rounding_of_its_reference_path() -> None:
    """A document prefilled in chunks beside decoding requests, and questions after it in its cached blocks: prompt
    chunks of any length run through the kernel, decode tokens stay rows of the paged kernel in the same steps; the
    tokens stay within bf16 rounding of the reference path (``assert_bf16_paths_agree``)."""
    prompts = _document_prompts(12)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    knobs = {"block_size": 8, "max_num_batched_tokens": 128, "dtype": "bfloat16"}
    llm = LLM("mini", attention_backend="cpp", **knobs)
    assert llm.engine.runner.flash_kernel is not None
    metas = _flash_calls(llm, torch.bfloat16)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    _check_routing(metas)
    refs = [r.outputs[0] for r in LLM("mini", **knobs).generate(prompts, params, use_tqdm=False)]
    assert_bf16_paths_agree(outs, refs)


@needs_fp32
@pytest.mark.parametrize("model", ["mini", "mini-gqa"])
def test_fp32_engine_prefills_through_the_kernel_with_the_oracles_tokens(model: str) -> None:
    """The same in fp32: greedy tokens equal the dense oracle's (up to its stated near-ties) and the reference
    path's, exactly."""
    prompts = _document_prompts(13)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    knobs = {"block_size": 8, "max_num_batched_tokens": 128}
    llm = LLM(mini(model), attention_backend="cpp", **knobs)
    assert llm.engine.runner.flash_kernel is not None
    metas = _flash_calls(llm, torch.float32)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check_routing(metas)
    refs = LLM(mini(model), **knobs).generate(prompts, params, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs, strict=True):
        assert check_against_oracle(model, tuple(p), 8, tuple(o.token_ids))
        assert o.token_ids == r.token_ids


def test_without_the_kernels_sdpa_serves_after_one_log_line(monkeypatch, caplog) -> None:
    """Where the op set cannot be built, long chunks on the cpp path go to SDPA by its own rule, after one
    warning, within rounding of the reference path (bf16) and with its tokens (fp32)."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    flash.flash_ops.cache_clear()
    flash_prefill_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvlab.native"):
            assert flash.flash_prefill_kernel(torch.bfloat16) is None
            assert flash.flash_prefill_kernel(torch.float32) is None  # the failure is remembered, not retried
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        fallbacks = [w for w in warnings if "using the reference" in w]
        assert len(fallbacks) == 1 and "flash prefill kernels unavailable" in fallbacks[0]
        monkeypatch.undo()  # the paged kernel loads from torch's disk cache; the flash ops stay "unavailable"
        rng = random.Random(2)
        prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 90))] for _ in range(4)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        for dtype in ("bfloat16", "float32"):
            knobs = {"block_size": 8, "dtype": dtype}
            llm = LLM("mini", attention_backend="cpp", **knobs)
            assert llm.engine.runner.attention_kernel is not None and llm.engine.runner.flash_kernel is None
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            refs = [r.outputs[0] for r in LLM("mini", **knobs).generate(prompts, params, use_tqdm=False)]
            if dtype == "bfloat16":
                assert_bf16_paths_agree(outs, refs)
            else:
                assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    finally:
        monkeypatch.undo()
        flash.flash_ops.cache_clear()
        flash_prefill_kernel.cache_clear()
