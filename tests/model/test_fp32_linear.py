"""The fp32 small-batch linear kernel (AVX2 + FMA) against the exact product and ``F.linear``, at every linear shape
of SmolLM2 and the minis and at widths that are not multiples of its vector and column blocks; the layer that
dispatches to it, its fallbacks, and an engine whose decode steps run on it, against the dense oracle.

Tolerance: within 1e-6 of the sum of the products' magnitudes (``|x| @ |w|ᵀ``), in float64. Its sums run 8 lanes
wide, then across them: another order than ``F.linear``'s, a few ulps apart (measured ~1e-7 of that sum).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

from kvlab import LLM, SamplingParams
from kvlab.model import fp32_linear
from kvlab.model.fp32_linear import (
    SMALL_BATCH_MAX_ROWS,
    SmallBatchFp32Linear,
    small_batch_fp32_model,
    small_linear_fp32_ops,
)
from kvlab.model.mini import build_mini, mini_config
from kvlab.model.packed import PackedLinear, with_packed_linears
from linear_shapes import SMOLLM2_SHAPES, mini_shapes
from oracle_cache import check_against_oracle

ops = small_linear_fp32_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no AVX2 + FMA, AVX-512 present, or no C++ toolchain: oneDNN")

SMALL_SHAPES = [(8, 4), (16, 12), (8, 40)]  # the kernel's smallest blocks
KERNEL_SHAPES = SMOLLM2_SHAPES + [s for s in mini_shapes() if s[1] % 4 == 0] + SMALL_SHAPES  # not the minis' 259 head


def within_tolerance(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    x, w = x.detach().double(), w.detach().double()
    exact = x @ w.t()
    magnitude = (x.abs() @ w.abs().t()).clamp_min(1e-30)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    worst = float(((got.double() - exact).abs() / magnitude).max())
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, SMALL_BATCH_MAX_ROWS])
def test_the_kernel_is_within_tolerance_of_the_exact_product(shape: tuple[int, int], rows: int) -> None:
    assert ops is not None
    k, n = shape
    gen = torch.Generator().manual_seed(k * 7 + n + rows)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    x = torch.randn(rows, k, generator=gen)
    got = ops.small_linear_fp32(x, w)
    within_tolerance(got, x, w)
    within_tolerance(torch.nn.functional.linear(x, w), x, w)  # the reference meets the same bound


def test_the_kernel_reads_a_row_view_and_refuses_what_it_cannot_read() -> None:
    """x may be a strided view (it is made contiguous); the weight is read in place and must be contiguous fp32, its
    input width a multiple of 8 and its output width of 4."""
    assert ops is not None
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(12, 16, generator=gen)
    x = torch.randn(5, 32, generator=gen)[:, ::2]
    within_tolerance(ops.small_linear_fp32(x, w), x, w)
    for bad_x, bad_w, message in (
        (x, w.t().contiguous().t(), "contiguous"),
        (x.double(), w, "fp32"),
        (x[:, :8], w, r"x \[M, K\], w \[N, K\]"),
        (x[:, :12], w[:, :12].contiguous(), "K a multiple of 8"),
        (x, w[:10].contiguous(), "N of 4"),
    ):
        with pytest.raises(RuntimeError, match=message):
            ops.small_linear_fp32(bad_x, bad_w)


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row counts of every kernel call from now on."""
    calls: list[int] = []
    real = small_linear_fp32_ops()
    assert real is not None

    class Counting:
        def small_linear_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return real.small_linear_fp32(x, w)  # type: ignore[no-any-return]

    monkeypatch.setattr(fp32_linear, "small_linear_fp32_ops", lambda: Counting())
    return calls


