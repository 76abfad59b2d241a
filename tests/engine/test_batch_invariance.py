"""Whether a request's K/V depend on the other requests of its steps (docs/serving.md, "What changes an answer").

Only this crosses tenants whose caches are apart: if a row's last bits depend on its step, a rounding cache can
turn another tenant's traffic into a different answer. ``int8-w8a8-head`` with ``cpp`` computes every row on its
own (int32 sums in every linear and the head, one kernel walk a request), and the test holds its K/V bit-identical
alone and beside other prompts, in every layer. The control is the fp32 reference path, where torch's SDPA
computes the decode rows of a step together: there the same comparison finds rows that differ, which is what
shows that the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.attention.flash import flash_prefill_kernel
from kvlab.attention.paged import PagedAttention
from kvlab.engine.llm import LLM
from kvlab.engine.sampling import SamplingParams
from kvlab.model import load_model
from kvlab.model.int8_linear import vnni_kernel_ready

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 101, 108, 108, 32, 109, 101]
OTHERS = [
    [87, 104, 121] * 15,  # longer than the prompt: the decode rows of a step have other contexts
    [65, 32, 99, 97, 116],
    [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120] * 2,
]
STEPS = 6


def _written_k(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[torch.Tensor], list[int]]:
    """Every K row the engine computes in each layer over a greedy run of ``prompts`` ([rows, Hkv x D] a layer), and
    the last prompt's tokens."""
    written: dict[int, list[torch.Tensor]] = {}
    plain = PagedAttention.__call__

    def recording(self, layer, q, k, v):  # type: ignore[no-untyped-def]
        written.setdefault(layer, []).append(k.detach().float().reshape(k.shape[0], -1).clone())
        return plain(self, layer, q, k, v)

    with monkeypatch.context() as m:
        m.setattr(PagedAttention, "__call__", recording)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    return [torch.cat(written[layer]) for layer in sorted(written)], list(outs[-1].outputs[0].token_ids)


def _rows_that_differ(alone: list[torch.Tensor], beside: list[torch.Tensor]) -> int:
    """How many of the lone run's K rows, over all layers, are not found bit for bit among the other run's (each
    matched to its nearest row there: the same token at the same position, whoever else ran)."""
    differ = 0
    for a, b in zip(alone, beside, strict=True):
        nearest = b[torch.cdist(a, b).argmin(dim=1)]
        differ += int((a != nearest).any(dim=1).sum())
    return differ


@pytest.fixture
def two_threads():
    """Two torch threads (the suite runs on one, where SDPA splits no row's work)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not vnni_kernel_ready(), reason="int8-w8a8's VNNI kernel needs AVX512-VNNI")
def test_int8_w8a8_head_rows_do_not_depend_on_the_other_requests_of_their_step(two_threads, monkeypatch) -> None:
    loaded = load_model("mini", dtype=torch.bfloat16)

    def run(prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[int]]:
        llm = LLM(loaded, quantization="int8-w8a8-head", attention_backend="cpp")
        return _written_k(llm, prompts, monkeypatch)

    alone, tokens = run([PROMPT])
    assert sum(k.shape[0] for k in alone) == len(alone) * (len(PROMPT) + STEPS - 1)
    for others in (OTHERS[:1], OTHERS, OTHERS[::-1]):
        beside, beside_tokens = run([*others, PROMPT])
        assert _rows_that_differ(alone, beside) == 0 and beside_tokens == tokens


def test_the_control_fp32_reference_decode_rows_depend_on_their_step(two_threads, monkeypatch) -> None:
    loaded = load_model("mini")

    alone, _ = _written_k(LLM(loaded), [PROMPT], monkeypatch)
    beside, _ = _written_k(LLM(loaded), [*OTHERS, PROMPT], monkeypatch)
    # Rows from the second layer on (the first layer's K is the embedding's projection alone) differ.
    assert _rows_that_differ(alone, beside) > 0


def test_a_bf16_prompt_after_a_cache_hit_or_in_chunks_is_computed_as_when_fresh(two_threads, monkeypatch) -> None:
    """With the flash kernels, a prompt's rows computed after a cached prefix (a prefix-cache hit's last token, a
    later chunk of a chunked prefill) are the fresh prefill's bit for bit, K/V and tokens: they take the flash
    kernel as the whole prompt did. Before, a hit's one-row tail took the row kernel, one bf16 step apart, and
    changed 11 of 20 SmolLM2 answers in the probe (docs/serving.md, "What changes an answer"). In bf16 the linears
    are kvlab's own up to 64 rows, each row alike; in fp32 oneDNN's give a lone row other bits than 21 together."""
    dtype = torch.bfloat16
    if flash_prefill_kernel(dtype) is None:
        pytest.skip("no flash prefill kernel for this dtype on this CPU")
    loaded = load_model("mini", dtype=dtype)
    fresh, tokens = _written_k(LLM(loaded, attention_backend="cpp"), [PROMPT], monkeypatch)

    cached = LLM(loaded, attention_backend="cpp")
    cached.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # now in the cache
    after_hit, hit_tokens = _written_k(cached, [PROMPT], monkeypatch)
    assert sum(k.shape[0] for k in after_hit) == len(after_hit) * STEPS  # only the last prompt token and the rest
    assert _rows_that_differ(after_hit, fresh) == 0 and hit_tokens == tokens

    chunked = LLM(loaded, attention_backend="cpp", max_num_batched_tokens=10, enable_prefix_caching=False)
    in_chunks, chunk_tokens = _written_k(chunked, [PROMPT], monkeypatch)  # chunks of 10, 10 and 1
    assert _rows_that_differ(in_chunks, fresh) == 0 and chunk_tokens == tokens
