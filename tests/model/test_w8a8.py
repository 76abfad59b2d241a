"""``int8-w8a8`` (kvlab.model.quant.W8A8Linear): int8 weights with a scale per output channel times int8
activations with a scale per token, summed in int32.

What is held: the integer sum is exact; the linear equals its reference (the dequantised product in fp32) to fp32
summation rounding; a row's output is bitwise the same whatever else is in its batch (the isolation reason for a
scale per token; a scale per tensor fails the same test); the twin. The mode end to end on mini, against fp32 and
against its own dense oracle, is tested with the other quantised modes (tests/test_quant.py). Tolerances are
stated where they are used, with what was measured.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kvlab.model import int8_linear, load_model
from kvlab.model.codes import quantize_tokens, quantize_w8a8
from kvlab.model.int8_linear import int8_linear_ops
from kvlab.model.quant import W8A8Linear, linear_dtype, quantized_model

MODE = "int8-w8a8"


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def test_int_mm_sums_int8_codes_exactly() -> None:
    """The mode rests on this: ``torch._int_mm`` is the exact integer product (checked in int64), at the extremes
    of the code range and at every row count the engine uses, decode (1) to prefill chunks (past 128)."""
    gen = torch.Generator().manual_seed(2)
    for m in (1, 3, 16, 64, 200):
        a = torch.randint(-127, 128, (m, 576), generator=gen, dtype=torch.int8)
        a[0] = 127  # the largest sum: 576 x 127 x 127
        b = torch.randint(-127, 128, (576, 96), generator=gen, dtype=torch.int8)
        b[:, 0] = 127
        assert torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long()), m


def test_weight_codes_round_to_nearest_per_channel() -> None:
    w = _weights(64, 96)
    w[3] *= 50  # an outlying channel stretches its own scale only
    w[5] = 0
    codes = quantize_w8a8(w)
    assert codes.q.dtype == torch.int8 and int(codes.q.abs().max()) == 127 and int(codes.q.min()) >= -127
    assert ((codes.dequantize() - w).abs() <= codes.scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(codes.q[5], torch.zeros(96, dtype=torch.int8))
    others = torch.cat([codes.scale[:3], codes.scale[6:]])
    assert float(codes.scale[3]) > 20 * float(others.max())


def test_token_codes_use_each_rows_own_scale() -> None:
    x = _x(4, 64)
    x[1] *= 1000
    x[2] = 0
    q, scale = quantize_tokens(x)
    assert torch.equal(q[2], torch.zeros(64, dtype=torch.int8)) and torch.isfinite(scale).all()
    assert torch.equal(scale[[0, 3]], x[[0, 3]].abs().amax(dim=-1) / 127)
    assert ((q.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


@pytest.fixture(params=["packed", "nk", "vnni"])
def layout(request, monkeypatch) -> str:
    """Each code layout with a kernel behind it: the AVX2 kernel's packed blocks and ``[N, K]`` behind ``w8a8_mm``
    (oneDNN's VNNI ``torch._int_mm`` on a VNNI CPU, its generic loop elsewhere: the same bits) on any CPU, the
    VNNI kernel's blocks where it is built (AVX512-VNNI)."""

    if int8_linear_ops() is None:
        pytest.skip("no AVX2 or no C++ toolchain: torch._int_mm serves")
    if request.param == "vnni" and not int8_linear.vnni_kernel_ready():
        pytest.skip("no AVX512-VNNI: the VNNI kernel is not built")
    monkeypatch.setattr(int8_linear, "has_vnni", lambda: request.param != "packed")
    if request.param == "nk":
        monkeypatch.setattr(int8_linear, "vnni_kernel_ready", lambda: False)
    return str(request.param)


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 16, 2), (5, 17, 64), (6, 96, 576), (13, 40, 130), (3, 70, 68), (20, 330, 64), (200, 33, 96)],
)
def test_kernel_gives_the_torch_paths_bits(layout: str, rows: int, n: int, k: int) -> None:
    """Each kernel scales each exact sum as the torch path does (float(sum) x row scale x column scale), and
    ``w8a8_mm`` makes the codes as ``quantize_tokens`` does, so the paths agree bit for bit: every row remainder
    of the AVX2 kernel's 6-row passes and of ``w8a8_mm``'s 16-lane steps, the VNNI kernel's walk that prefetches
    the next block (two passes or more, several blocks a thread: 20 rows x 330 columns), a column count that is not
    a whole block, the extremes of the code range, a row of zeros, a value halfway between two codes."""
    w = _weights(n, k, seed=n)
    w[0, :] = 1.0  # a channel of +127 codes
    lin = W8A8Linear(quantize_w8a8(w))
    if layout == "vnni" and k % 4:
        layout = "nk"  # the VNNI kernel takes input features in fours; [N, K] behind w8a8_mm serves the rest
    assert lin.layout == layout
    if layout == "packed":
        assert lin.kernel == "kvlab w8a8_linear" and lin.codes.shape == (-(-n // 16), k // 2, 16, 2)
    elif layout == "vnni":
        assert lin.kernel == "kvlab w8a8_vnni" and lin.codes.shape == (-(-n // 64), k // 4, 64, 4)
    else:
        assert lin.kernel == "torch._int_mm (oneDNN VNNI)" and lin.codes.shape == (n, k)
    x = _x(rows, k, seed=k)
    x[0] = -3.0  # a row of -127 codes
    if rows > 2:
        x[1, 0], x[1, 1:], x[1, -1] = 127.0, 2.5, -3.5  # scale 1: halfway codes, to the even 2 and -4
        x[2] = 0.0
    q, scale = quantize_tokens(x)
    torch_path = torch._int_mm(q, lin.weight_t().contiguous()).float().mul_(scale[:, None]).mul_(lin.scale[:n])
    assert torch.equal(lin(x), torch_path)
    assert torch.equal(lin.weight_t(), quantize_w8a8(w).q.t())  # the kernel's layout holds the codes, unpadded
    xb = x.to(torch.bfloat16)  # bf16 rows: the plumbing's casts' bits, whether a kernel reads them or the plumbing
    assert torch.equal(lin(xb), lin(xb.float()).to(torch.bfloat16))


@pytest.mark.parametrize(
    ("threads", "rows", "n", "k"),
    [(2, 20, 576, 128), (2, 13, 330, 64), (3, 7, 200, 64), (3, 40, 256, 96), (2, 5, 576, 64), (2, 64, 128, 64)],
)
def test_the_vnni_kernels_split_of_blocks_among_threads_gives_the_same_bits(
    threads: int, rows: int, n: int, k: int
) -> None:
    """Where the blocks do not share out evenly among the threads (9 of them on 2 threads: SmolLM2's 576 columns)
    each block's passes are split into runs, threads x runs a multiple of the threads, no more runs than passes:
    every row of every block is still computed once, with the torch path's bits, whatever the split (odd blocks on 2
    and 3 threads, a split capped by 2 passes, one pass, blocks that share out evenly)."""
    if not int8_linear.vnni_kernel_ready():
        pytest.skip("no AVX512-VNNI: the VNNI kernel is not built")
    lin = W8A8Linear(quantize_w8a8(_weights(n, k, seed=n)))
    assert lin.layout == "vnni"
    x = _x(rows, k, seed=k)
    q, scale = quantize_tokens(x)
    torch_path = torch._int_mm(q, lin.weight_t().contiguous()).float().mul_(scale[:, None]).mul_(lin.scale[:n])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, torch_path)


def test_on_a_vnni_cpu_without_the_vnni_kernel_the_codes_stay_as_quantised_and_one_call_serves(monkeypatch) -> None:
    """``[N, K]`` (AVX-VNNI only, or input features not in fours): every product, decode rows to prefill, is one
    ``w8a8_mm`` call (codes, oneDNN's product, scaling); in torch ops the way there cost more than the product at
    decode sizes. The layer's bytes are its codes and scales, nothing packed beside them."""
    import kvlab.model.quant as quant

    ops = int8_linear_ops()
    if ops is None:
        pytest.skip("no C++ toolchain: torch ops serve")
    monkeypatch.setattr(int8_linear, "has_vnni", lambda: True)
    monkeypatch.setattr(int8_linear, "vnni_kernel_ready", lambda: False)
    lin = W8A8Linear(quantize_w8a8(_weights(48, 64)))
    calls: list[int] = []

    class Counting:
        def w8a8_mm(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return ops.w8a8_mm(x, codes, scale)

    monkeypatch.setattr(quant, "int8_linear_ops", lambda: Counting())
    for rows in (1, 16, 17, 300):
        lin(_x(rows, 64))
    lin(_x(4, 64).view(2, 2, 64))  # 3-D and bf16 inputs go through the shared plumbing to the same call
    lin(_x(4, 64).to(torch.bfloat16))
    assert calls == [1, 16, 17, 300, 4, 4]
    assert lin.weight_nbytes() == 48 * 64 + 48 * 4


def test_with_the_vnni_kernel_one_call_serves_in_the_models_dtype(monkeypatch) -> None:
    """AVX512-VNNI: every product is one ``w8a8_vnni`` call, which reads bf16 rows as they are and writes bf16 (no
    cast of the activations either way); the layer holds its packed codes, their offsets and scales, padded to
    whole blocks of 64 columns, and nothing else."""
    import kvlab.model.quant as quant

    if not int8_linear.vnni_kernel_ready():
        pytest.skip("no AVX512-VNNI: the VNNI kernel is not built")
    ops = int8_linear_ops()
    lin = W8A8Linear(quantize_w8a8(_weights(48, 64)))
    assert lin.layout == "vnni"
    calls: list[tuple[int, torch.dtype]] = []

    class Counting:
        def w8a8_vnni(self, x: torch.Tensor, *args: object) -> torch.Tensor:
            calls.append((x.shape[0], x.dtype))
            return ops.w8a8_vnni(x, *args)

    monkeypatch.setattr(quant, "int8_linear_ops", lambda: Counting())
    for rows in (1, 16, 300):
        assert lin(_x(rows, 64)).dtype == torch.float32
    assert lin(_x(4, 64).to(torch.bfloat16)).dtype == torch.bfloat16
    lin(_x(4, 64).view(2, 2, 64))  # 3-D goes through the shared plumbing to the same call
    f32, b16 = torch.float32, torch.bfloat16
    assert calls == [(1, f32), (16, f32), (300, f32), (4, b16), (4, f32)]
    assert lin.weight_nbytes() == 64 * 64 + 64 * 4 + 64 * 4  # codes, scales and offsets of one 64-column block


def _gate_up(inter: int, k: int) -> tuple[W8A8Linear, W8A8Linear]:
    """One gate-up weight [2 x inter, K] as a plain layer and as the gate-up layer the W8A8 plan builds."""
    linear = nn.Linear(k, 2 * inter, bias=False)
    with torch.no_grad():
        linear.weight.copy_(_weights(2 * inter, k, seed=inter))
    return W8A8Linear(quantize_w8a8(linear.weight)), W8A8Linear.from_gate_up(linear)


@pytest.mark.parametrize(("inter", "k"), [(16, 64), (48, 128), (64, 96), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 7, 13, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_up_layout_gives_the_plain_bits_and_silu_mul_of_them_in_one_call(
    inter: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    """A gate-up layer's VNNI blocks hold the same 32 columns of gate and of up (a half of 16 columns leaves the
    other 16 of its block empty). Its output is bitwise the plain layout's, and ``silu_mul_product`` is bitwise
    the fused op set's ``silu_mul`` of that output (the epilogue rounds gate and up to the model's dtype first, as
    the stored tensor does): every pass remainder of 6 rows, fp32 and bf16, SmolLM2's shape. Its codes and scales
    read back in the layer's order, so the reference and the dequantised weights are the plain layer's."""
    from kvlab.model.fused import fused_ops

    if not int8_linear.vnni_kernel_ready() or fused_ops() is None:
        pytest.skip("no AVX512-VNNI or no C++ toolchain: no gate-up layout")
    plain, gate_up = _gate_up(inter, k)
    assert gate_up.halves and not plain.halves
    x = _x(rows, k, seed=rows).to(dtype)
    out = plain(x)
    assert torch.equal(gate_up(x), out)
    act = gate_up.silu_mul_product(x)
    assert act is not None and act.dtype == dtype
    assert torch.equal(act, fused_ops().silu_mul(out))
    assert torch.equal(gate_up.weight_t(), plain.weight_t())
    assert torch.equal(gate_up.column_scales(), plain.column_scales())
    assert torch.equal(gate_up.dequantized(), plain.dequantized())


def test_a_gate_up_layer_whose_halves_are_not_whole_vectors_stays_plain_and_gives_no_fused_product() -> None:
    """The epilogue and ``silu_mul`` cover a half alike only when it is whole vectors of 16: a half of 40 columns
    keeps the plain layout, and ``silu_mul_product`` says it cannot (the MLP then runs the two ops); rows the kernel
    does not take as they are (3-D, fp16) get None too."""
    if not int8_linear.vnni_kernel_ready():
        pytest.skip("no AVX512-VNNI: the VNNI kernel is not built")
    _, odd = _gate_up(40, 64)
    assert not odd.halves and odd.silu_mul_product(_x(3, 64)) is None
    _, even = _gate_up(32, 64)
    assert even.silu_mul_product(_x(4, 64).view(2, 2, 64)) is None
    assert even.silu_mul_product(_x(4, 64).half()) is None
    assert even.silu_mul_product(_x(0, 64)) is None


def test_the_fused_mlp_takes_silu_mul_from_the_gate_up_call_and_gives_the_unfused_bits(monkeypatch) -> None:
    """With the fused op set (``+cpp``) over int8-w8a8, the module path (``FusedMLP``) makes each layer's gate-up
    product one ``w8a8_vnni`` call whose epilogue is SILU_MUL (one per layer a forward, none of HALVES), and the
    hidden states are bitwise those of the same twin with the fused product refused (gate-up output, then
    ``silu_mul``): bf16 mini-gqa, a prompt of 37 rows. (The fused model's own loop takes the same call:
    tests/model/test_fused.py.)"""
    import kvlab.model.quant as quant
    from kvlab.model.attention_api import DenseCausalAttention
    from kvlab.model.fused import fused_model, fused_ops
    from kvlab.model.llama import LlamaModel

    if not int8_linear.vnni_kernel_ready() or fused_ops() is None:
        pytest.skip("no AVX512-VNNI or no C++ toolchain: no gate-up layout")
    loaded = load_model("mini-gqa", seed=21, dtype=torch.bfloat16)
    model = fused_model(quantized_model(loaded, MODE))
    gate_ups = [m.mlp.gate_up_proj for m in model.layers]
    assert all(isinstance(g, W8A8Linear) and g.halves for g in gate_ups)
    ids = torch.randint(0, loaded.config.vocab_size, (37,), generator=torch.Generator().manual_seed(5))
    attn = DenseCausalAttention([0, 37], loaded.config.num_heads)
    ops = int8_linear_ops()
    epilogues: list[int] = []

    class Counting:
        def w8a8_vnni(self, x: torch.Tensor, *args: int) -> torch.Tensor:
            epilogues.append(args[-1])
            return ops.w8a8_vnni(x, *args)

    monkeypatch.setattr(quant, "int8_linear_ops", lambda: Counting())
    with torch.inference_mode():
        fused = LlamaModel.forward(model, ids, torch.arange(37), attn)
        layers = loaded.config.num_layers
        assert epilogues.count(int8_linear.SILU_MUL) == layers and int8_linear.HALVES not in epilogues
        monkeypatch.setattr(W8A8Linear, "silu_mul_product", lambda self, x: None)
        unfused = LlamaModel.forward(model, ids, torch.arange(37), attn)
    assert epilogues.count(int8_linear.HALVES) == layers
    assert torch.equal(fused, unfused)


def test_without_its_kernel_the_layer_runs_torch_int_mm(monkeypatch) -> None:
    import kvlab.model.quant as quant

    monkeypatch.setattr(int8_linear, "has_vnni", lambda: False)
    odd = W8A8Linear(quantize_w8a8(_weights(8, 63)))  # the AVX2 kernel takes pairs of input features
    assert odd.kernel == "torch._int_mm"
    monkeypatch.setattr(quant, "int8_linear_ops", lambda: None)
    monkeypatch.setattr(int8_linear, "int8_linear_ops", lambda: None)
    lin = W8A8Linear(quantize_w8a8(_weights(24, 64)))
    assert lin.kernel == "torch._int_mm" and lin.codes.shape == (64, 24)
    x = _x(3, 64)
    assert ((lin(x) - lin.reference(x)).abs() <= _fp32_bound(x, lin)).all()
    monkeypatch.setattr(int8_linear, "has_vnni", lambda: True)  # VNNI without the op set: torch ops over [N, K]
    lin = W8A8Linear(quantize_w8a8(_weights(24, 64)))
    assert lin.codes.shape == (24, 64) and ((lin(x) - lin.reference(x)).abs() <= _fp32_bound(x, lin)).all()


# A fp32 sum of K products carries at most about K x 2^-24 of the sum of their magnitudes (the textbook bound
# gamma_K); twice that, plus the rounding of the int32 sum to fp32 and of two scalings. Measured: <= 0.026 of it.
def _fp32_bound(x: torch.Tensor, lin: W8A8Linear) -> torch.Tensor:
    q, scale = quantize_tokens(x)
    xd = q.float() * scale[:, None]
    return 2 * (lin.in_features + 4) * 2**-24 * (xd.abs() @ lin.dequantized().abs().T) + 1e-30


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 96, 576), (7, 200, 128), (64, 64, 1536), (200, 48, 96)])
def test_linear_equals_its_dequantised_reference(rows: int, n: int, k: int) -> None:
    lin = W8A8Linear(quantize_w8a8(_weights(n, k)))
    x = _x(rows, k)
    x[0, 0] = 40.0  # an outlying activation, as LLM residual streams have
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y - lin.reference(x)).abs() <= _fp32_bound(x, lin)).all()
    # and the quantisation itself is small next to the product: per-token activation steps of max|x| / 127
    dense = x @ _weights(n, k).T
    assert (y - dense).abs().max() < 0.1 * dense.abs().max()


def test_bf16_inputs_are_scaled_in_fp32_and_returned_in_bf16() -> None:
    lin = W8A8Linear(quantize_w8a8(_weights(32, 64)))
    x = _x(5, 64).to(torch.bfloat16)
    y = lin(x.view(5, 1, 64))
    assert y.dtype == torch.bfloat16 and y.shape == (5, 1, 32)
    torch.testing.assert_close(y.view(5, 32), lin.reference(x.float()).to(torch.bfloat16), rtol=2**-7, atol=1e-6)
    assert lin(torch.zeros(0, 64)).shape == (0, 32)


@settings(max_examples=40, deadline=None)
@given(
    own=st.integers(1, 4),
    others=st.integers(0, 12),
    loud=st.floats(1e-3, 1e4),
    seed=st.integers(0, 2**16),
)
def test_a_rows_output_is_bitwise_the_same_in_any_batch(own: int, others: int, loud: float, seed: int) -> None:
    """One request's rows alone, and the same rows among other requests' rows of any magnitude, give the same bits:
    each row is quantised by its own scale and the integer sum is exact. So a W8A8 request's numerics never depend
    on (and so never reveal) who shares its step."""
    gen = torch.Generator().manual_seed(seed)
    lin = W8A8Linear(quantize_w8a8(torch.randn(40, 64, generator=gen) / 8))
    mine = torch.randn(own, 64, generator=gen)
    theirs = torch.randn(others, 64, generator=gen) * loud
    cut = int(torch.randint(0, others + 1, (1,), generator=gen))
    batch = torch.cat([theirs[:cut], mine, theirs[cut:]])
    assert torch.equal(lin(batch)[cut : cut + own], lin(mine))


def test_a_scale_per_tensor_would_fail_the_batch_test() -> None:
    """The test above has teeth: with one scale for the whole batch, a loud neighbour coarsens a quiet row's codes
    and changes its output (here by far more than fp32 rounding)."""
    lin = W8A8Linear(quantize_w8a8(_weights(40, 64)))
    mine, loud = _x(1, 64), _x(1, 64, seed=9) * 1000

    def per_tensor(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max() / 127
        q = torch.round(x / scale).clamp(-127, 127)
        return (q * scale) @ lin.dequantized().T

    alone, shared = per_tensor(mine), per_tensor(torch.cat([loud, mine]))[1:]
    assert (alone - shared).abs().max() > 100 * _fp32_bound(mine, lin).max()
    assert torch.equal(lin(torch.cat([loud, mine]))[1:], lin(mine))


# ------------------------------------------------------------------------------------------------ the mode


def test_twin_quantises_every_layer_linear_keeps_the_head_and_says_so(caplog) -> None:
    loaded = load_model("mini-gqa", seed=21)
    with caplog.at_level(logging.INFO, logger="kvlab.model.quant"):
        twin = quantized_model(loaded, MODE)
    assert sum(type(m) is W8A8Linear for m in twin.modules()) == 4 * loaded.config.num_layers
    assert type(twin.lm_head) is nn.Linear and twin.lm_head.weight is loaded.model.lm_head.weight
    line = caplog.records[-1].getMessage()
    kernel = W8A8Linear(quantize_w8a8(_weights(8, 64))).kernel
    assert f"quantization=int8-w8a8: 16 linears on {kernel} (float32 activations, weights per channel, " in line
    assert "activations per token)" in line and "lm_head" in line
    assert linear_dtype(MODE, "bfloat16") == "int8" and linear_dtype("int8", "bfloat16") == "bfloat16"


def test_the_head_mode_quantises_the_lm_head_too_and_leaves_the_tied_embedding() -> None:
    """int8-w8a8-head: the layers' linears as int8-w8a8 has them, and the LM head on the same kernel from codes of
    its own (a scale per vocabulary row); the tied embedding the head was read from is untouched and still shared
    with the loaded model. Its logits against the fp32 head: within 0.15 on mini-gqa's random weights (64 rows of
    unit-variance hidden states, logits up to ~4: measured 0.052; a wrong scale or code order is off by units)."""
    loaded = load_model("mini-gqa", seed=21)
    before = loaded.model.embed_tokens.weight.detach().clone()
    twin = quantized_model(loaded, "int8-w8a8-head")
    plain = quantized_model(loaded, MODE)
    assert sum(type(m) is W8A8Linear for m in twin.modules()) == 4 * loaded.config.num_layers + 1
    assert type(twin.lm_head) is W8A8Linear and type(plain.lm_head) is nn.Linear
    assert twin.embed_tokens.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, before)
    hidden = torch.randn(64, loaded.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (twin.compute_logits(hidden) - loaded.model.compute_logits(hidden)).abs().max()
    assert float(diff) < 0.15
    from kvlab.model.quant import head_dtype

    assert head_dtype("int8-w8a8-head", "bfloat16") == "int8" == linear_dtype("int8-w8a8-head", "bfloat16")
    assert head_dtype(MODE, "bfloat16") == "bfloat16"
