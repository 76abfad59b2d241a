"""The bf16 small-batch linear kernel against the exact product and ``F.linear`` in bf16, at every linear shape of
SmolLM2 and the minis, and the layer and engine that use it.

Tolerance: within one bf16 rounding of the exact product of the bf16 inputs (2^-8 relative, plus 1e-5 of the row's
scale for the fp32 sums' order), as ``F.linear`` in bf16 is; the two differ by at most one bf16 rounding each.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.model import bf16_linear
from kvlab.model.bf16_linear import (
    SMALL_BATCH_MAX_ROWS,
    SmallBatchLinear,
    pack_weight,
    small_batch_model,
    small_linear_ops,
)
from kvlab.model.mini import build_mini, mini_config
from kvlab.model.packed import PackedLinear, packable_dtype, with_packed_linears
from linear_shapes import SMOLLM2_SHAPES, mini_shapes
from oracle_cache import assert_bf16_paths_agree

ops = small_linear_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no AVX512-BF16 or no C++ toolchain: oneDNN serves")


def within_one_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    scale = exact.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)
    err = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16
    assert bool((err <= 2**-8 * exact.abs() + 1e-5 * scale).all()), float((err / scale).max())


@pytest.mark.parametrize("shape", SMOLLM2_SHAPES + mini_shapes())
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, SMALL_BATCH_MAX_ROWS])
def test_the_kernel_is_within_one_rounding_of_the_exact_product(shape: tuple[int, int], rows: int) -> None:
    assert ops is not None
    k, n = shape
    gen = torch.Generator().manual_seed(k * 7 + n + rows)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    got = ops.small_linear(x, pack_weight(w), n)
    assert got.shape == (rows, n)
    within_one_rounding(got, x, w)
    ref = torch.nn.functional.linear(x, w)
    assert ((got.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-4).all()


def test_widths_that_are_not_a_multiple_of_the_block_are_padded_and_stored_masked() -> None:
    assert ops is not None
    gen = torch.Generator().manual_seed(1)
    for n in (1, 15, 16, 17, 63, 65, 100):
        w = torch.randn(n, 32, generator=gen).to(torch.bfloat16)
        x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
        packed = pack_weight(w)
        assert packed.shape == (-(-n // 64), 16, 64, 2)
        out = ops.small_linear(x, packed, n)
        within_one_rounding(out, x, w)


@pytest.mark.parametrize(
    ("threads", "rows", "n", "k"), [(2, 20, 576, 64), (2, 64, 330, 32), (3, 7, 200, 32), (2, 5, 576, 32)]
)
def test_blocks_split_among_threads_give_the_one_thread_bits(threads: int, rows: int, n: int, k: int) -> None:
    """Where the blocks do not share out evenly among the threads (SmolLM2's 9 blocks of 576 columns on 2), each
    block's passes are split into runs: every row of every block is computed once, in the kernel's own order, so
    the output is one thread's bit for bit (odd blocks on 2 and 3 threads, a split capped by 2 passes, one pass)."""
    assert ops is not None
    gen = torch.Generator().manual_seed(n + rows)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed = pack_weight(w)
    alone = ops.small_linear(x, packed, n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        split = ops.small_linear(x, packed, n)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(split, alone)
    within_one_rounding(split, x, w)


@pytest.mark.parametrize("rows", [7, 8, 13, 16, 26])
def test_a_rows_output_is_the_same_bits_whatever_rows_share_its_call(rows: int) -> None:
    """The rows are shared out evenly among a block's passes (8 rows: 4 and 4), so which pass a row falls in, and
    beside which rows, depends on the batch; its sums never do: each row alone gives the bits it gets in the batch."""
    assert ops is not None
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(576, 576, generator=gen) * 576**-0.5).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    packed = pack_weight(w)
    together = ops.small_linear(x, packed, 576)
    assert all(torch.equal(together[i], ops.small_linear(x[i : i + 1], packed, 576)[0]) for i in range(rows))


def test_a_packed_weight_is_refused_for_another_input_width() -> None:
    assert ops is not None
    packed = pack_weight(torch.randn(64, 32).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed weights"):
        ops.small_linear(torch.randn(2, 48).to(torch.bfloat16), packed, 64)


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every kernel call from here on (the kernel still computes them)."""
    calls: list[int] = []
    real = ops.small_linear  # type: ignore[union-attr]

    class Counting:
        def small_linear(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
            calls.append(x.shape[0])
            return real(x, packed, n)  # type: ignore[no-any-return]

    monkeypatch.setattr(bf16_linear, "small_linear_ops", lambda: Counting())
    return calls


needs_bf16_packing = pytest.mark.skipif(not packable_dtype(torch.bfloat16), reason="oneDNN has no bf16 here")


@needs_bf16_packing
def test_the_layer_runs_small_batches_on_the_kernel_and_large_ones_on_onednn(monkeypatch) -> None:
    model = with_packed_linears(build_mini(mini_config(), dtype=torch.bfloat16))
    twin = small_batch_model(model)
    layers = [m for m in twin.modules() if isinstance(m, SmallBatchLinear)]
    assert layers and not any(isinstance(m, SmallBatchLinear) for m in model.modules())  # the model is untouched
    layer = layers[0]
    assert layer.weight is next(m for m in model.modules() if isinstance(m, PackedLinear)).weight  # shared
    calls = count_kernel_calls(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    small = torch.randn(SMALL_BATCH_MAX_ROWS, layer.in_features, generator=gen).to(torch.bfloat16)
    large = torch.randn(SMALL_BATCH_MAX_ROWS + 1, layer.in_features, generator=gen).to(torch.bfloat16)
    within_one_rounding(layer(small), small, layer.weight)
    assert torch.equal(layer(large), PackedLinear.forward(layer, large))  # oneDNN's own answer
    assert calls == [SMALL_BATCH_MAX_ROWS]
    bare = layer.kernel_call()  # the fused model's layer loop: the same products without the module call
    assert torch.equal(bare(small), layer(small)) and torch.equal(bare(large), layer(large))
    assert calls == [SMALL_BATCH_MAX_ROWS] * 3


@needs_bf16_packing
def test_without_the_kernel_the_model_keeps_onednn_after_one_log_line(monkeypatch, caplog) -> None:
    model = with_packed_linears(build_mini(mini_config(), dtype=torch.bfloat16))
    monkeypatch.setattr(bf16_linear, "small_linear_ops", lambda: None)
    assert small_batch_model(model) is model
    fp32 = with_packed_linears(build_mini(mini_config()))
    assert small_batch_model(fp32) is fp32  # fp32 weights: nothing to do

    class NoDot:
        def has_bf16_dot(self) -> bool:
            return False

    monkeypatch.undo()
    monkeypatch.setattr(bf16_linear.native, "build", lambda *a, **k: NoDot())
    bf16_linear.small_linear_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert bf16_linear.small_linear_ops() is None
        assert [r.getMessage() for r in caplog.records] == [
            "bf16 small-batch linear unavailable (this CPU has no AVX512-BF16); using oneDNN's"
        ]
    finally:
        monkeypatch.undo()
        bf16_linear.small_linear_ops.cache_clear()
    assert bf16_linear.small_linear_ops() is not None


@needs_bf16_packing
def test_a_bf16_engine_with_the_kernel_stays_within_rounding_of_its_reference_path(monkeypatch) -> None:
    """bf16 + cpp with every linear packed (so the mini's run on the kernel) against the bf16 reference: the first
    decode tokens are the same for every prompt and every token both chose has a log-probability within 0.05
    (the rule of the other bf16 kernels: the paths round in different places and may part at a near-tie)."""
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    fast = LLM("mini", dtype="bfloat16", attention_backend="cpp", packed_weights=True, block_size=8)
    assert any(isinstance(m, SmallBatchLinear) for m in fast.engine.runner.model.modules())
    calls = count_kernel_calls(monkeypatch)
    outs = [o.outputs[0] for o in fast.generate(prompts, params, use_tqdm=False)]
    assert calls and max(calls) <= SMALL_BATCH_MAX_ROWS  # the decode steps' linears ran on the kernel
    refs = [r.outputs[0] for r in LLM("mini", dtype="bfloat16", block_size=8).generate(prompts, params, use_tqdm=False)]
    assert_bf16_paths_agree(outs, refs)
