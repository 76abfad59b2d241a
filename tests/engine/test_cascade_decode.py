"""The kernel path's shared-prefix (cascade) decode: ``flash_prefix`` (every query against a prefix the rows share,
with its log-sum-exp) and ``paged_decode_after_prefix`` (each row over its own slots, merged), against exact
attention over the same values, and the engine that routes rows to them.

Tolerances: fp32 queries within 1e-5 of fp64 attention (sums in another order); bf16 queries, per output element,
2^-8 of the exact output plus the same attention over |V| (the probabilities rounded to bf16 for the product with
V, as in the flash prefill tests); the log-sum-exp within 1e-4 (fp32 sums of exponentials).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.attention.flash import flash_prefix_kernel
from kvlab.attention.kernels import paged_after_prefix_kernel, paged_attention_kernel
from kvlab.attention.paged import KernelAttentionMetadata, cascade_kernels
from kvlab.engine import runner
from oracle_cache import assert_bf16_paths_agree

prefix_bf16 = flash_prefix_kernel(torch.bfloat16)
prefix_fp32 = flash_prefix_kernel(torch.float32)
after = paged_after_prefix_kernel()
plain = paged_attention_kernel()
needs_bf16 = pytest.mark.skipif(
    prefix_bf16 is None or after is None, reason="no AVX512-BF16 or no C++ toolchain: each row walks its context"
)
BS = 8  # slots a block in these caches


def _caches(
    gen: torch.Generator, blocks: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(blocks, BS, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))  # type: ignore[return-value]


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [R, H, D] over k, v [R, ctx, Hkv, D] in fp64: output [R, H, D] and log-sum-exp [R, H]."""
    heads, kv_heads, dim = q.shape[1], k.shape[2], q.shape[2]
    kd = k.double().repeat_interleave(heads // kv_heads, dim=2)
    vd = v.double().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("rhd,rchd->rhc", q.double(), kd) * dim**-0.5
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("rhc,rchd->rhd", torch.softmax(scores, dim=-1), vd), lse


def _bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The bf16 tolerance of an output element: 2^-8 of (|exact| + the same attention over |V|)."""
    want, _ = _exact(q, k, v)
    over_abs_v, _ = _exact(q, k, v.abs())
    return 2**-8 * (want.abs() + over_abs_v)


def _context(slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return cache.reshape(-1, *cache.shape[2:])[slots]


@needs_bf16
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.float8_e5m2])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("dim", [16, 32, 64, 128])  # 16: the packing's gather path; the others transpose
@pytest.mark.parametrize(("rows", "prefix_len"), [(1, 5), (8, 64), (13, 100), (20, 257)])
def test_flash_prefix_equals_exact_attention_over_the_prefix(
    rows: int, prefix_len: int, dim: int, heads: int, kv_heads: int, cache_dtype: torch.dtype
) -> None:
    assert prefix_bf16 is not None
    gen = torch.Generator().manual_seed(rows * 1000 + prefix_len + dim + heads)
    kc, vc = _caches(gen, prefix_len // BS + 8, kv_heads, dim, cache_dtype)
    slots = torch.randperm(kc.shape[0] * BS, generator=gen)[:prefix_len]
    q = (torch.randn(rows, heads, dim, generator=gen) * 2).to(torch.bfloat16)  # peaked softmaxes too
    out, lse = prefix_bf16(q, kc, vc, slots, dim**-0.5)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
    k = _context(slots, kc).to(torch.bfloat16)[None].expand(rows, -1, -1, -1)  # the bf16 values multiplied
    v = _context(slots, vc).to(torch.bfloat16)[None].expand(rows, -1, -1, -1)
    want, want_lse = _exact(q, k, v)
    assert bool(((out.double() - want).abs() <= _bound(q, k, v)).all())
    assert (lse.double() - want_lse).abs().max() < 1e-4


@pytest.mark.skipif(prefix_fp32 is None, reason="no AVX-512 or no C++ toolchain")
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3)])
@pytest.mark.parametrize(("rows", "prefix_len"), [(1, 5), (17, 300)])  # 16 query lanes: one, and cut
def test_flash_prefix_in_fp32_equals_exact_attention(rows: int, prefix_len: int, heads: int, kv_heads: int) -> None:
    assert prefix_fp32 is not None
    gen = torch.Generator().manual_seed(rows + prefix_len + heads)
    kc, vc = _caches(gen, prefix_len // BS + 8, kv_heads, 32, torch.float32)
    slots = torch.randperm(kc.shape[0] * BS, generator=gen)[:prefix_len]
    q = torch.randn(rows, heads, 32, generator=gen) * 2
    out, lse = prefix_fp32(q, kc, vc, slots, 32**-0.5)
    k, v = (_context(slots, c)[None].expand(rows, -1, -1, -1) for c in (kc, vc))
    want, want_lse = _exact(q, k, v)
    assert (out.double() - want).abs().max() < 1e-5
    assert (lse.double() - want_lse).abs().max() < 1e-5


def _shared_and_own(
    gen: torch.Generator, rows: int, prefix_blocks: int, own: list[int], blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tables of rows that share their first ``prefix_blocks`` blocks, then own[r] slots each in blocks of
    their own: (full tables, each row's whole context length, the prefix's slots)."""
    order = torch.randperm(blocks, generator=gen)
    width = prefix_blocks + -(-max(own) // BS)
    tables = torch.zeros(rows, width, dtype=torch.long)
    tables[:, :prefix_blocks] = order[:prefix_blocks]
    free = prefix_blocks
    for r, n in enumerate(own):
        mine = -(-n // BS)
        tables[r, prefix_blocks : prefix_blocks + mine] = order[free : free + mine]
        free += mine
    lens = torch.tensor(own) + prefix_blocks * BS
    slots = (order[:prefix_blocks, None] * BS + torch.arange(BS)).reshape(-1)
    return tables, lens, slots


@needs_bf16
@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float8_e4m3fn)],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
def test_prefix_then_own_slots_equals_each_row_walking_its_whole_context(
    heads: int, kv_heads: int, q_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The merge: the prefix's result (from flash_prefix) and each row's own slots after it give the attention over
    the whole context, as the plain row kernel computes it (rows with 1 to 30 slots of their own)."""
    prefix = prefix_bf16 if q_dtype == torch.bfloat16 else prefix_fp32
    assert after is not None and plain is not None and prefix is not None
    gen = torch.Generator().manual_seed(heads + kv_heads)
    rows, prefix_blocks, dim = 9, 12, 64
    own = [1, 30, 7, 8, 9, 2, 16, 17, 5]
    kc, vc = _caches(gen, 64, kv_heads, dim, cache_dtype)
    tables, lens, slots = _shared_and_own(gen, rows, prefix_blocks, own, 64)
    q = (torch.randn(rows, heads, dim, generator=gen) * 2).to(q_dtype)
    scale = dim**-0.5
    out, lse = prefix(q, kc, vc, slots, scale)
    got = after(q, kc, vc, tables[:, prefix_blocks:].contiguous(), lens - prefix_blocks * BS, scale, out, lse)
    assert got.dtype == q_dtype and got.shape == q.shape
    ctx = int(lens.max())
    pos = torch.arange(ctx)
    full = (tables[:, pos // BS] * BS + pos % BS).clamp(max=kc.shape[0] * BS - 1)
    for r in range(rows):  # each row's exact attention over its own context
        n = int(lens[r])
        k, v = (_context(full[r, :n], c).to(q_dtype)[None] for c in (kc, vc))
        want, _ = _exact(q[r : r + 1], k, v)
        err = (got[r : r + 1].double() - want).abs()
        if q_dtype == torch.float32:
            assert err.max() < 1e-5
        else:  # two bf16 roundings: the probabilities (prefix) and the output
            assert bool((err <= 2 * _bound(q[r : r + 1], k, v)).all())
    ref = plain(q, kc, vc, tables, lens, scale)  # and the plain kernel agrees within the same tolerance
    assert (got.float() - ref.float()).abs().max() < (1e-5 if q_dtype == torch.float32 else 2e-2)


@needs_bf16
def test_bad_prefix_arguments_are_refused_with_a_message() -> None:
    assert after is not None and prefix_bf16 is not None
    gen = torch.Generator().manual_seed(0)
    kc, vc = _caches(gen, 8, 2, 32, torch.bfloat16)
    q = torch.randn(3, 4, 32).to(torch.bfloat16)
    tables = torch.tensor([[1], [2], [3]])
    out, lse = prefix_bf16(q, kc, vc, torch.arange(8), 32**-0.5)
    with pytest.raises(RuntimeError, match="prefix_out \\[B, H, D\\] and prefix_lse \\[B, H\\] in fp32"):
        after(q, kc, vc, tables, torch.tensor([1, 1, 1]), 0.2, out.bfloat16(), lse)
    with pytest.raises(RuntimeError, match="prefix_out \\[B, H, D\\] and prefix_lse \\[B, H\\] in fp32"):
        after(q, kc, vc, tables, torch.tensor([1, 1, 1]), 0.2, out, lse[:2])
    with pytest.raises(RuntimeError, match="at least one slot after the prefix"):
        after(q, kc, vc, tables, torch.tensor([1, 0, 1]), 0.2, out, lse)
    with pytest.raises(RuntimeError, match="queries after start < ctx"):  # an empty prefix
        prefix_bf16(q, kc, vc, torch.arange(0), 32**-0.5)


def _kernel_steps(llm: LLM) -> list[KernelAttentionMetadata]:
    """Records every step's kernel-path metadata as the runner prepares it."""
    metas: list[KernelAttentionMetadata] = []
    prepare = llm.engine.runner.prepare

    def recording(batch):  # type: ignore[no-untyped-def]
        prep = prepare(batch)
        assert isinstance(prep.meta, KernelAttentionMetadata)
        metas.append(prep.meta)
        return prep

    llm.engine.runner.prepare = recording  # type: ignore[method-assign]
    return metas


@needs_bf16
@pytest.mark.parametrize("model", ["mini", "mini-gqa"])
def test_requests_after_one_document_decode_through_the_cascade_within_rounding_of_the_reference(
    model: str, monkeypatch
) -> None:
    """Ten requests after one cached 200-token document: from the step they all decode, their rows share its full
    blocks (the engine's tables, not a hand-made one) and go through the cascade, and the tokens stay within bf16
    rounding of the same engine whose rows walk their whole contexts (that one is held to the reference path by
    test_paged_kernel.py; the random mini models have near-ties that either bf16 path may break its own way). The
    mini model's 512 positions cannot hold CASCADE_MIN_SLOTS shared slots, so the threshold is lowered here; it is
    a cost rule, not a correctness one."""
    monkeypatch.setattr(runner, "CASCADE_MIN_SLOTS", 64)
    rng = random.Random(7)
    document = [rng.randrange(256) for _ in range(200)]
    prompts = [document + [rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    knobs: dict[str, Any] = {"block_size": 16, "dtype": "bfloat16"}
    llm = LLM(model, attention_backend="cpp", **knobs)
    assert llm.engine.runner.cascade is not None
    metas = _kernel_steps(llm)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    # Every step whose kernel rows are the ten requests' decode tokens goes through the cascade (so may a step of
    # the questions' short chunks, each query a kernel row after the document).
    decoding = [m for m in metas if m.row_block_tables.shape[0] == len(prompts) and not m.prefills]
    assert len(decoding) >= 6 and all(m.shared is not None for m in decoding)
    cascaded = [(m, m.shared) for m in metas if m.shared is not None]
    for m, shared in cascaded:
        assert m.row_block_tables.shape[0] >= runner.CASCADE_MIN_ROWS
        assert shared.slots.numel() == 200 // 16 * 16  # the document's full blocks, all of them
        assert bool((shared.context_lens >= 1).all())
        assert torch.equal(shared.context_lens + shared.slots.numel(), m.row_context_lens)
    rows_only = LLM(model, attention_backend="cpp", **knobs)
    rows_only.engine.runner.cascade = None
    refs = [r.outputs[0] for r in rows_only.generate(prompts, params, use_tqdm=False)]
    assert_bf16_paths_agree(outs, refs)


@needs_bf16
def test_the_cascade_stays_out_below_its_rows_and_in_fp32(monkeypatch) -> None:
    """Fewer rows than CASCADE_MIN_ROWS walk their contexts row by row; an fp32 engine has no cascade (its flash
    loop's tiles are 16 queries of one head: measured slower than the rows below 16 of them)."""
    monkeypatch.setattr(runner, "CASCADE_MIN_SLOTS", 64)
    rng = random.Random(8)
    document = [rng.randrange(256) for _ in range(200)]
    prompts = [document + [rng.randrange(256)] for _ in range(runner.CASCADE_MIN_ROWS - 1)]
    llm = LLM("mini", attention_backend="cpp", block_size=16, dtype="bfloat16")
    metas = _kernel_steps(llm)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert metas and all(m.shared is None for m in metas)
    assert cascade_kernels(torch.float32) is None
    assert LLM("mini", attention_backend="cpp").engine.runner.cascade is None
