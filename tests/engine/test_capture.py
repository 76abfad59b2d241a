from __future__ import annotations

import torch

from kvlab import LLM, SamplingParams
from kvlab.instrument.attention import AttentionCapture
from oracle_cache import mini


def test_capture_on_and_off_give_identical_outputs_and_rows_sum_to_one() -> None:
    prompts = [list(range(10, 50)), list(range(10, 45)) + [7, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)
    plain = LLM(mini(), block_size=8).generate(prompts, params)
    cap = AttentionCapture()
    seen = LLM(mini(), block_size=8, capture=cap).generate(prompts, params)
    for a, b in zip(plain, seen, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.outputs[0].logits, b.outputs[0].logits)
    records = [r for recs in cap.records.values() for r in recs]
    assert {r.layer for r in records} == {0, 1, 2, 3}
    prefill = [r for r in records if len(r.q_positions) > 1]
    decode = [r for r in records if len(r.q_positions) == 1]
    assert prefill and decode
    for r in records:
        torch.testing.assert_close(r.probs.sum(-1), torch.ones(r.probs.shape[:2]), rtol=0, atol=1e-5)
        # causal: a query at position p gives no weight to later keys
        for i, p in enumerate(r.q_positions):
            assert float(r.probs[:, i, p + 1 :].abs().sum()) == 0.0


def test_capture_only_chosen_requests_and_layers() -> None:
    cap = AttentionCapture(request_ids=["want"], layers=[3])
    llm = LLM(mini(), capture=cap)
    eng = llm.engine
    eng.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=3), request_id="want")
    eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3), request_id="other")
    while eng.has_unfinished_requests():
        eng.step()
    assert set(cap.records) == {"want"}
    assert {r.layer for r in cap.records["want"]} == {3}
    assert len(cap.decode_rows("want", 3)) == 2  # first token comes from the prefill, then 2 decodes
