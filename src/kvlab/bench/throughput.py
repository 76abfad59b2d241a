"""Shared-prefix serving throughput: kvlab vs Hugging Face transformers on the same weights.

Workload W<N>: N requests sharing a ~100-token system prompt, each with its own question, 32 greedy
tokens each with EOS ignored. Every peer runs in the same process, one after another, on the same
number of threads, so the ratios compare like with like; outputs are checked token by token against
kvlab's. Each peer first runs a small warm-up (one-time initialisation is not what is measured), then
the workload ``repeats`` times; the best time counts (the usual choice on a shared machine: noise only
ever adds time).
"""

from __future__ import annotations

import copy
import functools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlab.bench.modes import Mode, engine_resident_bytes
from kvlab.bench.peers import PEERS
from kvlab.bench.peers import llama_cpp_available as llama_cpp_available  # where it was
from kvlab.bench.table import ResultTable, result_table
from kvlab.bench.vllm_peer import VLLM_CPU_BLOCK_SIZE, VLLMPeer
from kvlab.model.loader import LoadedModel

SYSTEM_PROMPT = (
    "You are a careful assistant for a travel agency. Answer in two short sentences, in plain English, "
    "without lists or headings. Mention prices only when the customer asks for them, never invent a "
    "booking reference, and if a question is about visas or health rules, tell the customer to check "
    "the official government website of the country they are travelling to before they book anything."
)
QUESTIONS = [
    "Which month is best to visit Lisbon?",
    "Can I bring my cat on a train to Vienna?",
    "What should I pack for Iceland in March?",
    "Is Kyoto crowded in April?",
    "How do I get from Rome to Naples?",
    "Do I need cash in Stockholm?",
    "What is a good day trip from Madrid?",
    "Is Prague walkable?",
    "Where can I see the northern lights?",
    "How early should I arrive for a ferry to Corsica?",
    "What is the weather like in Crete in May?",
    "Can children visit the Louvre for free?",
    "Is Budapest good for a weekend?",
    "What food should I try in Bologna?",
    "How long is the hike to Machu Picchu?",
    "Are trains in Switzerland expensive?",
]


@dataclass(frozen=True)
class PeerResult:
    name: str
    seconds: float
    tokens: list[list[int]]
    setup: str = ""  # how the peer was configured, printed with the result
    resident_mib: float | None = None  # kvlab modes: the engine's weights (packed copies included) + KV pool

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def shared_prefix_prompts(loaded: LoadedModel, n: int, seed: int = 0) -> list[list[int]]:
    """N prompts: one shared ~100-token system prompt + a distinct question each."""
    tok = loaded.tokenizer
    if loaded.config.vocab_size <= 512:  # byte-level mini: random bytes, 100 shared + 8-24 distinct
        rng = random.Random(seed)
        system = [rng.randrange(256) for _ in range(100)]
        return [system + [rng.randrange(256) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    prompts = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (case {i})")
        text = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}])
        prompts.append(tok.encode(text))
    return prompts


def best_of(repeats: int, run: Callable[[], PeerResult]) -> PeerResult:
    """The fastest of ``repeats`` runs (outputs must not change between runs)."""
    results = [run() for _ in range(repeats)]
    if any(r.tokens != results[0].tokens for r in results):
        raise RuntimeError(f"{results[0].name} gave different tokens on repeated greedy runs")
    return min(results, key=lambda r: r.seconds)


