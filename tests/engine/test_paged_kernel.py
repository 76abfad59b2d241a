"""The compiled in-place paged decode kernel against the reference gather + SDPA (tolerance 1e-5: fp32
sums in another order), and end to end against the dense oracle."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.attention.kernels import paged_decode_kernel
from kvlab.attention.paged import decode_attention
from kvlab.config import ConfigError
from oracle_cache import check_against_oracle, mini

kernel = paged_decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain: the reference attention serves")


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])  # MHA, GQA, MQA
def test_kernel_equals_gather_and_sdpa(heads: int, kv_heads: int) -> None:
    assert kernel is not None
    gen = torch.Generator().manual_seed(heads)
    num_blocks, bs, dim, batch = 48, 8, 16, 5
    k = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    lens = torch.tensor([1, 9, 31, 64, 2])
    tables = torch.randperm(num_blocks, generator=gen)[: batch * 8].view(batch, 8)
    q = torch.randn(batch, heads, dim, generator=gen)
    got = kernel(q, k, v, tables, lens, dim**-0.5)
    pos = torch.arange(int(lens.max()))
    slots = tables[:, pos // bs] * bs + pos % bs
    kc, vc = k.view(-1, kv_heads, dim)[slots], v.view(-1, kv_heads, dim)[slots]
    mask = torch.where(pos[None, :] >= lens[:, None], float("-inf"), 0.0)[:, None, None, :]
    assert (got - decode_attention(q, kc, vc, mask)).abs().max() < 1e-5


def test_engine_with_the_kernel_matches_the_oracle_and_the_reference() -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(mini(), attention_backend="cpp", block_size=8)
    assert llm.engine.runner.decode_kernel is not None
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(mini(), block_size=8).generate(prompts, params, use_tqdm=False)
    for p, o, r in zip(prompts, outs, ref, strict=True):
        assert check_against_oracle("mini", tuple(p), 12, tuple(o.token_ids))
        assert o.token_ids == r.token_ids
    with pytest.raises(ConfigError, match="attention_backend"):
        LLM(mini(), attention_backend="flash")


def test_the_kernel_steps_aside_where_it_does_not_apply() -> None:
    assert LLM(mini(), attention_backend="cpp", layout="HND").engine.runner.decode_kernel is None
    assert LLM(mini(), attention_backend="cpp", kv_cache_dtype="bfloat16").engine.runner.decode_kernel is None
