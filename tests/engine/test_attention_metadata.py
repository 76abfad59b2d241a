"""The attention metadata of each path, built by the runner for one mixed batch: a decode token, a fresh prompt
(a prefill segment on the reference path) and a one-token prompt. Each variant holds exactly its path's rows,
is built whole (frozen) and carries no empty placeholder tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvlab.attention.paged import (
    KernelAttentionMetadata,
    PrefillSegment,
    ReferenceAttentionMetadata,
    SingleQueryRows,
)
from kvlab.config import CacheConfig, SchedulerConfig
from kvlab.engine.engine import Engine
from kvlab.engine.runner import ModelRunner, PreparedStep
from kvlab.engine.sampling import SamplingParams
from oracle_cache import mini

BLOCK = 4
DECODE_PROMPT = list(range(1, 7))  # 6 tokens, prefilled in the first step; decodes its 7th slot in the second
PREFILL_PROMPT = list(range(10, 19))  # 9 tokens, fresh in the second step
ONE_TOKEN_PROMPT = [42]


def _not_a_kernel(*args: object) -> torch.Tensor:
    raise AssertionError("building metadata never calls the kernel")


def _both_variants() -> tuple[Engine, PreparedStep, PreparedStep]:
    """The second step's batch (rows: 0 = "d" decoding; 1..9 = "p"; 10 = "one"), prepared by the reference
    runner and by a runner with a kernel."""
    eng = Engine(
        mini(),
        CacheConfig(block_size=BLOCK, num_blocks=64),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
    )
    kernel_runner = ModelRunner(eng.runner.model, eng.kv, eng.storage, attention_kernel=_not_a_kernel)
    assert kernel_runner.attention_kernel is _not_a_kernel  # fp32, NHD, head_dim 32: the kernel path applies
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request(DECODE_PROMPT, params, request_id="d")
    eng.step()
    eng.add_request(PREFILL_PROMPT, params, request_id="p")
    eng.add_request(ONE_TOKEN_PROMPT, params, request_id="one")
    preps: dict[str, PreparedStep] = {}
    reference_prepare = eng.runner.prepare

    def prepare(batch):  # type: ignore[no-untyped-def]
        preps["kernel"] = kernel_runner.prepare(batch)
        preps["reference"] = reference_prepare(batch)
        return preps["reference"]

    eng.runner.prepare = prepare  # type: ignore[method-assign]
    eng.step()
    return eng, preps["reference"], preps["kernel"]


def _tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor a metadata holds, through its nested dataclasses and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    if isinstance(obj, tuple):
        return [t for x in obj for t in _tensors(x)]
    return []


def test_the_reference_metadata_has_the_single_query_rows_and_the_prefill_segment() -> None:
    eng, ref, _ = _both_variants()
    meta = ref.meta
    assert isinstance(meta, ReferenceAttentionMetadata)
    rows = ref.input_ids.numel()
    assert rows == 1 + len(PREFILL_PROMPT) + 1 and meta.slot_mapping.numel() == rows
    single = meta.single_query
    assert isinstance(single, SingleQueryRows)
    assert single.rows.tolist() == [0, rows - 1] and single.request_ids == ("d", "one")
    lens = (single.mask[:, 0, 0, :] == 0).sum(-1).tolist()
    assert lens == [len(DECODE_PROMPT) + 1, 1]  # the decode token sees its 7 slots, the lone prompt token its own
    assert single.context_slots.shape == (2, len(DECODE_PROMPT) + 1)
    d_slots = eng.storage.context_slots(eng.kv.block_table("d"), len(DECODE_PROMPT) + 1)
    assert torch.equal(single.context_slots[0], d_slots)
    (seg,) = meta.prefills
    assert isinstance(seg, PrefillSegment)
    assert (seg.row_start, seg.row_end, seg.request_id, seg.fresh) == (1, rows - 1, "p", True)
    assert seg.q_positions.tolist() == list(range(len(PREFILL_PROMPT)))
    assert torch.equal(seg.context_slots, eng.storage.context_slots(eng.kv.block_table("p"), len(PREFILL_PROMPT)))
    # Every row in exactly one place.
    covered = single.rows.tolist() + list(range(seg.row_start, seg.row_end))
    assert sorted(covered) == list(range(rows))
    assert all(t.numel() for t in _tensors(meta))  # no empty placeholders
    assert not hasattr(meta, "row_context_lens") and not hasattr(meta, "kernel")


def test_the_kernel_metadata_has_one_row_per_query_token_prefill_queries_included() -> None:
    eng, _, kern = _both_variants()
    meta = kern.meta
    assert isinstance(meta, KernelAttentionMetadata)
    rows = kern.input_ids.numel()
    assert meta.kernel is _not_a_kernel
    # Query i of a chunk starting at `start` reads start + i + 1 slots: the decode token 7, the prompt 1..9.
    want = [len(DECODE_PROMPT) + 1, *range(1, len(PREFILL_PROMPT) + 1), 1]
    assert meta.row_context_lens.tolist() == want and len(want) == rows
    max_blocks = -(-max(want) // BLOCK)
    assert meta.row_block_tables.shape == (rows, max_blocks)
    owner = ["d"] + ["p"] * len(PREFILL_PROMPT) + ["one"]
    for r, rid in enumerate(owner):
        table = eng.kv.block_table(rid)[:max_blocks]
        assert meta.row_block_tables[r, : len(table)].tolist() == table
    assert all(t.numel() for t in _tensors(meta))  # no empty placeholders
    assert meta.rows is None and meta.prefills == () and not hasattr(meta, "single_query")


def test_metadata_is_built_whole() -> None:
    _, ref, kern = _both_variants()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.meta.prefills = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        kern.meta.row_context_lens = torch.tensor([1])  # type: ignore[misc]
    with pytest.raises(ValueError, match="one table and one length per row"):
        KernelAttentionMetadata(
            torch.tensor([0, 1]), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), _not_a_kernel
        )
