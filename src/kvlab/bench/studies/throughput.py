"""Serving throughput: kvlab's modes vs Hugging Face transformers, llama.cpp and vLLM on the same weights.


Workloads (``--workloads``, built in ``kvlab.bench.workloads``; every sequence 32 tokens with EOS ignored, greedy
unless said otherwise): shared-prefix (W<N>), no-sharing, long-context, chat and parallel.

Every peer but vLLM runs in the same process, one after another, on the same number of threads, so the ratios
compare like with like; vLLM runs in its own interpreter (``vllm_peer``), one worker per dtype. Outputs are
checked token by token against the first kvlab mode's. Each peer first runs a small warm-up (one-time
initialisation is not what is measured), then the workload ``repeats`` times, each time on a cold prefix cache
(a new kvlab engine; vLLM's cache reset); the best time counts (the usual choice on a shared machine: noise only
ever adds time).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlab.bench.modes import Mode, engine_resident_bytes
from kvlab.bench.peers.plan import PEERS, VLLM_PEERS
from kvlab.bench.peers.plan import llama_cpp_available as llama_cpp_available  # where it was
from kvlab.bench.peers.vllm_peer import VLLM_CPU_BLOCK_SIZE, VLLMPeer
from kvlab.bench.studies.floor import Machine, WorkCosts
from kvlab.bench.table import ResultTable, result_table
from kvlab.bench.workloads import Workload, WorkloadSizes, as_workload, build_workloads
from kvlab.config import admission_blocks, blocks_for
from kvlab.model.loader import LoadedModel

DEFAULT_SIZES = WorkloadSizes()  # every workload at its usual size


@dataclass(frozen=True)
class PeerResult:
    name: str
    seconds: float
    tokens: list[list[int]]
    setup: str = ""  # how the peer was configured, printed with the result
    resident_mib: float | None = None  # kvlab modes: the engine's weights (packed copies included) + KV pool
    floor_seconds: float | None = None  # kvlab modes: the least time its steps' work could take here (floor.py)
    floor_machine: Machine | None = None  # the limits floor_seconds was priced at

    @property
    def floor_share(self) -> float | None:
        """The floor over the time taken: 1.0 would be this machine's limit for the work done."""
        return None if self.floor_seconds is None else self.floor_seconds / self.seconds

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def best_of(repeats: int, run: Callable[[], PeerResult], strict: bool = True) -> PeerResult:
    """The fastest of ``repeats`` runs. Outputs must not change between runs of kvlab (``strict``: an error);
    a peer's that do (vLLM in bf16 batches its rows differently from run to run) are said in its setup, unless
    its runs do not even return the same number of sequences (an error too)."""
    results = [run() for _ in range(repeats)]
    fastest = min(results, key=lambda r: r.seconds)
    first = results[0].tokens
    if all(r.tokens == first for r in results):
        return fastest
    if strict or any(len(r.tokens) != len(first) for r in results):
        raise RuntimeError(f"{results[0].name} gave different tokens on repeated greedy runs")
    differing = sum(any(r.tokens[i] != seq for r in results) for i, seq in enumerate(first))
    note = f"its {repeats} runs differed in {differing} of {len(first)} sequences (the fastest's compared)"
    return dataclasses.replace(fastest, setup=f"{fastest.setup}, {note}" if fastest.setup else note)


def kvlab_knobs(prompts: Sequence[list[int]], max_tokens: int, max_len: int, **knobs) -> dict:
    longest = max(len(p) for p in prompts) + max_tokens
    knobs.setdefault("max_model_len", min(max_len, max(longest, 128)))
    knobs.setdefault("num_blocks", max(256, admission_blocks(longest, 16, len(prompts))))
    knobs.setdefault("max_num_seqs", max(64, len(prompts)))
    knobs.setdefault("max_num_batched_tokens", 2048)
    return knobs


