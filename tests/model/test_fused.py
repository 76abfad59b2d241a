"""The fused CPU ops (residual add + RMSNorm, RoPE, SiLU * up) against the reference modules they stand in for.

Tolerances: fp32 within 1e-5 of the reference, relative to the values' scale (another summation order; the
reference rounds the same products). bf16: within 2^-7 relative, one bf16 rounding (the reference rounds after
every op, the fused ops once at the end), and most elements exactly equal.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlab import LLM, SamplingParams
from kvlab.model.fused import FusedAttention, FusedMLP, FusedRMSNorm, compiled_topk, fused_model, fused_ops
from kvlab.model.llama import MLP, Attention, DecoderLayer, LlamaModel, RMSNorm, RotaryEmbedding
from kvlab.model.mini import build_mini, mini_config
from kvlab.model.packed import with_packed_linears
from oracle_cache import check_against_oracle

pytestmark = pytest.mark.skipif(fused_ops() is None, reason="no C++ toolchain: the reference ops serve")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    scale = want.float().abs().max().clamp_min(1.0)
    assert ((got.float() - want.float()).abs().max() / scale).item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])  # one request, a decode batch, a prefill split over threads
def test_add_rms_norm_equals_add_then_norm(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
    norm = norm.to(dtype)
    fused = FusedRMSNorm(576, 1e-5).to(dtype)
    fused.load_state_dict(norm.state_dict())
    h = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    with torch.inference_mode():
        want_h, want_x = norm.add_norm(h, delta)
        got_h, got_x = fused.add_norm(h.clone(), delta)
        # The residual add rounds exactly as h + delta does.
        assert torch.equal(got_h, want_h)
        close(got_x, want_x, dtype)
        # Without a delta the stream is only read.
        plain = h.clone()
        close(fused(plain), norm(h), dtype)
        assert torch.equal(plain, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 32), (9, 3, 64), (8, 1, 128)])
def test_rope_in_place_equals_the_reference_rotation(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    cfg = dataclasses.replace(
        mini_config(), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, hidden_size=heads * dim
    )
    ref, fused = Attention(cfg), FusedAttention(cfg)
    rows = 21
    gen = torch.Generator().manual_seed(dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    cos, sin = RotaryEmbedding(dim, 10000.0)(torch.arange(rows) * 37, dtype)
    with torch.inference_mode():
        want_q, want_k = ref.rope(qkv, cos, sin)
        buf = qkv.clone()
        got_q, got_k = fused.rope(buf, cos, sin)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)
    # V, behind Q and K in the same buffer, is untouched.
    assert torch.equal(buf[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_silu_times_up(dtype: torch.dtype) -> None:
    cfg = mini_config()
    gate_up = (torch.randn(40, 2 * cfg.intermediate_size, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    with torch.inference_mode():
        close(FusedMLP(cfg).act(gate_up), MLP(cfg).act(gate_up), dtype)


def test_the_fused_twin_shares_weights_and_leaves_the_model_alone() -> None:
    model = build_mini(mini_config())
    twin = fused_model(model)
    assert isinstance(twin, LlamaModel) and twin is not model
    assert twin.layers[0].input_layernorm.weight is model.layers[0].input_layernorm.weight
    assert type(twin.layers[0].self_attn) is FusedAttention and type(model.layers[0].self_attn) is Attention
    assert fused_model(model) is twin  # remembered
    # A twin of a packed twin shares its packed weights too (a copy would double the resident linears).
    packed = with_packed_linears(model)
    fused_packed = fused_model(packed)
    assert fused_packed.layers[0].mlp.gate_up_proj.packed is packed.layers[0].mlp.gate_up_proj.packed
    assert type(fused_packed.layers[0].mlp) is FusedMLP and fused_model(packed) is fused_packed
    with torch.no_grad():
        model.norm.weight.mul_(1.0)  # an in-place write: the remembered twin is stale, a new one is built
    assert fused_model(model) is not twin
    half = build_mini(mini_config(), dtype=torch.float16)  # a dtype the ops lack: served by the model itself
    assert fused_model(half) is half


@pytest.mark.parametrize(
    ("dtype", "quantization", "packed"),
    [
        (torch.float32, None, False),
        (torch.bfloat16, None, False),
        (torch.float32, None, True),
        (torch.bfloat16, None, True),
        (torch.float32, "int8-w8a8", False),
        (torch.bfloat16, "int8-w8a8", False),
    ],
)
@pytest.mark.parametrize("lengths", [[37, 13], [7]])  # past and within the small-batch kernels' rows
def test_the_fused_models_layer_loop_gives_the_module_paths_bits(
    dtype: torch.dtype, quantization: str | None, packed: bool, lengths: list[int], monkeypatch
) -> None:
    """``FusedLlamaModel`` (the ``cpp`` mode's model, ``engine_model``) runs its layers as one loop over the fused
    ops and each linear's bare call (oneDNN's packed product, the small-batch kernels, int8-w8a8's VNNI kernel) or
    the linear module (plain ``nn.Linear``): its hidden states are bitwise those of the module path
    (``LlamaModel.forward`` over the same modules), fp32 and bf16, dense, packed and int8-w8a8, a batch of two
    sequences and one of a few rows. A linear with a bare call is never called as a module in the loop; a
    profiler running, the modules run, so that their labelled calls show."""
    from kvlab.config import ModeConfig
    from kvlab.model import int8_linear, load_model
    from kvlab.model.attention_api import DenseCausalAttention
    from kvlab.model.fused import FusedLlamaModel
    from kvlab.model.modes import engine_model
    from kvlab.model.packed import PackedLinear, packable_dtype
    from kvlab.model.quant import W8A8Linear

    if fused_ops() is None:
        pytest.skip("no C++ toolchain: no fused ops")
    loaded = load_model("mini-gqa", seed=3, dtype=dtype)
    mode = ModeConfig(quantization=quantization, attention_backend="cpp", packed_weights=packed)
    model = engine_model(loaded, mode)
    assert type(model) is FusedLlamaModel
    cfg = loaded.config
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(n) for n in lengths])
    dense = DenseCausalAttention([0, *itertools.accumulate(lengths)], cfg.num_heads)
    layers_seen: list[int] = []

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layers_seen.append(layer)  # dense attention ignores the index; the paged cache does not
        return dense(layer, q, k, v)

    bare = {type(m) for m in model.modules() if (make := getattr(m, "kernel_call", None)) and make() is not None}
    assert any(issubclass(c, PackedLinear) for c in bare) == (packed and packable_dtype(dtype))  # oneDNN's bf16
    if quantization is not None and int8_linear.vnni_kernel_ready():
        assert W8A8Linear in bare
    if not packed and quantization is None:
        assert bare == set()  # plain nn.Linear: the loop calls the modules
    module_calls: list[type] = []
    for cls in bare:
        forward = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, x, f=forward: module_calls.append(type(self)) or f(self, x))
    layer_calls: list[int] = []  # DecoderLayer.forward: the module path's, never the loop's (in every mode)
    layer_forward = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward", lambda self, *a: layer_calls.append(1) or layer_forward(self, *a))
    with torch.inference_mode():
        loop = model(ids, positions, attn)
        assert module_calls == [] and layer_calls == []  # the loop: no layer module, no linear that has a bare call
        modules = LlamaModel.forward(model, ids, positions, attn)
        module_path = len(module_calls)
        assert len(layer_calls) == cfg.num_layers
        with torch.profiler.profile():
            profiled = model(ids, positions, attn)
    assert torch.equal(loop, modules) and torch.equal(profiled, modules)
    assert layers_seen == list(range(cfg.num_layers)) * 3  # each layer's own K/V, in order, in all three
    assert len(layer_calls) == 2 * cfg.num_layers  # the profiled forward took the module path
    assert len(module_calls) == 2 * module_path
    if bare:
        assert module_path > 0


def test_engine_with_fused_ops_matches_the_oracle() -> None:
    """The ``cpp`` backend (paged kernel + fused ops) on the mini model, fp32: greedy tokens equal the dense
    oracle's (up to the oracle's stated near-ties) on random prompts."""
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 80))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM("mini", attention_backend="cpp", block_size=8)
    assert isinstance(llm.engine.model.layers[0].mlp, FusedMLP)
    outs = llm.generate(prompts, params, use_tqdm=False)
    # Each differs from the oracle only at an exact near-tie (checked inside); most match outright.
    pairs = zip(prompts, outs, strict=True)
    exact = sum(check_against_oracle("mini", tuple(p), 16, tuple(o.token_ids)) for p, o in pairs)
    assert exact >= len(prompts) - 2


@pytest.mark.parametrize("n", [1, 15, 16, 17, 49152])  # one logit, each side of a vector, SmolLM2's vocabulary
def test_argmax_rows_gives_torch_argmax_indices(n: int) -> None:
    """The first maximum of each row, as ``torch.argmax(dim=-1)``: ties (in one vector and across vectors, and in
    the scalar tail), infinities, and a NaN, which torch counts as the largest (its first one wins)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(40, n, generator=gen)
    top = x.abs().max() + 1
    for r, cols in enumerate([[0, 1], [n - 1], [n // 2, n - 1], [3, 19], [n - 2, n - 1]]):
        x[r, [c % n for c in cols]] = top  # a tie: the first of them
    x[6], x[7], x[8] = float("-inf"), torch.where(torch.arange(n) % 5 == 4, float("inf"), 0.0), -1.0
    x[9, n // 3] = float("nan")
    x[10, [n - 1, 0]] = torch.tensor([float("nan"), top])
    got = fused_ops().argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, torch.argmax(x, dim=-1))
    assert torch.equal(fused_ops().argmax_rows(x[::2]), torch.argmax(x[::2], dim=-1))  # a strided view


def test_argmax_rows_refuses_what_it_does_not_take() -> None:
    for bad in (torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(4), torch.zeros(3, 0)):
        with pytest.raises(RuntimeError, match=r"argmax_rows: fp32 logits \[rows, n\] with n >= 1"):
            fused_ops().argmax_rows(bad)


@given(
    ints=st.lists(st.integers(-4, 4), min_size=1, max_size=120),  # small integers: ties everywhere
    rows=st.integers(1, 5),
    m=st.integers(1, 4) | st.integers(1, 66),  # mostly well below the row: the vector walk, not the first fill
    order=st.sampled_from(["as drawn", "ascending", "descending", "smallest first, then descending"]),
)
@example(ints=[i % 9 - 4 for i in range(40)], rows=1, m=1, order="smallest first, then descending")
@example(ints=[i % 7 - 3 for i in range(90)], rows=2, m=3, order="smallest first, then descending")
@settings(max_examples=300, deadline=None)
def test_topk_rows_gives_torch_topk_values_and_the_unique_top_sets(
    ints: list[int], rows: int, m: int, order: str
) -> None:
    """``torch.topk``'s values, descending, for any m up to the row's length (past the 64 the sampler asks at most,
    past a vector, a scalar tail), under ties, under the order that makes every value an insertion (ascending) and
    the one where a vector's later lanes fall below what its earlier ones raised the kept minimum to;
    where the m-th value is above the next, the index set is topk's too, and each index holds its value."""
    n = len(ints)
    m = min(m, n)
    base = torch.tensor(ints, dtype=torch.float32)
    if order != "as drawn":
        base = base.sort(descending=order != "ascending").values
    if order.startswith("smallest"):  # every lane of a vector above the kept minimum, each below the one before
        base = base.roll(1)
    x = torch.stack([base.roll(r) * (1 + r) for r in range(rows)])
    values, ids = compiled_topk()(x, m)  # type: ignore[misc]
    ref_values, ref_ids = torch.topk(x, m, dim=-1)
    assert torch.equal(values, ref_values)
    assert torch.equal(x.gather(1, ids), values)
    for r in range(rows):
        if m == n or bool(x[r].sort(descending=True).values[m] < values[r, m - 1]):
            assert sorted(ids[r].tolist()) == sorted(ref_ids[r].tolist())


def test_topk_rows_at_the_samplers_size_and_what_it_refuses() -> None:
    """64 rows of SmolLM2's vocabulary (a strided view too), and the shapes and types it does not take."""
    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(5))
    for view, m in ((x, 2), (x[::3], 65)):
        values, ids = compiled_topk()(view, m)  # type: ignore[misc]
        ref_values, ref_ids = torch.topk(view, m, dim=-1)
        assert torch.equal(values, ref_values) and torch.equal(ids.sort().values, ref_ids.sort().values)
    for bad, m in ((torch.zeros(3, 4, dtype=torch.bfloat16), 1), (torch.zeros(4), 1), (x, 0), (x[:, :3], 4)):
        with pytest.raises(RuntimeError, match=r"topk_rows: fp32 logits \[rows, n\] and 1 <= m <= n"):
            fused_ops().topk_rows(bad, m)


def test_the_cpp_engine_shortlists_top_k_rows_with_the_compiled_topk(monkeypatch) -> None:
    """The ``cpp`` mode's top_k rows find their candidates with ``topk_rows``, one call a step, the reference mode
    never; the samples are the reference mode's (seeded, top_k 3: fp32 mini, the same logits up to rounding)."""
    import kvlab.engine.engine as engine_module

    calls: list[int] = []

    def counting() -> object:
        def pick(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(logits.shape[0])
            return compiled_topk()(logits, m)  # type: ignore[misc]

        return pick

    monkeypatch.setattr(engine_module, "compiled_topk", counting)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=0.8, top_k=3, seed=7, max_tokens=6, ignore_eos=True)
    reference = LLM("mini").generate(prompts, params, use_tqdm=False)
    assert calls == []
    fast = LLM("mini", attention_backend="cpp").generate(prompts, params, use_tqdm=False)
    assert calls and sum(calls) == 3 * 6  # one row per request and step
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in reference]


def test_the_cpp_engine_picks_greedy_tokens_with_the_compiled_argmax(monkeypatch) -> None:
    """Every greedy row of the ``cpp`` mode goes through ``argmax_rows``, the reference mode never: counted, and
    the tokens are the reference mode's (fp32 mini: the same logits up to the kernels' rounding)."""
    import kvlab.engine.engine as engine_module

    calls: list[int] = []

    def counting() -> object:
        def pick(logits: torch.Tensor) -> torch.Tensor:
            calls.append(logits.shape[0])
            return fused_ops().argmax_rows(logits)

        return pick

    monkeypatch.setattr(engine_module, "compiled_argmax", counting)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = LLM("mini").generate(prompts, params, use_tqdm=False)
    assert calls == []
    fast = LLM("mini", attention_backend="cpp").generate(prompts, params, use_tqdm=False)
    assert calls and sum(calls) == 3 * 6  # one row per request and step
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in reference]
