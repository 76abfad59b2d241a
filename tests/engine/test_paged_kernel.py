"""The compiled in-place paged decode kernel against the reference gather + SDPA, and end to end against the
dense oracle. Tolerances: 1e-5 with fp32 queries (fp32 sums in another order; a bf16 cache is widened to fp32
exactly on both sides), 1e-2 with bf16 queries (the output is rounded to bf16: 2^-8 relative, outputs ~1)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlab import LLM, SamplingParams
from kvlab.attention.kernels import KERNEL_HEAD_DIMS, kv_write_kernel, paged_attention_kernel, paged_decode_ops
from kvlab.attention.paged import decode_attention
from kvlab.config import ConfigError
from kvlab.kv import KVStorage
from kvlab.model.loader import LoadedModel
from kvlab.model.mini import build_mini, mini_config
from kvlab.tokenizer import ByteTokenizer
from oracle_cache import assert_bf16_paths_agree, check_against_oracle, mini

kernel = paged_attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain: the reference attention serves")


def gathered_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference in fp32 on the very values the kernel read (a bf16 or fp8 cache widened exactly): each row's
    context gathered through its table and attended by SDPA; with the gathered V (the largest |V| bounds errors)."""
    bs, kv_heads, dim = k.shape[1:]
    pos = torch.arange(int(lens.max()))
    slots = tables[:, pos // bs] * bs + pos % bs
    kc, vc = k.float().view(-1, kv_heads, dim)[slots], v.float().view(-1, kv_heads, dim)[slots]
    mask = torch.where(pos[None, :] >= lens[:, None], float("-inf"), 0.0)[:, None, None, :]
    return decode_attention(q.float(), kc, vc, mask), vc


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype", "tolerance"),
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.bfloat16, torch.bfloat16, 1e-2),
        (torch.bfloat16, torch.float32, 1e-2),
        (torch.float32, torch.float8_e4m3fn, 1e-5),
        (torch.bfloat16, torch.float8_e5m2, 1e-2),
    ],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("dim", KERNEL_HEAD_DIMS)  # each is its own compiled loop
def test_kernel_equals_gather_and_sdpa(
    heads: int, kv_heads: int, dim: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, tolerance: float
) -> None:
    assert kernel is not None
    gen = torch.Generator().manual_seed(heads + dim)
    num_blocks, bs, batch = 160, 8, 6
    k = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(cache_dtype)
    v = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(cache_dtype)
    # A lone token, partial blocks, whole ones, and a context that spans 24 scattered blocks; the next
    # request's blocks are prefetched while one computes, so neighbours of every length follow each other.
    lens = torch.tensor([1, 9, 31, 64, 2, 190])
    tables = torch.randperm(num_blocks, generator=gen)[: batch * 24].view(batch, 24)
    q = torch.randn(batch, heads, dim, generator=gen).to(q_dtype)
    got = kernel(q, k, v, tables, lens, dim**-0.5)
    assert got.dtype == q_dtype
    want, _ = gathered_reference(q, k, v, tables, lens)
    assert (got.float() - want).abs().max() < tolerance


def test_engine_with_the_kernel_matches_the_oracle_and_the_reference() -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(mini(), attention_backend="cpp", block_size=8)
    assert llm.engine.runner.attention_kernel is not None
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(mini(), block_size=8).generate(prompts, params, use_tqdm=False)
    for p, o, r in zip(prompts, outs, ref, strict=True):
        assert check_against_oracle("mini", tuple(p), 12, tuple(o.token_ids))
        assert o.token_ids == r.token_ids
    with pytest.raises(ConfigError, match="attention_backend"):
        LLM(mini(), attention_backend="flash")


def test_the_kernel_steps_aside_where_it_does_not_apply() -> None:
    assert LLM(mini(), attention_backend="cpp", layout="HND").engine.runner.attention_kernel is None
    odd = dataclasses.replace(mini_config(), num_heads=16, num_kv_heads=16, head_dim=8)  # a head size it lacks
    loaded = LoadedModel("mini-head8", build_mini(odd), ByteTokenizer())
    llm = LLM(loaded, attention_backend="cpp", block_size=8)
    assert llm.engine.runner.attention_kernel is None
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids) == 4
    assert LLM(mini(), attention_backend="cpp", kv_cache_dtype="bfloat16").engine.runner.attention_kernel is not None


