"""Decode rows whose contexts begin with the same cached blocks read them once for all (reference path):
against the per-row gather + SDPA on the same values, and end to end against the dense oracle. Tolerance 1e-5
in fp32 (sums in another order), 1e-2 in bf16 (one rounding of outputs ~1)."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.attention.paged import ReferenceAttentionMetadata, decode_attention, shared_prefix_decode_attention
from kvlab.engine.runner import SHARED_PREFIX_MIN_SLOTS
from oracle_cache import check_against_oracle, mini


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])  # MHA, GQA, MQA
def test_the_shared_prefix_read_once_equals_each_row_reading_its_whole_context(
    heads: int, kv_heads: int, dtype: torch.dtype, tolerance: float
) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    rows, dim, shared, rest = 5, 32, 300, 9
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    kp, vp = (torch.randn(shared, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    kr, vr = (torch.randn(rows, rest, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([1, 9, 4, 2, 7])  # each row's own slots after the prefix; the rest is padding
    pad = torch.arange(rest)[None, :] >= lens[:, None]
    mask = torch.zeros(rows, 1, 1, rest).masked_fill(pad[:, None, None], float("-inf"))
    got = shared_prefix_decode_attention(q, (kp, vp), (kr, vr), mask.to(dtype))
    assert got.dtype == dtype and got.shape == q.shape
    k = torch.cat([kp.float()[None].expand(rows, -1, -1, -1), kr.float()], 1)
    v = torch.cat([vp.float()[None].expand(rows, -1, -1, -1), vr.float()], 1)
    full_mask = torch.cat([torch.zeros(rows, 1, 1, shared), mask], -1)
    want = decode_attention(q.float(), k, v, full_mask)
    assert (got.float() - want).abs().max() < tolerance


def _single_query_steps(llm: LLM) -> list:
    """Records every step's single-query rows (``SingleQueryRows``) as the runner prepares them."""
    steps: list = []
    prepare = llm.engine.runner.prepare

    def recording(batch):  # type: ignore[no-untyped-def]
        prep = prepare(batch)
        assert isinstance(prep.meta, ReferenceAttentionMetadata)
        if prep.meta.single_query is not None:
            steps.append(prep.meta.single_query)
        return prep

    llm.engine.runner.prepare = recording  # type: ignore[method-assign]
    return steps


def test_requests_decoding_after_one_cached_document_share_its_blocks_and_match_the_oracle() -> None:
    rng = random.Random(3)
    document = [rng.randrange(256) for _ in range(SHARED_PREFIX_MIN_SLOTS + 60)]
    prompts = [document + [rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(mini(), block_size=8)
    llm.generate([document], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # the document cached
    steps = _single_query_steps(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    shared = [single.prefix_slots.numel() for single in steps if single.prefix_slots is not None]
    # Every row keeps at least one slot of its own after the shared prefix.
    assert all(bool((single.mask[:, 0, 0, 0] == 0).all()) for single in steps if single.prefix_slots is not None)
    # Every decode step shares the document's whole blocks (each row keeps its last partial block and beyond).
    assert shared and set(shared) == {len(document) // 8 * 8}
    for p, o in zip(prompts, outs, strict=True):
        check_against_oracle("mini", tuple(p), 8, tuple(o.token_ids))
    # The same requests with nothing cached beforehand: the same tokens.
    fresh = LLM(mini(), block_size=8).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [f.token_ids for f in fresh]


def test_attention_capture_keeps_each_row_reading_its_whole_context() -> None:
    """Capture records each row's attention over its whole context, so with capture on no prefix is shared; the
    records hold every slot of each decode row's context."""
    from kvlab.instrument.attention import AttentionCapture

    rng = random.Random(4)
    document = [rng.randrange(256) for _ in range(SHARED_PREFIX_MIN_SLOTS + 60)]
    prompts = [document + [rng.randrange(256) for _ in range(3)] for _ in range(3)]
    capture = AttentionCapture(layers=[0])
    llm = LLM(mini(), block_size=8, capture=capture)
    llm.generate([document], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    steps = _single_query_steps(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert steps and all(single.prefix_slots is None for single in steps)
    # The control: the same requests without capture do share the document.
    plain = LLM(mini(), block_size=8)
    plain.generate([document], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    plain_steps = _single_query_steps(plain)
    plain.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert any(single.prefix_slots is not None for single in plain_steps)
    rid = outs[0].request_id
    last = capture.records[rid][-1]
    assert last.probs.shape[-1] == len(prompts[0]) + 2  # the last decode token saw its whole context