def test_the_layer_runs_small_batches_on_the_kernel_and_large_ones_on_onednn(monkeypatch) -> None:
    model = with_packed_linears(build_mini(mini_config()))
    twin = small_batch_fp32_model(model)
    layers = [m for m in twin.modules() if isinstance(m, SmallBatchFp32Linear)]
    assert layers and not any(isinstance(m, SmallBatchFp32Linear) for m in model.modules())  # the model is untouched
    kept = [m for m in twin.modules() if type(m) is PackedLinear]
    assert [m.out_features for m in kept] == [259]  # the LM head: no blocks of 4 columns
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m.out_features != 259]
    assert len(layers) == len(packed) and all(a.weight is b.weight for a, b in zip(layers, packed, strict=True))
    layer = layers[0]
    calls = count_kernel_calls(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    small = torch.randn(SMALL_BATCH_MAX_ROWS, layer.in_features, generator=gen)
    large = torch.randn(SMALL_BATCH_MAX_ROWS + 1, layer.in_features, generator=gen)
    within_tolerance(layer(small), small, layer.weight)
    assert torch.equal(layer(large), PackedLinear.forward(layer, large))  # oneDNN's own answer
    three_d = small.view(2, SMALL_BATCH_MAX_ROWS // 2, -1)  # flattened to rows first, as PackedLinear does
    assert torch.equal(layer(three_d), layer(small).view(2, SMALL_BATCH_MAX_ROWS // 2, -1))
    assert calls == [SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS]
    bare = layer.kernel_call()  # the fused model's layer loop: the same products without the module call
    assert torch.equal(bare(small), layer(small)) and torch.equal(bare(large), layer(large))
    assert calls == [SMALL_BATCH_MAX_ROWS] * 5


def test_a_layer_the_kernel_has_no_blocks_for_stays_onednns() -> None:
    """Input widths not a multiple of 8, output widths not of 4: those layers stay ``PackedLinear``, the rest go."""
    model = nn.Sequential(nn.Linear(16, 12, bias=False), nn.Linear(12, 8, bias=False), nn.Linear(8, 10, bias=False))
    twin = small_batch_fp32_model(with_packed_linears(model))
    assert [type(m).__name__ for m in twin] == ["SmallBatchFp32Linear", "PackedLinear", "PackedLinear"]


def test_without_the_kernel_the_model_keeps_onednn_after_one_log_line(monkeypatch, caplog) -> None:
    model = with_packed_linears(build_mini(mini_config()))
    monkeypatch.setattr(fp32_linear, "small_linear_fp32_ops", lambda: None)
    assert small_batch_fp32_model(model) is model
    monkeypatch.undo()
    plain = build_mini(mini_config())
    assert small_batch_fp32_model(plain) is plain  # nothing packed: nothing to do

    class NoAvx2:
        def has_avx2_fma(self) -> bool:
            return False

    cases = (
        ("flags : fpu avx2 fma", lambda *a, **k: NoAvx2(), "fp32 small-batch linear unavailable (this CPU has no AVX2 "
         "and FMA); using oneDNN's"),
        ("flags : fpu avx2 fma avx512f", None, "fp32 small-batch linear left to oneDNN: this CPU has AVX-512, where "
         "oneDNN's kernels are faster"),
    )  # fmt: skip
    for flags, build, message in cases:
        monkeypatch.setattr(fp32_linear.native, "cpu_flags", lambda flags=flags: flags)
        if build is not None:
            monkeypatch.setattr(fp32_linear.native, "build", build)
        else:  # the AVX-512 answer comes before any build
            monkeypatch.setattr(fp32_linear.native, "build", lambda *a, **k: pytest.fail("built on AVX-512"))
        fp32_linear.small_linear_fp32_ops.cache_clear()
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING):
                assert fp32_linear.small_linear_fp32_ops() is None
            assert [r.getMessage() for r in caplog.records] == [message]
        finally:
            monkeypatch.undo()
            fp32_linear.small_linear_fp32_ops.cache_clear()
    assert fp32_linear.small_linear_fp32_ops() is not None


def test_an_fp32_engine_on_the_kernel_gives_the_dense_oracles_tokens(monkeypatch) -> None:
    """fp32 + cpp with every linear packed (so the mini's decode steps run on the kernel): greedy tokens of each
    prompt are the dense no-cache reference's (or part from it only at an exact near-tie, as every fp32 path
    may), and every decode step's linears ran on the kernel."""
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    fast = LLM("mini", attention_backend="cpp", packed_weights=True, block_size=8)
    assert any(isinstance(m, SmallBatchFp32Linear) for m in fast.engine.runner.model.modules())
    calls = count_kernel_calls(monkeypatch)
    outs = fast.generate(prompts, params, use_tqdm=False)
    assert calls and max(calls) <= SMALL_BATCH_MAX_ROWS
    assert calls.count(len(prompts)) > 0  # the 8-row decode steps, not only the chunks of a prompt
    for prompt, out in zip(prompts, outs, strict=True):
        check_against_oracle("mini", tuple(prompt), 10, tuple(out.outputs[0].token_ids))
