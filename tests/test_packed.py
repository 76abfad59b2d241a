"""The engine's prepacked-weight linears: same weights, same results within fp32 rounding, original untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvlab import LLM, ConfigError, SamplingParams
from kvlab.model import dense_logits, load_model
from kvlab.model.packed import PACK_MIN_WEIGHTS, PackedLinear, packing_available, with_packed_linears
from oracle_cache import check_against_oracle, mini

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


def test_twin_shares_weights_and_leaves_the_model_alone() -> None:
    model = load_model("mini-gqa").model
    twin = with_packed_linears(model)
    assert all(type(m) is not PackedLinear for m in model.modules())
    packed = [m for m in twin.modules() if type(m) is PackedLinear]
    assert len(packed) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down per layer + LM head
    assert not any(type(m) is nn.Linear for m in twin.modules())
    assert twin.lm_head.weight is model.lm_head.weight
    assert (twin.lm_head.weight is twin.embed_tokens.weight) == model.config.tie_word_embeddings
    assert {id(p) for p in twin.parameters()} == {id(p) for p in model.parameters()}
    assert twin.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("name", ["mini", "mini-gqa", "mini-mqa"])
def test_logits_equal_the_plain_model_within_fp32_rounding(name: str) -> None:
    model = load_model(name).model
    ids = list(range(3, 90))
    plain, packed = dense_logits(model, ids), dense_logits(with_packed_linears(model, min_weights=0), ids)
    # Different summation order only: a few ulps of logits of magnitude ~5.
    torch.testing.assert_close(packed, plain, rtol=0, atol=2e-5)


def test_3d_input_is_flattened_and_restored() -> None:
    lin = nn.Linear(32, 48, bias=False)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(PackedLinear(lin)(x), lin(x), rtol=0, atol=1e-5)


def test_linear_with_bias_is_refused() -> None:
    with pytest.raises(ValueError, match="bias-free"):
        PackedLinear(nn.Linear(4, 4, bias=True))


def test_twin_is_reused_and_rebuilt_after_an_in_place_weight_change() -> None:
    model = load_model("mini", seed=3).model
    first = with_packed_linears(model)
    assert with_packed_linears(model) is first
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(-1)
    second = with_packed_linears(model)
    assert second is not first
    ids = [5, 9, 200, 31]
    torch.testing.assert_close(dense_logits(second, ids), dense_logits(model, ids), rtol=0, atol=2e-5)


def test_only_large_linears_are_packed_by_default() -> None:
    model = load_model("mini").model
    twin = with_packed_linears(model, PACK_MIN_WEIGHTS)
    assert twin is not with_packed_linears(model, 0)  # remembered per threshold
    big = [m.weight.numel() >= PACK_MIN_WEIGHTS for m in model.modules() if type(m) is nn.Linear]
    assert sum(type(m) is PackedLinear for m in twin.modules()) == sum(big) == 0  # mini: all too small to gain
    assert LLM(mini()).engine.model is mini().model  # so the default engine runs it unchanged


def test_engine_packed_and_plain_give_the_oracle_tokens() -> None:
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for packed in (True, False):
        llm = LLM(mini(), packed_weights=packed)
        assert any(type(m) is PackedLinear for m in llm.engine.model.modules()) == packed
        for p, out in zip(prompts, llm.generate(prompts, params), strict=True):
            check_against_oracle("mini", tuple(p), 12, tuple(out.token_ids))


def test_packed_weights_refused_for_weights_onednn_cannot_pack() -> None:
    with pytest.raises(ConfigError, match="packed_weights=True needs CPU fp32"):
        LLM(load_model("mini", dtype=torch.float64), packed_weights=True)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no native bf16 in oneDNN on this CPU")
@pytest.mark.parametrize("name", ["mini", "mini-gqa"])
def test_bf16_weights_pack_and_stay_within_one_bf16_rounding(name: str) -> None:
    """bf16 packed linears accumulate in fp32 and round once, as bf16 ``F.linear`` does: stated tolerance one
    bf16 ulp of the logits (2^-8 relative; measured: identical on this CPU, where F.linear runs oneDNN too)."""
    model = load_model(name, dtype=torch.bfloat16).model
    twin = with_packed_linears(model, min_weights=0)
    assert sum(type(m) is PackedLinear for m in twin.modules()) == 4 * model.config.num_layers + 1
    ids = list(range(3, 90))
    plain, packed = dense_logits(model, ids), dense_logits(twin, ids)
    assert packed.dtype == plain.dtype
    torch.testing.assert_close(packed, plain, rtol=2**-8, atol=2**-8)
