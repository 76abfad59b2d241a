"""The vLLM side of ``kvlab bench throughput --peers vllm``: run BY PATH in vLLM's own interpreter
(``$KVLAB_VLLM_PYTHON .../vllm_worker.py``), which has vLLM and no kvlab, so this file imports nothing but
the standard library and ``vllm``.

Protocol, one JSON object per line. The first line on stdin says how to build the engine::

    {"model": DIR, "llm": {"dtype": "float32", "enable_prefix_caching": true, ...}}

the worker answers ``{"ready": true, "version": ..., "setup": ...}`` (or ``{"error": ...}`` and exits); then
each request line is answered, until ``{"op": "quit"}`` or the end of stdin::

    {"rounds": [[[ids], ...], ...], "max_tokens": N, "n": 1, "temperature": 0.0, "top_k": 0,
     "reset_prefix_cache": false}
    -> {"tokens": [[ids], ...], "seconds": s, "round_seconds": [s, ...]}

Prompts are token ids. Each round's prompts are submitted at once (one ``generate``), a round only after the
previous one has finished (a chat's turns: a session's next prompt extends the last one, so vLLM's prefix
cache can serve it), all with the same sampling: ``n`` samples per prompt, EOS ignored, greedy at temperature 0
(vLLM refuses n > 1 there: n > 1 comes with a temperature and ``top_k``). ``tokens``: every sequence, round by
round, prompt by prompt, a prompt's n samples in their index order; ``seconds``: the sum of the rounds'
``generate`` wall times. ``reset_prefix_cache``: forget every cached prefix first (not timed), so a run finds
nothing a warm-up or an earlier run left. ``{"prompts": [[ids]], ...}`` is one round. ``{"op": "spec_metrics"}``
answers vLLM's speculative-decoding counters so far (``LLM.get_metrics()``): ``{"num_drafts": ..., "num_draft_tokens":
..., "num_accepted_tokens": ..., "num_accepted_tokens_per_pos": [...]}``, all 0 without speculation. Only ``rounds`` (or
``prompts``) and ``max_tokens`` are required. The answers go to the stdout the worker was started with;
everything else that would print there (vLLM's logging, its engine core's) is sent to stderr, so no log line
can be taken for an answer.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, TextIO


def _channel() -> TextIO:
    """The protocol's stdout; fd 1 becomes stderr for everybody else (the spawned engine core included)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _run(vllm: Any, llm: Any, req: dict[str, Any]) -> dict[str, Any]:
    """One request line: its rounds one after another, each timed around ``generate``."""
    sampling: dict[str, Any] = {
        "temperature": float(req.get("temperature", 0.0)),
        "max_tokens": int(req["max_tokens"]),
        "ignore_eos": True,
    }
    if int(req.get("n", 1)) != 1:
        sampling["n"] = int(req["n"])
    if int(req.get("top_k", 0)):
        sampling["top_k"] = int(req["top_k"])
    if req.get("seed") is not None:
        sampling["seed"] = int(req["seed"])
    params = vllm.SamplingParams(**sampling)
    rounds = req["rounds"] if "rounds" in req else [req["prompts"]]
    if req.get("reset_prefix_cache"):
        llm.reset_prefix_cache()
    tokens: list[list[int]] = []
    round_seconds: list[float] = []
    for prompts in rounds:
        batch = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        round_seconds.append(time.perf_counter() - t0)
        for o in outs:
            tokens += [[int(t) for t in c.token_ids] for c in sorted(o.outputs, key=lambda c: c.index)]
    return {"tokens": tokens, "seconds": sum(round_seconds), "round_seconds": round_seconds}


def _spec_metrics(llm: Any) -> dict[str, Any]:
    """vLLM's ``vllm:spec_decode_*`` counters, summed over its engines."""
    out: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_pos: list[float] = []
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in out:
            out[name] += metric.value
        elif name == "num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos or [0.0] * len(metric.values), metric.values, strict=True)]
    out["num_accepted_tokens_per_pos"] = per_pos
    return out


def main() -> None:
    proto = _channel()

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        hello = json.loads(sys.stdin.readline() or "{}")
        import vllm

        llm = vllm.LLM(model=hello["model"], **hello.get("llm", {}))
    except Exception as exc:
        send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return
    setup = ", ".join(f"{k}={v}" for k, v in sorted(hello.get("llm", {}).items()))
    send({"ready": True, "version": getattr(vllm, "__version__", "?"), "setup": setup})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            send(_spec_metrics(llm) if req.get("op") == "spec_metrics" else _run(vllm, llm, req))
        except Exception as exc:
            send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from rerunning this
    main()