def run_kvlab(
    loaded: LoadedModel,
    prompts: Sequence[list[int]] | Workload,
    max_tokens: int,
    mode: Mode | None = None,
    machine: Machine | None = None,
    **knobs,
) -> PeerResult:
    """One engine (built outside the timed region) for the whole workload: each round's prompts submitted at
    once, the rounds one after another (the time is the rounds' sum). ``loaded`` must be in the mode's dtype.
    With ``machine`` (its measured peaks) the engine logs each step's work and the result carries the floor."""
    from kvlab import LLM, SamplingParams

    w = as_workload(prompts)
    mode = mode or Mode()
    if str(loaded.model.dtype).removeprefix("torch.") != mode.dtype:
        raise ValueError(f"mode {mode.name!r} needs the model in {mode.dtype}, got {loaded.model.dtype}")
    knobs = kvlab_knobs(w.peak(), max_tokens, loaded.config.max_position_embeddings, **knobs)
    llm = LLM(loaded, **mode.engine_knobs(), **knobs)
    params = SamplingParams(
        n=w.n, temperature=w.temperature, top_k=w.top_k, seed=w.seed, max_tokens=max_tokens, ignore_eos=True
    )
    tokens: list[list[int]] = []
    dt = 0.0
    if machine is not None:
        llm.engine.work_log = []
    for batch in w.rounds:
        t0 = time.perf_counter()
        outs = llm.generate(list(batch), params, use_tqdm=False)
        dt += time.perf_counter() - t0
        if errors := [o.error for o in outs if o.error]:
            raise RuntimeError(f"kvlab {mode.name}: {len(errors)} request(s) failed: {errors[0]}")
        tokens += [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    setup = f"max_num_seqs={knobs['max_num_seqs']} max_num_batched_tokens={knobs['max_num_batched_tokens']}"
    setup += f", {len(w.rounds)} rounds" if len(w.rounds) > 1 else ""
    weights, kv = engine_resident_bytes(llm.engine)
    log = llm.engine.work_log  # a list exactly when machine is given
    floor = None if log is None or machine is None else WorkCosts.of(llm.engine).floor_s(log, machine)
    return PeerResult(
        f"kvlab {mode.name}",
        dt,
        tokens,
        setup,
        resident_mib=(weights + kv) / 2**20,
        floor_seconds=floor,
        floor_machine=None if floor is None else machine,
    )


def _in_rounds(w: Workload, run_round: Callable[[list[list[int]]], PeerResult]) -> PeerResult:
    """A peer without a cache across calls, round by round: the seconds summed, the tokens in order."""
    results = [run_round(batch) for batch in w.rounds]
    setup = results[0].setup + (f", {len(results)} rounds" if len(results) > 1 else "")
    return PeerResult(results[0].name, sum(r.seconds for r in results), [t for r in results for t in r.tokens], setup)


def _hf_sampling(n: int) -> dict[str, Any]:
    """HF's arguments for the workload's sampling: greedy, or n samples at temperature 1 with top_k 1 (its
    greedy search refuses num_return_sequences > 1)."""
    if n == 1:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": 1.0, "top_k": 1, "num_return_sequences": n}


def run_hf_generate(hf, prompts: Sequence[list[int]] | Workload, max_tokens: int, pad_id: int) -> PeerResult:
    """transformers ``generate``: one left-padded batch per round, fp32 (or the model's dtype); n > 1 as
    ``num_return_sequences`` (each prompt repeated n times in the batch: nothing shared)."""
    w = as_workload(prompts)
    return _in_rounds(w, functools.partial(_hf_generate_round, hf, max_tokens=max_tokens, pad_id=pad_id, n=w.n))


@torch.inference_mode()
def _hf_generate_round(hf, prompts: list[list[int]], max_tokens: int, pad_id: int, n: int) -> PeerResult:
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
        input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, pad_token_id=pad_id, **_hf_sampling(n)
    )
    dt = time.perf_counter() - t0
    name = "hf-generate" if hf.dtype == torch.float32 else f"hf-generate {str(hf.dtype).removeprefix('torch.')}"
    setup = f"batch {len(prompts)}, left-padded" + (f", num_return_sequences={n}" if n > 1 else "")
    return PeerResult(name, dt, [row[width:].tolist() for row in out], setup)