@pytest.mark.parametrize("bs", [1, 5, 16, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("dim", KERNEL_HEAD_DIMS)
def test_bf16_queries_over_a_bf16_cache_at_every_block_shape(heads: int, kv_heads: int, dim: int, bs: int) -> None:
    """bf16 queries over a bf16 cache take bf16 pairs (AVX512-BF16's vdpbf16ps, where the CPU has it): 16 slots'
    scores summed by one shuffle tree where a block holds 16 whole slots and one by one after them, V two slots a
    product with a block's odd last slot alone. Every block shape of that walk -- one slot a block, odd blocks (a
    lone slot in each), 16 and 32 -- at lengths around 16 and 32, against the fp32 reference on the values the kernel
    read, each output within what its two roundings allow: the output's own to bf16 (half an ulp, <= 2^-8 of it) and
    the weights' before the product with V (2^-9 each, so <= 2^-9 of the largest |V|; stated as 2^-8). Measured: the
    output's rounding is the whole error. A lone token's output is its own V."""
    assert kernel is not None
    gen = torch.Generator().manual_seed(heads * bs + dim)
    lens = torch.tensor([1, 2, 15, 16, 17, 31, 33, 100])
    per_row = -(-int(lens.max()) // bs)
    num_blocks = len(lens) * per_row + 3
    k = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_row].view(len(lens), per_row)
    q = (torch.randn(len(lens), heads, dim, generator=gen) * 2).to(torch.bfloat16)  # peaked softmaxes too
    got = kernel(q, k, v, tables, lens, dim**-0.5)
    want, vc = gathered_reference(q, k, v, tables, lens)
    assert ((got.float() - want).abs() <= 2**-8 * (want.abs() + vc.abs().max())).all()
    lone = v.view(-1, kv_heads, dim)[tables[0, 0] * bs].repeat_interleave(heads // kv_heads, dim=0)
    assert torch.equal(got[0], lone)


def test_engine_with_the_kernel_on_a_bf16_cache_equals_its_reference_path() -> None:
    """fp32 compute over a bf16 cache: both paths widen the same stored values, so greedy tokens are equal."""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    knobs = {"kv_cache_dtype": "bfloat16", "block_size": 8}
    fast = LLM("mini", attention_backend="cpp", **knobs)
    assert fast.engine.runner.attention_kernel is not None
    outs = fast.generate(prompts, params, use_tqdm=False)
    ref = LLM("mini", **knobs).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_bf16_engine_with_the_kernel_stays_within_rounding_of_its_reference_path() -> None:
    """bf16 compute: the kernel accumulates in fp32 where SDPA's bf16 path rounds, so the two may part at a
    near-tie later on. Stated: the first decode token is the same for every prompt, and every token both
    paths chose has a log-probability within 0.05 (measured: at most 0.017)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    fast = LLM("mini", dtype="bfloat16", attention_backend="cpp", block_size=8)
    assert fast.engine.runner.attention_kernel is not None
    outs = [o.outputs[0] for o in fast.generate(prompts, params, use_tqdm=False)]
    refs = [r.outputs[0] for r in LLM("mini", dtype="bfloat16", block_size=8).generate(prompts, params, use_tqdm=False)]
    assert_bf16_paths_agree(outs, refs)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fp8=st.sampled_from([None, torch.float8_e4m3fn, torch.float8_e5m2]),  # None: a cache in the tokens' dtype
    kv_heads=st.sampled_from([1, 3, 4]),
    dim=st.sampled_from([16, 64]),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
# SmolLM2's rows (3 x 64 bf16, 384 bytes) past the 341 one thread copies alone, so that the threads split them.
@example(tokens=700, dtype=torch.bfloat16, fp8=None, kv_heads=3, dim=64, threads=2, seed=0)
@example(tokens=700, dtype=torch.bfloat16, fp8=torch.float8_e4m3fn, kv_heads=3, dim=64, threads=2, seed=0)
def test_the_compiled_kv_write_stores_what_storage_write_stores(
    tokens: int, dtype: torch.dtype, fp8: torch.dtype | None, kv_heads: int, dim: int, threads: int, seed: int
) -> None:
    """K and V as the fused projection hands them over (views into one wider row per token), at scattered slots,
    on 1 to 3 threads, copied or rounded into an fp8 cache: the same cache bits as ``KVStorage.write``, in K and in
    V, and nothing else written."""
    write = kv_write_kernel()
    assert write is not None
    gen = torch.Generator().manual_seed(seed)
    q_width = 32
    ref, got = (KVStorage(2, 64, 16, kv_heads, dim, dtype=fp8 or dtype) for _ in range(2))
    for store in (ref, got):  # earlier contents the write must leave alone
        for cache in (*store.k_cache, *store.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed + 1)))
    kv = kv_heads * dim
    rows = torch.randn(tokens, q_width + 2 * kv, generator=gen).to(dtype)
    k = rows[:, q_width : q_width + kv].view(tokens, kv_heads, dim)
    v = rows[:, q_width + kv :].view(tokens, kv_heads, dim)
    slots = torch.randperm(ref.num_slots, generator=gen)[:tokens]
    ref.write(1, slots, k, v)
    before = torch.get_num_threads()  # the suite runs on one (conftest.py)
    torch.set_num_threads(threads)
    try:
        write(got.k_cache[1], got.v_cache[1], slots, k, v)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(ref.k_cache + ref.v_cache, got.k_cache + got.v_cache, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_compiled_kv_write_refuses_bad_input_before_writing_anything() -> None:
    write = kv_write_kernel()
    assert write is not None
    store = KVStorage(1, 4, 8, 3, 16, dtype=torch.bfloat16)
    k_cache, v_cache = store.k_cache[0], store.v_cache[0]
    k = v = torch.ones(3, 3, 16, dtype=torch.bfloat16)
    for bad in (store.num_slots, -1):
        # The bad slot comes last: a loop that wrote while it checked would have stored the first two.
        with pytest.raises(RuntimeError, match=f"slot {bad} of token 2 outside"):
            write(k_cache, v_cache, torch.tensor([0, 5, bad]), k, v)
        assert not k_cache.any() and not v_cache.any()
    with pytest.raises(RuntimeError, match="in the caches' dtype, or fp32 / bf16 into fp8"):
        write(k_cache, v_cache, torch.tensor([0, 1, 2]), k.float(), v.float())
    with pytest.raises(RuntimeError, match="in the caches' dtype, or fp32 / bf16 into fp8"):
        write(k_cache, v_cache, torch.tensor([0, 1, 2]), k, v.float())
    with pytest.raises(RuntimeError, match="heads contiguous"):
        write(k_cache, v_cache, torch.tensor([0, 1, 2]), k.transpose(0, 1), v.transpose(0, 1))
    with pytest.raises(RuntimeError, match="one a token"):
        write(k_cache, v_cache, torch.tensor([0, 1]), k, v)
    assert not k_cache.any() and not v_cache.any()


def test_the_kernel_path_writes_kv_through_the_compiled_write_once_a_layer() -> None:
    """Where the new K/V come in the cache's dtype (fp32 over fp32 here), every layer of every step stores them
    through the compiled write, each layer at the step's same slots, and the tokens are the reference path's; over
    a cache of another dtype (fp32 compute, bf16 cache) the cast stays with ``KVStorage.write``."""
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fast = LLM("mini", attention_backend="cpp", block_size=8)
    runner = fast.engine.runner
    assert runner.kv_write is not None
    calls: list[list[int]] = []
    real = runner.kv_write

    def counted(k_cache, v_cache, slots, k, v) -> None:
        calls.append(slots.tolist())
        real(k_cache, v_cache, slots, k, v)

    runner.kv_write = counted
    outs = fast.generate(prompts, params, use_tqdm=False)
    ref = LLM("mini", block_size=8).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    layers = fast.engine.model.config.num_layers
    # Every token of the run (the prompts, then each decode token but the last) written once in each layer: the
    # calls come a step at a time, one a layer, all at the step's slots.
    assert len(calls) % layers == 0
    steps = [calls[i : i + layers] for i in range(0, len(calls), layers)]
    assert all(step == [step[0]] * layers for step in steps)
    assert sum(len(step[0]) for step in steps) == sum(len(p) + 5 for p in prompts)
    assert LLM("mini", attention_backend="cpp", kv_cache_dtype="bfloat16").engine.runner.kv_write is None


def test_the_kernel_is_labelled_in_profiles_only() -> None:
    """The pybind op shows as ``kvlab::paged_decode`` in ``bench step --profile``; outside a profiler the label
    is not put on (it would cost ~6 us a layer)."""
    from kvlab.bench.modes import Mode
    from kvlab.bench.studies.step import profile_decode

    table = profile_decode(mini(), batch=2, context=12, steps=2, mode=Mode(attention_backend="cpp"))
    assert "kvlab::paged_decode" in table
    assert not torch.autograd._profiler_enabled()


def test_prefill_chunks_run_through_the_kernel_and_match_the_oracle() -> None:
    """Chunked prefill (16-token budget) over prompts sharing cached prefixes, without the flash kernel (which would
    take every prompt query): every chunk runs as kernel rows, each query seeing its cached prefix and the chunk's
    earlier tokens; greedy tokens equal the dense oracle's (up to its stated near-ties) and the reference path's."""
    rng = random.Random(5)
    system = [rng.randrange(256) for _ in range(40)]
    prompts = [system + [rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    prompts += [[rng.randrange(256) for _ in range(rng.randrange(2, 50))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    knobs = {"block_size": 8, "max_num_batched_tokens": 16}
    llm = LLM(mini(), attention_backend="cpp", **knobs)
    llm.engine.runner.flash_kernel = None
    kernel_op = llm.engine.runner.attention_kernel
    assert kernel_op is not None
    chunk_rows: list[int] = []

    def recording(q, kc, vc, tables, lens, scale):  # type: ignore[no-untyped-def]
        # Rows of one request in a chunk read a growing context: consecutive lengths 1 apart.
        chunk_rows.append(int((lens[1:] == lens[:-1] + 1).sum()) if lens.numel() > 1 else 0)
        return kernel_op(q, kc, vc, tables, lens, scale)

    llm.engine.runner.attention_kernel = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert max(chunk_rows) > 0  # prefill queries did run as kernel rows
    ref = LLM(mini(), **knobs).generate(prompts, params, use_tqdm=False)
    for p, o, r in zip(prompts, outs, ref, strict=True):
        check_against_oracle("mini", tuple(p), 10, tuple(o.token_ids))
        assert o.token_ids == r.token_ids


@pytest.mark.parametrize("with_flash", [False, True])
def test_long_chunks_go_to_a_tiled_kernel_beside_kernel_rows_and_match_the_oracle(with_flash: bool) -> None:
    """A long document prefilled in chunks while other requests decode: chunks of many queries over a long context
    are prefill segments (kvlab's flash kernel, or without it gather + SDPA's tiled kernel, each by its rule),
    decode tokens and short chunks stay kernel rows, in the same steps; greedy tokens equal the dense oracle's and
    the reference path's."""
    from kvlab.attention.paged import KernelAttentionMetadata, tiled_queries

    rng = random.Random(11)
    document = [rng.randrange(256) for _ in range(400)]
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 12))] for _ in range(3)]
    prompts += [document + [rng.randrange(256) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    knobs = {"block_size": 8, "max_num_batched_tokens": 192}
    llm = LLM(mini(), attention_backend="cpp", **knobs)
    if not with_flash:
        llm.engine.runner.flash_kernel = None
    flash = llm.engine.runner.flash_kernel is not None
    if with_flash and not flash:
        pytest.skip("no flash kernel on this CPU")
    metas: list[KernelAttentionMetadata] = []
    prepare = llm.engine.runner.prepare
    decode_rows_beside_segments = 0

    def recording(batch):  # type: ignore[no-untyped-def]
        nonlocal decode_rows_beside_segments
        prep = prepare(batch)
        assert isinstance(prep.meta, KernelAttentionMetadata)
        metas.append(prep.meta)
        # Each chunk is where the rule puts it: its first tiled_queries queries a segment, the rest kernel rows.
        segments = {seg.row_start: seg.row_end for seg in prep.meta.prefills}
        kernel_rows = set(range(prep.input_ids.numel())) if prep.meta.rows is None else set(prep.meta.rows.tolist())
        row = 0
        for e in (e for e in batch.scheduled if e.num_tokens):
            n = e.num_tokens
            tiled = tiled_queries(e.start, n, e.request.num_prompt_tokens, torch.float32, flash)
            if tiled:
                assert segments.get(row) == row + tiled
            assert set(range(row + tiled, row + n)) <= kernel_rows
            decode_rows_beside_segments += n == 1 and not tiled and bool(segments)
            row += n
        return prep

    llm.engine.runner.prepare = recording  # type: ignore[method-assign]
    outs = llm.generate(prompts, params, use_tqdm=False)
    mixed = [m for m in metas if m.prefills and m.rows is not None and m.rows.numel()]
    assert mixed and decode_rows_beside_segments  # steps with decode tokens as kernel rows beside a segment
    for m in metas:
        covered = (m.rows.tolist() if m.rows is not None else list(range(m.slot_mapping.numel()))) + [
            r for seg in m.prefills for r in range(seg.row_start, seg.row_end)
        ]
        assert sorted(covered) == list(range(m.slot_mapping.numel()))  # every row in exactly one place
        assert (m.flash is not None) == (flash and bool(m.prefills))
    ref = LLM(mini(), **knobs).generate(prompts, params, use_tqdm=False)
    for p, o, r in zip(prompts, outs, ref, strict=True):
        check_against_oracle("mini", tuple(p), 8, tuple(o.token_ids))
        assert o.token_ids == r.token_ids


def test_whole_prompts_in_one_step_run_through_the_kernel() -> None:
    """Fresh prompts of different lengths prefilled in one step (no chunking): each prompt's rows read its own
    table with causal lengths; tokens equal the reference path's."""
    rng = random.Random(8)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 70, 1, 150, 33)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = LLM(mini(), attention_backend="cpp", block_size=16).generate(prompts, params, use_tqdm=False)
    ref = LLM(mini(), block_size=16).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_without_a_compiler_the_reference_serves_after_one_log_line(monkeypatch, caplog) -> None:
    """Where the C++ ops cannot be built (no compiler, ninja or headers), ``cpp`` runs the reference paths: one
    warning per op set, the same tokens, nothing raised."""
    import logging

    from torch.utils import cpp_extension

    from kvlab.model.fused import FusedMLP, fused_ops

    def no_compiler(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    paged_decode_ops.cache_clear()
    fused_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvlab.native"):
            llm = LLM(mini(), attention_backend="cpp", block_size=8)
            again = LLM(mini(), attention_backend="cpp", block_size=8)  # the failure is remembered, not retried
        assert llm.engine.runner.attention_kernel is None and again.engine.runner.attention_kernel is None
        assert not isinstance(llm.engine.model.layers[0].mlp, FusedMLP)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        fallbacks = [w for w in warnings if "using the reference" in w]  # a build notice may precede each
        assert len(fallbacks) == 2 and all("no C++ compiler found" in w for w in fallbacks)
        prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == [o.token_ids for o in LLM(mini(), block_size=8).generate(prompts, params, use_tqdm=False)]
    finally:
        monkeypatch.undo()
        paged_decode_ops.cache_clear()  # later tests load the real ops again (from torch's disk cache)
        fused_ops.cache_clear()


def test_a_build_says_what_it_builds_and_that_it_happens_once(monkeypatch, caplog, tmp_path) -> None:
    """The first run with the compiled kernels sat at 0/50 for a minute while C++ built, with no word; a build
    (nothing in the extension cache) now logs what it builds, once, and where it is cached; a load does not."""
    import logging

    from torch.utils import cpp_extension

    from kvlab import native

    calls: list[str] = []

    def fake_build(name: str, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(name)
        out = tmp_path / "ext" / name
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.so").write_bytes(b"")  # what torch leaves behind: the next call finds it cached
        return object()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpp_extension, "load_inline", fake_build)
    with caplog.at_level(logging.INFO, logger="kvlab.native"):
        assert native.build("kvlab_probe_op", "", [], "the test op set") is not None
        assert native.build("kvlab_probe_op", "", [], "the test op set") is not None
    builds = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(calls) == 2 and len(builds) == 1
    assert "building the test op set for this CPU and torch: once" in builds[0] and str(tmp_path / "ext") in builds[0]
    # Without TORCH_EXTENSIONS_DIR the guess is torch's own folder, where the real kernels are cached.
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    guess = native._build_directory(cpp_extension.get_default_build_root(), "x")
    assert guess.parent.name.endswith("_cpu") and guess.parent.parent == Path(cpp_extension.get_default_build_root())


def test_a_build_lock_left_by_a_dead_builder_is_cleared(tmp_path, caplog) -> None:
    """torch waits for ever on a build lock whose holder died (a fuzz worker killed mid-load hung whole test
    runs). kvlab's own flock is released by the kernel when its holder dies: a process that gets it removes the
    torch lock it finds (its holder is dead), and a second process waits for the first, never for a dead one."""
    import logging
    import multiprocessing
    import os
    import signal

    from kvlab import native

    lock = tmp_path / "lock"
    lock.write_text("")
    with caplog.at_level(logging.WARNING, logger="kvlab.native"), native.builder_lock(tmp_path):
        assert not lock.exists()
    assert "left behind when it died" in caplog.text
    # A holder killed inside the lock: the next one gets it at once (the kernel released it) and clears the file.
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_hold_and_wait, args=(tmp_path, ready))
    child.start()
    assert ready.wait(30)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert lock.exists()  # what the killed holder left
    with native.builder_lock(tmp_path):
        assert not lock.exists()


def _hold_and_wait(where, ready) -> None:
    from kvlab import native

    with native.builder_lock(where):
        (where / "lock").write_text("")  # as torch's baton would be, mid-build
        ready.set()
        import time

        time.sleep(60)


def test_the_cache_key_follows_the_source_torch_the_python_abi_and_the_cpu(monkeypatch) -> None:
    """A build is found again only by what made it: another source, torch, Python ABI or CPU is another name."""
    import sys

    from kvlab import native

    base = native.cache_key("int f() { return 1; }")
    assert native.cache_key("int f() { return 1; }") == base
    assert native.cache_key("int f() { return 2; }") != base
    monkeypatch.setattr(native.torch, "__version__", "2.12.0+cpu")
    assert native.cache_key("int f() { return 1; }") != base
    monkeypatch.undo()
    monkeypatch.setattr(sys, "abiflags", sys.abiflags + "t")  # a free-threaded build of the same Python
    assert native.cache_key("int f() { return 1; }") != base
    monkeypatch.undo()
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : fpu sse2")
    assert native.cache_key("int f() { return 1; }") != base


def test_another_venvs_build_never_silences_the_build_line(monkeypatch, caplog, tmp_path) -> None:
    """In a fresh venv `kvlab fuzz` sat silent for 5 minutes rebuilding: a .so of the same name from another venv
    (another torch) was in the cache, so the build line was not printed while torch rebuilt. The name now
    carries the key, so that build is another module's: the line comes first, then the build."""
    import logging

    from torch.utils import cpp_extension

    from kvlab import native

    ext = tmp_path / "ext"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    monkeypatch.setattr(native.torch, "__version__", "2.12.0+cpu")  # the other venv's torch
    theirs = f"kvlab_probe_op_{native.cache_key('int f();')}"
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    (ext / theirs).mkdir(parents=True)
    (ext / theirs / f"{theirs}.so").write_bytes(b"")
    events: list[str] = []

    def fake_build(name: str, **kwargs):  # type: ignore[no-untyped-def]
        events.append(f"compile {name}")
        return object()

    monkeypatch.setattr(cpp_extension, "load_inline", fake_build)
    monkeypatch.setattr(caplog.handler, "emit", lambda record: events.append(f"log {record.getMessage()}"))
    with caplog.at_level(logging.WARNING, logger="kvlab.native"):
        assert native.build("kvlab_probe_op", "int f();", [], "the test op set") is not None
    ours = f"kvlab_probe_op_{native.cache_key('int f();')}"
    assert ours != theirs
    assert events[0].startswith("log building the test op set") and events[1] == f"compile {ours}", events


def test_every_op_set_is_a_csrc_file_with_the_prelude_in_place() -> None:
    from kvlab import native

    files = sorted(p.name for p in native.CSRC.glob("*.cpp"))
    assert files == [
        "bf16_linear.cpp",
        "flash_prefill.cpp",
        "fp32_linear.cpp",
        "fused.cpp",
        "int8_linear.cpp",
        "paged_decode.cpp",
    ]
    for name in files:
        text = native.source(name)
        assert native.PRELUDE_INCLUDE not in text and "#pragma once" not in text
    for name in files:  # the prelude, in place: every op set shares its vector loads or its linears' scheduler
        assert "CPU_CAPABILITY_AVX512" in native.source(name) and "for_each_block_run" in native.source(name)
