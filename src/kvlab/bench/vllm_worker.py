"""The vLLM side of ``kvlab bench throughput --peers vllm``: run BY PATH in vLLM's own interpreter
(``$KVLAB_VLLM_PYTHON .../vllm_worker.py``), which has vLLM and no kvlab, so this file imports nothing but
the standard library and ``vllm``.

Protocol, one JSON object per line. The first line on stdin says how to build the engine::

    {"model": DIR, "llm": {"dtype": "float32", "enable_prefix_caching": true, ...}}

the worker answers ``{"ready": true, "version": ..., "setup": ...}`` (or ``{"error": ...}`` and exits); then
each line ``{"prompts": [[ids]], "max_tokens": N}`` is answered ``{"tokens": [[ids]], "seconds": s}`` (greedy,
EOS ignored, every prompt submitted at once) until ``{"op": "quit"}`` or the end of stdin. The answers go to
the stdout the worker was started with; everything else that would print there (vLLM's logging, its engine
core's) is sent to stderr, so no log line can be taken for an answer.
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
            params = vllm.SamplingParams(temperature=0, max_tokens=int(req["max_tokens"]), ignore_eos=True)
            prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in req["prompts"]]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            send({"tokens": [[int(t) for t in o.outputs[0].token_ids] for o in outs], "seconds": seconds})
        except Exception as exc:
            send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from rerunning this
    main()