def run_hf_generate_batch(
    hf,
    prompts: Sequence[list[int]] | Workload,
    max_tokens: int,
    pad_id: int,
    max_batch_tokens: int = 2048,
    page_size: int = 16,
) -> PeerResult:
    """transformers continuous batching (``generate_batch``), one call per round, paged cache sized explicitly:
    its automatic sizing assumes a GPU and takes ~9 GiB of host memory here. n > 1 as ``num_return_sequences``
    (it forks the children)."""
    w = as_workload(prompts)
    run = functools.partial(
        _hf_generate_batch_round, hf, max_tokens=max_tokens, pad_id=pad_id, n=w.n,
        max_batch_tokens=max_batch_tokens, page_size=page_size,
    )  # fmt: skip
    return _in_rounds(w, run)


@torch.inference_mode()
def _hf_generate_batch_round(
    hf, prompts: list[list[int]], max_tokens: int, pad_id: int, n: int, max_batch_tokens: int, page_size: int
) -> PeerResult:
    import logging

    from transformers import ContinuousBatchingConfig, GenerationConfig

    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = len(prompts) * n * blocks_for(longest, page_size) + 1
    gen = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=pad_id, **_hf_sampling(n))
    cb = ContinuousBatchingConfig(
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        page_size=page_size,
        max_requests_per_batch=len(prompts) * n,
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
    # A request's children ("<id>__child#<k>") come before it: each request's sequences in sample order.
    groups: dict[str, list[Any]] = {}
    for r in out.values():
        groups.setdefault(r.request_id.partition("__child#")[0], []).append(r)
    results = [
        r for g in groups.values() for r in sorted(g, key=lambda r: int(r.request_id.partition("__child#")[2] or -1))
    ]
    errors = [r.error for r in results if r.error]
    if len(results) != len(prompts) * n or errors:
        raise RuntimeError(f"generate_batch returned {len(results)}/{len(prompts) * n} results, errors: {errors[:3]}")
    setup = f"num_blocks={num_blocks} page_size={page_size} max_batch_tokens={max_batch_tokens}"
    setup += f", num_return_sequences={n}" if n > 1 else ""
    return PeerResult("hf-generate-batch", dt, [list(r.generated_tokens) for r in results], setup)


def run_llama_cpp(gguf: Path, prompts: Sequence[list[int]] | Workload, max_tokens: int, threads: int) -> PeerResult:
    """llama.cpp through ``llama-cpp-python`` on the GGUF file itself (quantized weights), requests one by
    one as its single-sequence API serves them (n > 1: each prompt n times in a row, greedy); it reuses the
    common prefix of consecutive prompts."""
    import llama_cpp

    w = as_workload(prompts)
    longest = max(len(p) for p in w.prompts) + max_tokens
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=longest + 16, n_threads=threads, verbose=False)
    outputs = []
    t0 = time.perf_counter()
    for p in (p for batch in w.rounds for p in batch for _ in range(w.n)):
        out: list[int] = []
        for tok in llm.generate(p, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == max_tokens:
                break
        outputs.append(out)
    dt = time.perf_counter() - t0
    setup = f"{gguf.name}, sequential, n_threads={threads}" + (f", each prompt {w.n} times" if w.n > 1 else "")
    return PeerResult("llama.cpp", dt, outputs, setup)


def agreement(reference: Sequence[list[int]], other: Sequence[list[int]]) -> tuple[int, float]:
    """(sequences identical, mean length of the common prefix) of another peer's outputs vs kvlab's."""
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(reference, other, strict=True)
    ]
    return same, sum(prefix) / len(prefix)


