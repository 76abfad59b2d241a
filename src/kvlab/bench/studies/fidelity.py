"""Fidelity of the reduced-precision modes, measured against fp32 (and, for ``gguf``, against Hugging Face
transformers' dequantised model of the same file).

Workload: the W<N> prompts of ``kvlab bench throughput`` (``shared_prefix_prompts``), greedy, EOS ignored.
Per mode and reference:

- identical: requests whose ``max_tokens`` greedy tokens equal the reference's, all of them;
- first divergence p50: the median position of the first differing token, an identical request counting
  as ``max_tokens`` (so a p50 of ``max_tokens`` means at least half the requests never diverged);
- max |logit difference| on the prompts: one dense forward pass over each prompt (every position) in the
  mode, against the reference's; the largest absolute difference over every position and vocabulary entry.
  The mode's pass runs the mode's own linears (``kvlab.model.quant``) through the dense attention, so it
  measures the weights and kernels; with a KV dtype of its own (``kv-fp8``, ...), K and V are rounded in that pass
  as its cache stores them (``DenseCausalAttention(kv_dtype=)``), so it measures the cache's rounding too.

Outputs of the engine are compared, so the mode's tokens include everything the engine does (batching,
prefix sharing): the fp32 engine gives the dense oracle's tokens (the engine's own tests), so fp32 engine
tokens stand for fp32.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvlab.bench.modes import Mode
from kvlab.bench.table import ResultTable, result_table
from kvlab.bench.workloads import shared_prefix_prompts
from kvlab.model.llama import LlamaModel
from kvlab.model.loader import LoadedModel, load_model
from kvlab.model.reference import dense_logits

FP32 = "kvlab float32"
HF = "HF transformers (dequantised GGUF, fp32)"


@dataclass(frozen=True)
class Run:
    """What one mode (or reference) produced on the workload."""

    tokens: list[list[int]]
    prompt_logits: list[torch.Tensor]  # [prompt length, vocab] fp32, per prompt


@dataclass(frozen=True)
class FidelityRow:
    mode: str
    reference: str
    requests: int
    identical: int
    first_divergence_p50: float  # identical requests count as max_tokens
    max_logit_diff: float  # over every prompt position and vocabulary entry
    prompt_argmax_agreement: float  # fraction of prompt positions whose top token is the reference's

    @property
    def identical_fraction(self) -> float:
        return self.identical / self.requests

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"identical_fraction": self.identical_fraction}


def fidelity_table(
    rows: Sequence[FidelityRow], model: str, requests: int, max_tokens: int, threads: int
) -> ResultTable:
    """The rows of ``measure_fidelity`` as a table (a first divergence at ``max_tokens``: none, shown with a +)."""
    return result_table(
        f"fidelity: {model}, W{requests}, {max_tokens} greedy tokens/request, {threads} threads",
        ("mode", "reference", "identical", "first divergence p50", "max |Δlogit| (prompt)", "top-1 agree"),
        [
            (
                r.mode,
                r.reference,
                f"{r.identical}/{r.requests} ({r.identical_fraction:.0%})",
                f"{r.first_divergence_p50:.1f}" + ("+" if r.first_divergence_p50 >= max_tokens else ""),
                f"{r.max_logit_diff:.4f}",
                f"{r.prompt_argmax_agreement:.3f}",
            )
            for r in rows
        ],
        notes=[
            f"first divergence: position of the first differing token, an identical request counting as {max_tokens}; "
            "quantised linears run with bf16 activations in every dtype (kvlab.model.quant)"
        ],
    )


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token; the shorter length if one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(mode: str, reference: str, run: Run, ref: Run, max_tokens: int) -> FidelityRow:
    div = [first_divergence(a, b) for a, b in zip(run.tokens, ref.tokens, strict=True)]
    agree = [
        (x.argmax(-1) == y.argmax(-1)).float().mean().item()
        for x, y in zip(run.prompt_logits, ref.prompt_logits, strict=True)
    ]
    return FidelityRow(
        mode=mode,
        reference=reference,
        requests=len(div),
        identical=sum(a == b for a, b in zip(run.tokens, ref.tokens, strict=True)),
        first_divergence_p50=float(statistics.median(min(d, max_tokens) for d in div)),
        max_logit_diff=max(
            float((x - y).abs().max()) for x, y in zip(run.prompt_logits, ref.prompt_logits, strict=True)
        ),
        prompt_argmax_agreement=statistics.fmean(agree),
    )


def run_kvlab(
    loaded: LoadedModel,
    prompts: Sequence[list[int]],
    max_tokens: int,
    quantization: str | None,
    kv_cache_dtype: str = "auto",
) -> Run:
    """The engine's greedy tokens and the mode's dense prompt logits (K/V rounded as its cache stores them)."""
    from kvlab import LLM, SamplingParams
    from kvlab.bench.studies.throughput import kvlab_knobs
    from kvlab.model.quant import quantized_model

    knobs = kvlab_knobs(prompts, max_tokens, loaded.config.max_position_embeddings, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(loaded, quantization=quantization, **knobs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    model: LlamaModel = loaded.model if quantization is None else quantized_model(loaded, quantization)
    logits = [dense_logits(model, p, kv_dtype=llm.engine.storage.dtype).float() for p in prompts]
    return Run([list(o.outputs[0].token_ids) for o in outs], logits)


@torch.inference_mode()
def run_hf(hf: Any, prompts: Sequence[list[int]], max_tokens: int) -> Run:
    """transformers, one prompt at a time (no padding to blur the comparison), greedy, no EOS."""
    hf.generation_config.eos_token_id = None
    tokens, logits = [], []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(p) :].tolist())
        logits.append(hf(ids).logits[0].float())
    return Run(tokens, logits)


def measure_fidelity(
    spec: str,
    modes: Sequence[Mode],
    requests: int = 16,
    max_tokens: int = 32,
    against_hf: bool = True,
    reference: LoadedModel | None = None,
) -> list[FidelityRow]:
    """Every mode against fp32; modes with ``gguf`` (and fp32 itself, as the baseline) also against HF's
    dequantised model of the same file when ``against_hf``. ``reference``: ``spec`` already loaded in fp32
    (other dtypes are loaded from ``spec``). Modes a model cannot run raise ConfigError."""
    reference = reference or load_model(spec)
    prompts = shared_prefix_prompts(reference, requests)
    ref = run_kvlab(reference, prompts, max_tokens, None)
    loaded = {"float32": reference}
    runs: dict[Mode, Run] = {}
    for mode in modes:
        if mode.dtype not in loaded:
            from kvlab.engine.llm import resolve_dtype

            loaded[mode.dtype] = load_model(spec, dtype=resolve_dtype(mode.dtype))
        runs[mode] = (
            ref
            if mode == Mode("float32", None)
            else run_kvlab(loaded[mode.dtype], prompts, max_tokens, mode.quantization, mode.kv_cache_dtype)
        )
    rows = [compare(m.name, FP32, r, ref, max_tokens) for m, r in runs.items()]
    gguf_modes = [m for m in modes if m.quantization == "gguf"]
    if against_hf and gguf_modes and reference.source is not None:
        from kvlab.bench.peers.plan import hf_from_gguf

        hf = run_hf(hf_from_gguf(reference.source), prompts, max_tokens)
        rows.append(compare(Mode("float32", None).name, HF, ref, hf, max_tokens))
        rows += [compare(m.name, HF, runs[m], hf, max_tokens) for m in gguf_modes]
    return rows
