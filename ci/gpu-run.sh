#!/usr/bin/env bash
# Run the suite on a GPU machine that already has vLLM and torch installed but may
# have no package index: registers this package (entry points for the pytest
# plugin and the shm vLLM plugin) without fetching anything, then runs pytest.
#
#   bash ci/gpu-run.sh OUTDIR [pytest args...]
#
# Writes OUTDIR/report.json (the harness report), OUTDIR/junit.xml, OUTDIR/pytest.log
# and OUTDIR/logs.tgz (every server's and trainer's log). The run implies
# --harness-require-gpu: it fails when no GPU is visible, or when the GPU cases it
# selected did not run.
#
# GPU_RUN_SECONDS=N: interrupt pytest after N seconds (Ctrl-C: servers are stopped and
# the report is written), killing it 90 s later if it does not stop: the controller
# gives its workers up to 60 s to stop their servers (26 s for a worker's on 1 x H200),
# then writes the report. Use it under a job limit, N at least 90 s below it; even a
# killed run leaves the report of the tests that finished. Started in
# the background (a CI step, `cmd &`, nohup), pytest begins with SIGINT ignored; the
# harness takes it back once it starts servers, so the limit still interrupts it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: ci/gpu-run.sh OUTDIR [pytest args...]}; shift
mkdir -p "$out"
if ! python3 -c "import importlib.metadata as m; m.version('weight-sync-harness')" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>"$out/install.log" || {
    # No pip-usable setuptools: write egg-info next to the sources; importlib.metadata
    # finds its entry points through PYTHONPATH.
    python3 -c "from setuptools import setup; setup()" -q egg_info >>"$out/install.log" 2>&1
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  }
fi
nvidia-smi --query-gpu=index,name,uuid,memory.total --format=csv > "$out/gpus.csv" 2>&1 || true
limit=()
[ -n "${GPU_RUN_SECONDS:-}" ] && limit=(timeout --signal=INT --kill-after=90 "$GPU_RUN_SECONDS")
# Tests side by side (pytest-xdist, whole servers per worker: harness/run/parallel.py):
# GPU_RUN_WORKERS workers, "auto" (the host's concurrent starts, at most 8) unless the
# arguments name -n themselves; 0 runs the tests one after another.
workers=()
case " $* " in
  *" -n "*|*" -n"[0-9a]*|*" --numprocesses"*) ;;
  *) python3 -c "import xdist" 2>/dev/null && workers=(-n "${GPU_RUN_WORKERS:-auto}") ;;
esac
# --harness-require-gpu: a GPU run whose GPU cases did not run fails. Without it,
# `-k ipc` on a runner that lost its GPUs ran only the unit tests named *ipc* and passed.
# --rootdir and the = forms: pytest picks its rootdir from path-like arguments before it
# knows the plugin's options, so an existing OUT outside the clone must not be one.
"${limit[@]}" python3 -m pytest --rootdir="$PWD" --harness-require-gpu \
  --harness-report="$out/report.json" --junitxml="$out/junit.xml" --vllm-log-dir="$out/logs" \
  "${workers[@]}" "$@" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
tar czf "$out/logs.tgz" -C "$out" logs 2>/dev/null && rm -rf "$out/logs"
exit "$rc"