def kvlab_knobs(prompts: Sequence[list[int]], max_tokens: int, max_len: int, **knobs) -> dict:
    longest = max(len(p) for p in prompts) + max_tokens
    knobs.setdefault("max_model_len", min(max_len, max(longest, 128)))
    knobs.setdefault("num_blocks", max(256, len(prompts) * (-(-longest // 16) + 1)))
    knobs.setdefault("max_num_seqs", max(64, len(prompts)))
    knobs.setdefault("max_num_batched_tokens", 2048)
    return knobs


def run_kvlab(
    loaded: LoadedModel, prompts: Sequence[list[int]], max_tokens: int, mode: Mode | None = None, **knobs
) -> PeerResult:
    """One engine (built outside the timed region), all prompts submitted at once. ``loaded`` must be in the
    mode's dtype."""
    from kvlab import LLM, SamplingParams

    mode = mode or Mode()
    if str(loaded.model.dtype).removeprefix("torch.") != mode.dtype:
        raise ValueError(f"mode {mode.name!r} needs the model in {mode.dtype}, got {loaded.model.dtype}")
    knobs = kvlab_knobs(prompts, max_tokens, loaded.config.max_position_embeddings, **knobs)
    llm = LLM(loaded, **mode.engine_knobs(), **knobs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    dt = time.perf_counter() - t0
    setup = f"max_num_seqs={knobs['max_num_seqs']} max_num_batched_tokens={knobs['max_num_batched_tokens']}"
    weights, kv = engine_resident_bytes(llm.engine)
    return PeerResult(
        f"kvlab {mode.name}", dt, [list(o.token_ids) for o in outs], setup, resident_mib=(weights + kv) / 2**20
    )


@torch.inference_mode()
def run_hf_generate(hf, prompts: Sequence[list[int]], max_tokens: int, pad_id: int) -> PeerResult:
    """transformers ``generate``: one left-padded batch, greedy, fp32."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    # EOS ignored as kvlab's ignore_eos does it (no stop, no suppression): HF's min_new_tokens would forbid
    # EOS instead and change the tokens, so the peer runs with no EOS id at all.
    hf.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    out = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id
    )
    dt = time.perf_counter() - t0
    name = "hf-generate" if hf.dtype == torch.float32 else f"hf-generate {str(hf.dtype).removeprefix('torch.')}"
    return PeerResult(name, dt, [row[width:].tolist() for row in out], f"batch {len(prompts)}, left-padded")


@torch.inference_mode()
def run_hf_generate_batch(
    hf, prompts: Sequence[list[int]], max_tokens: int, pad_id: int, max_batch_tokens: int = 2048, page_size: int = 16
) -> PeerResult:
    """transformers continuous batching (``generate_batch``), paged cache sized explicitly: its automatic
    sizing assumes a GPU and takes ~9 GiB of host memory here."""
    import logging

    from transformers import ContinuousBatchingConfig, GenerationConfig

    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = len(prompts) * -(-longest // page_size) + 1
    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    cb = ContinuousBatchingConfig(
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        page_size=page_size,
        max_requests_per_batch=len(prompts),
    )
    # Its logger warns about psutil and the disabled EOS on every call; the numbers are what matters here.
    cb_log = logging.getLogger("ContinuousBatchingLogger")
    level = cb_log.level
    cb_log.setLevel(logging.ERROR + 10)
    try:
        t0 = time.perf_counter()
        out = hf.generate_batch(
            inputs=list(prompts), generation_config=gen, continuous_batching_config=cb, warmup=False
        )
        dt = time.perf_counter() - t0
    finally:
        cb_log.setLevel(level)
    results = list(out.values())
    errors = [r.error for r in results if r.error]
    if len(results) != len(prompts) or errors:
        raise RuntimeError(f"generate_batch returned {len(results)}/{len(prompts)} results, errors: {errors[:3]}")
    setup = f"num_blocks={num_blocks} page_size={page_size} max_batch_tokens={max_batch_tokens}"
    return PeerResult("hf-generate-batch", dt, [list(r.generated_tokens) for r in results], setup)


def run_llama_cpp(gguf: Path, prompts: Sequence[list[int]], max_tokens: int, threads: int) -> PeerResult:
    """llama.cpp through ``llama-cpp-python`` on the GGUF file itself (quantized weights), requests one by
    one as its single-sequence API serves them; it reuses the common prefix of consecutive prompts."""
    import llama_cpp

    longest = max(len(p) for p in prompts) + max_tokens
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=longest + 16, n_threads=threads, verbose=False)
    outputs = []
    t0 = time.perf_counter()
    for p in prompts:
        out: list[int] = []
        for tok in llm.generate(p, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == max_tokens:
                break
        outputs.append(out)
    dt = time.perf_counter() - t0
    return PeerResult("llama.cpp", dt, outputs, f"{gguf.name}, sequential, n_threads={threads}")


def agreement(reference: Sequence[list[int]], other: Sequence[list[int]]) -> tuple[int, float]:
    """(sequences identical, mean length of the common prefix) of another peer's outputs vs kvlab's."""
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(reference, other, strict=True)
    ]
    return same, sum(prefix) / len(prefix)


def run_vllm(peer: VLLMPeer, prompts: Sequence[list[int]], max_tokens: int) -> PeerResult:
    """vLLM's ``LLM.generate`` in its own interpreter (``VLLMPeer``): greedy, EOS ignored, all prompts at once;
    the seconds are vLLM's own wall time around ``generate``, as ``run_kvlab`` measures its own."""
    tokens, seconds = peer.generate(prompts, max_tokens)
    return PeerResult(f"vllm {peer.version}".strip(), seconds, tokens, peer.setup)


def vllm_knobs(prompts: Sequence[list[int]], max_tokens: int, max_len: int, max_num_batched_tokens: int) -> dict:
    """vLLM's engine arguments for the same workload as ``kvlab_knobs``: fp32, prefix caching on with the smallest
    block vLLM's CPU attention takes (a multiple of 32; its default, 128, is longer than the shared system
    prompt: nothing would hit), the same sequence and token budgets (kvlab's block count has no vLLM twin:
    VLLM_CPU_KVCACHE_SPACE sizes its pool)."""
    knobs = kvlab_knobs(prompts, max_tokens, max_len, max_num_batched_tokens=max_num_batched_tokens)
    return {
        "dtype": "float32",
        "seed": 0,
        "enable_prefix_caching": True,
        "block_size": VLLM_CPU_BLOCK_SIZE,
        "max_model_len": knobs["max_model_len"],
        "max_num_seqs": knobs["max_num_seqs"],
        "max_num_batched_tokens": knobs["max_num_batched_tokens"],
    }


@dataclass(frozen=True)
class ThroughputRow:
    workload: str
    result: PeerResult
    vs_kvlab: float  # the first kvlab mode's tokens/s divided by this row's: how many times faster it was
    identical: int | None  # sequences identical to the first kvlab mode's (None for that mode itself)
    common_prefix: float | None
    # This row's tokens/s over the baseline's (HF generate fp32 when it ran, else the first kvlab mode).
    vs_baseline: float = 1.0

    def as_dict(self) -> dict:
        r = self.result
        return {
            "workload": self.workload,
            "peer": r.name,
            "setup": r.setup,
            "seconds": round(r.seconds, 4),
            "output_tokens": r.output_tokens,
            "tokens_per_second": round(r.tokens_per_second, 2),
            "kvlab_speedup": round(self.vs_kvlab, 3),
            "speed_vs_baseline": round(self.vs_baseline, 3),
            "identical_outputs": self.identical,
            "mean_common_prefix": self.common_prefix,
            "resident_mib": None if r.resident_mib is None else round(r.resident_mib, 1),
        }


def throughput_table(rows: Sequence[ThroughputRow], model: str, max_tokens: int, threads: int) -> ResultTable:
    """The rows of ``compare_throughput`` as a table, its ratios against the baseline (HF generate fp32 when it
    ran) and the first kvlab mode (the first row)."""
    first = rows[0].result.name if rows else "kvlab"
    baseline = "HF generate fp32" if any(r.result.name == "hf-generate" for r in rows) else first
    columns = ("workload", "peer", "seconds", "output tok/s", f"x {baseline}", f"{first} speed-up")
    return result_table(
        f"throughput: {model}, {max_tokens} greedy tokens/request, {threads} threads",
        (*columns, "identical", "common prefix", "resident MiB", "setup"),
        [
            (
                row.workload,
                row.result.name,
                f"{row.result.seconds:.2f}",
                f"{row.result.tokens_per_second:.1f}",
                f"{row.vs_baseline:.2f}x",
                f"{row.vs_kvlab:.2f}x",
                "-" if row.identical is None else f"{row.identical}/{len(row.result.tokens)}",
                "-" if row.common_prefix is None else f"{row.common_prefix:.1f}",
                "-" if row.result.resident_mib is None else f"{row.result.resident_mib:.0f}",
                row.result.setup,
            )
            for row in rows
        ],
        notes=[
            "identical / common prefix: against the first kvlab mode; resident MiB: the engine's weights (packed "
            "and quantised copies included) plus its KV pool"
        ],
    )


def compare_throughput(
    loaded: LoadedModel,
    sizes: Sequence[int],
    max_tokens: int,
    peers: Sequence[str],
    hf_model=None,
    gguf: Path | None = None,
    threads: int = 1,
    repeats: int = 1,
    max_num_batched_tokens: int = 2048,
    modes: Sequence[Mode] = (Mode(),),
    model_in: Callable[[str], LoadedModel] | None = None,
    vllm_python: str | None = None,
    vllm_model: str | None = None,
) -> list[ThroughputRow]:
    """Every kvlab mode and each requested peer on W<N> for every N in ``sizes``. ``model_in(dtype)`` gives the
    model in a mode's dtype (default: ``loaded`` for float32 only). Peers that cannot run here (llama.cpp
    without ``llama-cpp-python`` or without a GGUF file) are left out by the caller. The ``vllm`` peer runs
    ``vllm.LLM`` in ``vllm_python`` (vLLM's own venv) on ``vllm_model`` (an HF directory of the same
    weights), one worker process for the whole comparison, sized for the largest workload. Ratios:
    ``vs_kvlab`` against the first mode, ``vs_baseline`` against HF ``generate`` in fp32 when it is among the
    peers."""
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; known: {', '.join(PEERS)}")
    if not modes:
        raise ValueError("at least one kvlab mode")
    if "vllm" in peers and not (vllm_python and vllm_model):
        raise ValueError("the vllm peer needs vllm_python (vLLM's interpreter) and vllm_model (an HF directory)")

    def fp32_only(dtype: str) -> LoadedModel:
        if dtype != "float32":
            raise ValueError(f"no model in {dtype} was given (pass model_in)")
        return loaded

    model_of = model_in or fp32_only
    pad = loaded.tokenizer.eos_token_id or 0

    def llama_cpp(ps: list[list[int]]) -> PeerResult:
        if gguf is None:
            raise ValueError("the llama.cpp peer needs a GGUF file")
        return run_llama_cpp(gguf, ps, max_tokens, threads)

    @functools.cache
    def hf_bf16() -> Any:
        return copy.deepcopy(hf_model).to(torch.bfloat16)

    def kvlab(ps: list[list[int]], mode: Mode) -> PeerResult:
        return run_kvlab(model_of(mode.dtype), ps, max_tokens, mode, max_num_batched_tokens=max_num_batched_tokens)

    runners: dict[str, Callable[[list[list[int]]], PeerResult]] = {
        f"kvlab {m.name}": functools.partial(kvlab, mode=m) for m in modes
    }
    vllm_peer: VLLMPeer | None = None

    def vllm(ps: list[list[int]]) -> PeerResult:
        nonlocal vllm_peer
        if vllm_peer is None:
            assert vllm_python is not None and vllm_model is not None
            largest = shared_prefix_prompts(loaded, max(sizes))
            knobs = vllm_knobs(largest, max_tokens, loaded.config.max_position_embeddings, max_num_batched_tokens)
            vllm_peer = VLLMPeer(vllm_python, vllm_model, knobs, threads=threads).start()
        return run_vllm(vllm_peer, ps, max_tokens)

    runners |= {
        "vllm": vllm,
        "hf-generate": lambda ps: run_hf_generate(hf_model, ps, max_tokens, pad),
        "hf-generate-bf16": lambda ps: run_hf_generate(hf_bf16(), ps, max_tokens, pad),
        "hf-generate-batch": lambda ps: run_hf_generate_batch(
            hf_model, ps, max_tokens, pad, max_batch_tokens=max_num_batched_tokens
        ),
        "llama.cpp": llama_cpp,
    }
    order = [f"kvlab {m.name}" for m in modes] + list(peers)
    try:
        return _compare(loaded, sizes, order, runners, repeats)
    finally:
        if vllm_peer is not None:
            vllm_peer.close()


def _compare(
    loaded: LoadedModel,
    sizes: Sequence[int],
    order: Sequence[str],
    runners: dict[str, Callable[[list[list[int]]], PeerResult]],
    repeats: int,
) -> list[ThroughputRow]:
    rows = []
    for n in sizes:
        prompts = shared_prefix_prompts(loaded, n)
        results: dict[str, PeerResult] = {}
        for name in order:
            run = runners[name]
            run(prompts[:2])  # warm-up: lazy initialisation, allocator growth, oneDNN kernel selection
            results[name] = best_of(repeats, functools.partial(run, prompts))
        first = results[order[0]]
        base = results.get("hf-generate", first)
        for name in order:
            res = results[name]
            same, pref = (None, None) if res is first else agreement(first.tokens, res.tokens)
            rows.append(
                ThroughputRow(
                    f"W{n}",
                    res,
                    first.tokens_per_second / res.tokens_per_second,
                    same,
                    pref,
                    vs_baseline=res.tokens_per_second / base.tokens_per_second,
                )
            )
    return rows
