"""Which of SmolLM2's linears cost int8-w8a8 its fidelity (docs/performance.md, "int8-w8a8").

Each linear alone in W8A8 (every other one fp32): the largest |logit difference| against fp32 over every position of
the prompts, and the share of positions whose argmax changes. Then the whole model in W8A8 with the k most
sensitive linears kept in fp32: greedy sequences identical to fp32's (the dense, no-cache pass), mean common prefix.

usage: .venv/bin/python scripts/w8a8_sensitivity.py [--prompts N] [--max-tokens T] [--keep 0,1,3,10,30]
Counts only; it prints no time.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn

from kvlab.bench.studies.fidelity import first_divergence
from kvlab.bench.workloads import shared_prefix_prompts
from kvlab.model import dense_generate, dense_logits, load_model
from kvlab.model.llama import LlamaModel
from kvlab.model.quant import LM_HEAD, W8A8Linear


@contextmanager
def in_w8a8(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """``model`` with the named linears swapped for W8A8 ones for the duration; the originals put back."""
    saved = {}
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        saved[name] = (owner, attr, getattr(owner, attr))
        setattr(owner, attr, W8A8Linear.from_linear(getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, lin in saved.values():
            setattr(owner, attr, lin)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--keep", default="0,1,3,10,30")
    args = ap.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2")
    model: LlamaModel = loaded.model
    prompts = shared_prefix_prompts(loaded, args.prompts)
    with torch.inference_mode():
        ref = [dense_logits(model, p).float() for p in prompts]
        linears = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != LM_HEAD]
        scores = {}
        for name in linears:
            with in_w8a8(model, [name]):
                got = [dense_logits(model, p).float() for p in prompts]
            diff = max(float((g - r).abs().max()) for g, r in zip(got, ref, strict=True))
            flips = sum(int((g.argmax(-1) != r.argmax(-1)).sum()) for g, r in zip(got, ref, strict=True))
            scores[name] = (diff, flips / sum(r.shape[0] for r in ref))
        ranked = sorted(linears, key=lambda n: scores[n][0], reverse=True)
        print(f"| linear alone in W8A8 | max abs logit diff | argmax changed ({args.prompts} prompts) |")
        print("|---|---|---|")
        for name in ranked[:12]:
            print(f"| {name} | {scores[name][0]:.2f} | {100 * scores[name][1]:.1f}% |")
        print(f"... {len(ranked)} linears; median {statistics.median(s[0] for s in scores.values()):.3f}")
        plain = [cast(list[int], dense_generate(model, p, args.max_tokens)) for p in prompts]
        print("\n| kept in fp32 | identical sequences | mean common prefix | max abs logit diff |")
        print("|---|---|---|---|")
        for k in (int(v) for v in args.keep.split(",")):
            with in_w8a8(model, ranked[k:]):
                toks = [cast(list[int], dense_generate(model, p, args.max_tokens)) for p in prompts]
                got = [dense_logits(model, p).float() for p in prompts]
            same = sum(a == b for a, b in zip(toks, plain, strict=True))
            prefix = statistics.fmean(first_divergence(a, b) for a, b in zip(toks, plain, strict=True))
            diff = max(float((g - r).abs().max()) for g, r in zip(got, ref, strict=True))
            print(f"| {k} most sensitive | {same}/{len(prompts)} | {prefix:.1f} | {diff:.2f} |")


if __name__ == "__main__":
    main()