def run_vllm(
    peer: VLLMPeer, prompts: Sequence[list[int]] | Workload, max_tokens: int, quantization: str | None = None
) -> PeerResult:
    """vLLM's ``LLM.generate`` in its own interpreter (``VLLMPeer``): EOS ignored, each round's prompts at once,
    on a cold prefix cache (reset before the run, as each kvlab run builds a new engine); the seconds are vLLM's
    own wall time around each ``generate``, summed, as ``run_kvlab`` measures its own. ``quantization``: what the
    peer's directory holds, for its name (vLLM reads it from the directory's config, not from an argument)."""
    w = as_workload(prompts)
    tokens, seconds = peer.run(
        w.rounds, max_tokens, n=w.n, temperature=w.temperature, top_k=w.top_k, seed=w.seed, reset_prefix_cache=True
    )
    dtype = str(peer.llm_kwargs.get("dtype", "float32"))
    name = f"vllm {peer.version}".strip() + ("" if dtype == "float32" else f" {dtype}")
    name += f" + {quantization}" if quantization else ""
    kv = peer.llm_kwargs.get("kv_cache_dtype")
    name += f" + kv {kv}" if kv else ""
    return PeerResult(name, seconds, tokens, peer.setup)


def vllm_knobs(
    prompts: Sequence[list[int]],
    max_tokens: int,
    max_len: int,
    max_num_batched_tokens: int,
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
) -> dict:
    """vLLM's engine arguments for the same workload as ``kvlab_knobs``: fp32 (or ``dtype``; the KV cache in
    ``kv_cache_dtype``), prefix caching on
    with the smallest block vLLM's CPU attention takes (a multiple of 32; its default, 128, is longer than the
    shared system prompt: nothing would hit), the same sequence and token budgets (kvlab's block count has no
    vLLM twin: VLLM_CPU_KVCACHE_SPACE sizes its pool)."""
    knobs = kvlab_knobs(prompts, max_tokens, max_len, max_num_batched_tokens=max_num_batched_tokens)
    kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    return {
        "dtype": dtype,
        **kv,
        "seed": 0,
        "enable_prefix_caching": True,
        "block_size": VLLM_CPU_BLOCK_SIZE,
        "max_model_len": knobs["max_model_len"],
        "max_num_seqs": knobs["max_num_seqs"],
        "max_num_batched_tokens": knobs["max_num_batched_tokens"],
    }


@dataclass(frozen=True)
class ThroughputRow:
    workload: str  # the workload's label: W16, chat 8x4, ...
    result: PeerResult
    vs_kvlab: float  # the first kvlab mode's tokens/s divided by this row's: how many times faster it was
    identical: int | None  # sequences identical to the first kvlab mode's (None for that mode itself)
    common_prefix: float | None
    # This row's tokens/s over the baseline's (HF generate fp32 when it ran, else the first kvlab mode).
    vs_baseline: float = 1.0
    kind: str = "shared-prefix"  # which of THROUGHPUT_WORKLOADS
    requests: int = 0  # prompts, over all rounds
    n: int = 1  # samples per prompt
    rounds: int = 1
    note: str = ""  # the workload's, printed under the table

    def as_dict(self) -> dict:
        r = self.result
        return {
            "workload": self.workload,
            "workload_kind": self.kind,
            "requests": self.requests,
            "n": self.n,
            "rounds": self.rounds,
            "peer": r.name,
            "setup": r.setup,
            "seconds": round(r.seconds, 4),
            "output_tokens": r.output_tokens,
            "tokens_per_second": round(r.tokens_per_second, 2),
            "kvlab_speedup": round(self.vs_kvlab, 3),
            "speed_vs_baseline": round(self.vs_baseline, 3),
            "identical_outputs": self.identical,
            "sequences": len(r.tokens),
            "mean_common_prefix": self.common_prefix,
            "resident_mib": None if r.resident_mib is None else round(r.resident_mib, 1),
            "floor_seconds": None if r.floor_seconds is None else round(r.floor_seconds, 4),
            "floor_share": None if r.floor_share is None else round(r.floor_share, 3),
            "floor_priced_at": None if r.floor_machine is None else r.floor_machine.as_dict(),
        }


def throughput_table(rows: Sequence[ThroughputRow], model: str, max_tokens: int, threads: int) -> ResultTable:
    """The rows of ``compare_throughput`` as a table, its ratios against the baseline (HF generate fp32 when it
    ran) and the first kvlab mode (the first row), the workloads' notes under it; where its rows carry floors, the
    limits they were priced at (one run's, the same for every row) in its title."""
    first = rows[0].result.name if rows else "kvlab"
    machine = next((r.result.floor_machine for r in rows if r.result.floor_machine is not None), None)
    baseline = "HF generate fp32" if any(r.result.name == "hf-generate" for r in rows) else first
    columns = ("workload", "peer", "seconds", "output tok/s", f"x {baseline}", f"{first} speed-up", "of floor")
    return result_table(
        f"throughput: {model}, {max_tokens} tokens per sequence (greedy, EOS ignored), {threads} threads"
        + ("" if machine is None else f"; floors priced at {machine.summary()}"),
        (*columns, "identical", "common prefix", "resident MiB", "setup"),
        [
            (
                row.workload,
                row.result.name,
                f"{row.result.seconds:.2f}",
                f"{row.result.tokens_per_second:.1f}",
                f"{row.vs_baseline:.2f}x",
                f"{row.vs_kvlab:.2f}x",
                "-" if row.result.floor_share is None else f"{row.result.floor_share:.0%}",
                "-" if row.identical is None else f"{row.identical}/{len(row.result.tokens)}",
                "-" if row.common_prefix is None else f"{row.common_prefix:.1f}",
                "-" if row.result.resident_mib is None else f"{row.result.resident_mib:.0f}",
                row.result.setup,
            )
            for row in rows
        ],
        notes=[
            "identical / common prefix: sequences against the first kvlab mode's; resident MiB: the engine's "
            "weights (packed and quantised copies included) plus its KV pool; every run on a cold prefix cache",
            "of floor: the least time this machine could take for the work of the run's own steps (each step: its "
            "FLOPs at the mode's matmul peaks (int8-w8a8's linears at the int8 peak) or its weight and K/V bytes "
            "at the memory bandwidth, the larger; peaks measured in this run) over the time taken; kvlab's modes "
            "only: a peer's steps are not seen",
            *dict.fromkeys(row.note for row in rows if row.note),
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
    vllm_w8a8_model: str | None = None,
    workloads: Sequence[str] = ("shared-prefix",),
    workload_sizes: WorkloadSizes = DEFAULT_SIZES,
    machine: Machine | None = None,
) -> list[ThroughputRow]:
    """Every kvlab mode and each requested peer on each of ``workloads`` (``build_workloads``: shared-prefix is
    W<N> for every N in ``sizes``). ``model_in(dtype)`` gives the model in a mode's dtype (default: ``loaded``
    for float32 only). Peers that cannot run here (llama.cpp without ``llama-cpp-python`` or without a GGUF
    file) are left out by the caller. The ``vllm`` and ``vllm-bf16`` peers run ``vllm.LLM`` in ``vllm_python``
    (vLLM's own venv) on ``vllm_model`` (an HF directory of the same weights) in float32 and bfloat16, the
    ``vllm-w8a8`` ones on ``vllm_w8a8_model`` (the same weights as W8A8 int8 codes): one worker process per peer,
    sized for the largest workload, started for its peer's runs and ended after them. Each
    peer runs every workload before the next peer starts. Ratios: ``vs_kvlab`` against the first mode,
    ``vs_baseline`` against HF ``generate`` in fp32 when it is among the peers. ``machine``: this machine's
    measured peaks, for each kvlab row's floor (``floor.py``)."""
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; known: {', '.join(PEERS)}")
    if not modes:
        raise ValueError("at least one kvlab mode")
    kinds = [VLLM_PEERS[p] for p in peers if p in VLLM_PEERS]
    if any(k.quantization is None for k in kinds) and not (vllm_python and vllm_model):
        raise ValueError("the vllm peers need vllm_python (vLLM's interpreter) and vllm_model (an HF directory)")
    if any(k.quantization for k in kinds) and not (vllm_python and vllm_w8a8_model):
        raise ValueError("the vllm-w8a8 peers need vllm_python and vllm_w8a8_model (an HF directory of W8A8 codes)")
    plan = build_workloads(loaded, workloads, sizes, max_tokens, workload_sizes)

    def fp32_only(dtype: str) -> LoadedModel:
        if dtype != "float32":
            raise ValueError(f"no model in {dtype} was given (pass model_in)")
        return loaded

    model_of = model_in or fp32_only
    pad = loaded.tokenizer.eos_token_id or 0

    def llama_cpp(w: Workload) -> PeerResult:
        if gguf is None:
            raise ValueError("the llama.cpp peer needs a GGUF file")
        return run_llama_cpp(gguf, w, max_tokens, threads)

    @functools.cache
    def hf_bf16() -> Any:
        return copy.deepcopy(hf_model).to(torch.bfloat16)

    def kvlab(w: Workload, mode: Mode) -> PeerResult:
        return run_kvlab(
            model_of(mode.dtype), w, max_tokens, mode, machine, max_num_batched_tokens=max_num_batched_tokens
        )

    runners: dict[str, Callable[[Workload], PeerResult]] = {
        f"kvlab {m.name}": functools.partial(kvlab, mode=m) for m in modes
    }
    vllm_peers: dict[str, VLLMPeer] = {}
    # What every vLLM worker is sized for: the longest prompt, as many times as the most sequences at once.
    peak = [max((p for w in plan for p in w.prompts), key=len)] * max(len(w.peak()) for w in plan)

    def vllm(w: Workload, peer: str) -> PeerResult:
        kind = VLLM_PEERS[peer]
        if peer not in vllm_peers:
            where = vllm_w8a8_model if kind.quantization else vllm_model
            assert vllm_python is not None and where is not None
            max_len = loaded.config.max_position_embeddings
            knobs = vllm_knobs(peak, max_tokens, max_len, max_num_batched_tokens, kind.dtype, kind.kv_cache_dtype)
            vllm_peers[peer] = VLLMPeer(vllm_python, where, knobs, threads=threads).start()
        return run_vllm(vllm_peers[peer], w, max_tokens, kind.quantization)

    def close(peer: str) -> None:
        if peer in vllm_peers:
            vllm_peers.pop(peer).close()

    runners |= {peer: functools.partial(vllm, peer=peer) for peer in VLLM_PEERS}
    runners |= {
        "hf-generate": lambda w: run_hf_generate(hf_model, w, max_tokens, pad),
        "hf-generate-bf16": lambda w: run_hf_generate(hf_bf16(), w, max_tokens, pad),
        "hf-generate-batch": lambda w: run_hf_generate_batch(
            hf_model, w, max_tokens, pad, max_batch_tokens=max_num_batched_tokens
        ),
        "llama.cpp": llama_cpp,
    }
    order = [f"kvlab {m.name}" for m in modes] + list(peers)
    try:
        return _compare(plan, order, runners, repeats, close)
    finally:
        for peer in list(vllm_peers):
            close(peer)


def _compare(
    plan: Sequence[Workload],
    order: Sequence[str],
    runners: dict[str, Callable[[Workload], PeerResult]],
    repeats: int,
    close: Callable[[str], None] = lambda peer: None,
) -> list[ThroughputRow]:
    """Each runner of ``order`` on every workload (warm-up, then the best of ``repeats``), one runner after the
    other (``close(name)`` after its last workload); the rows workload by workload."""
    results: dict[tuple[str, str], PeerResult] = {}
    for name in order:
        run = runners[name]
        try:
            for w in plan:
                run(w.warmup())  # lazy initialisation, allocator growth, oneDNN kernel selection
                results[name, w.name] = best_of(repeats, functools.partial(run, w), strict=name.startswith("kvlab"))
        finally:
            close(name)
    rows = []
    for w in plan:
        first = results[order[0], w.name]
        base = results.get(("hf-generate", w.name), first)
        for name in order:
            res = results[name, w.name]
            same, pref = (None, None) if res is first else agreement(first.tokens, res.tokens)
            rows.append(
                ThroughputRow(
                    w.name,
                    res,
                    first.tokens_per_second / res.tokens_per_second,
                    same,
                    pref,
                    vs_baseline=res.tokens_per_second / base.tokens_per_second,
                    kind=w.kind,
                    requests=len(w.prompts),
                    n=w.n,
                    rounds=len(w.rounds),
                    note=w.note,
                )
            )
    return rows
