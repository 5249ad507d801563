"""The trainer, in its own process.

NCCL groups and CUDA IPC handles must never live in the pytest process, and a
hung or crashed trainer must be killable. ``run_trainer`` spawns
``python -m harness.trainer SPEC RESULT``; the child loads the weights with
Hugging Face on its device, optionally corrupts them (for the self-tests of
detection power), and pushes them through the backend's sender. The parent
bounds every run with a timeout; on timeout it asks the child to dump its
stacks (SIGUSR1, faulthandler) before killing it, and the error carries the
child's output and the server's log tail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

CORRUPTIONS = ("drop", "scale", "swap", "nothing", "nan")


class TrainerError(RuntimeError):
    pass


@dataclasses.dataclass
class TrainerSpec:
    url: str
    engine: str                      # shm | nccl | ipc
    packed: bool
    weights_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    corrupt: str | None = None       # one of CORRUPTIONS
    corrupt_target: str | None = None  # tensor name; default: picked deterministically
    timeout: float = 300.0           # per HTTP call
    options: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- child

def corrupt_weights(weights: list[tuple[str, Any]], kind: str | None, target: str | None = None
                    ) -> tuple[list[tuple[str, Any]], str]:
    """Return (weights, description). Deliberate damage for the self-tests."""
    if kind is None:
        return weights, "none"
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; known: {', '.join(CORRUPTIONS)}")
    names = [n for n, _ in weights]
    mats = [n for n, t in weights if t.ndim == 2 and "embed" not in n and "wte" not in n]
    pick = target or (mats[len(mats) // 2] if mats else names[len(names) // 2])
    if kind == "nothing":
        return [], "sent no tensor at all"
    if kind == "drop":
        return [(n, t) for n, t in weights if n != pick], f"dropped {pick}"
    if kind == "scale":
        return [(n, t * 1.01 if n == pick else t) for n, t in weights], f"scaled {pick} by 1.01"
    if kind == "nan":  # what a diverged training step pushes
        return [(n, t * float("nan") if n == pick else t) for n, t in weights], f"set {pick} to NaN"
    # swap: two different tensors of one shape trade contents
    shapes: dict[tuple, list[str]] = {}
    for n, t in weights:
        shapes.setdefault(tuple(t.shape), []).append(n)
    pair = next((v[:2] for v in shapes.values() if len(v) >= 2 and (pick in v or True)), None)
    if pair is None:
        raise ValueError("no two tensors share a shape: cannot swap")
    a, b = pair
    lookup = dict(weights)
    return [(b if n == a else a if n == b else n, lookup[n]) for n in names], f"swapped {a} and {b}"


def _child_main(spec_path: str, result_path: str) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    result: dict[str, Any] = {"ok": False}
    t0 = time.monotonic()
    try:
        spec = TrainerSpec(**json.loads(Path(spec_path).read_text()))
        import torch

        from harness.backends import sender_module
        from harness.client import ServerClient
        from harness.reference import load_hf_model

        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        model = load_hf_model(spec.weights_dir, spec.dtype, spec.device)
        weights = [(n, p.detach()) for n, p in model.named_parameters()]
        weights, what = corrupt_weights(weights, spec.corrupt, spec.corrupt_target)
        result["corruption"] = what
        result["load_seconds"] = time.monotonic() - t0
        client = ServerClient(spec.url, timeout=spec.timeout)
        t1 = time.monotonic()
        stats = sender_module(spec.engine).send(client, weights, packed=spec.packed,
                                                options=dict(spec.options, model=model))
        result.update(stats)
        result["sync_seconds"] = time.monotonic() - t1
        result["ok"] = True
    except BaseException as e:  # report everything, including KeyboardInterrupt
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    result["seconds"] = time.monotonic() - t0
    Path(result_path).write_text(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


# ----------------------------------------------------------------------------- parent

def run_trainer(spec: TrainerSpec, *, timeout: float = 600.0, env: dict | None = None,
                context: Callable[[], str] | None = None) -> dict:
    """Run one sync in a child process; return its result dict or raise TrainerError."""
    with tempfile.TemporaryDirectory(prefix="harness-trainer-") as tmp:
        spec_path, result_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        out_path = Path(tmp, "output.log")
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        with open(out_path, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "harness.trainer", str(spec_path),
                                     str(result_path)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=child_env,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    proc.send_signal(signal.SIGUSR1)  # stacks of every thread, to output.log
                    time.sleep(2)
                finally:
                    _kill_group(proc)
                raise TrainerError(
                    f"trainer ({spec.engine}, packed={spec.packed}, {spec.device}) did not "
                    f"finish within {timeout:.0f}s; its stacks and output:\n"
                    f"{_tail(out_path)}\n{context() if context else ''}") from None
            except BaseException:
                _kill_group(proc)
                raise
        if not result_path.exists():
            raise TrainerError(f"trainer exited with code {proc.returncode} without a result:\n"
                               f"{_tail(out_path)}\n{context() if context else ''}")
        result = json.loads(result_path.read_text())
        result["output_tail"] = _tail(out_path, 40)
        if not result["ok"]:
            raise TrainerError(f"trainer failed: {result['error']}\n{result.get('traceback', '')}"
                               f"\n{context() if context else ''}")
        return result


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=30)


def _tail(path: Path, lines: int = 80) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no trainer output)"


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], sys.argv[2]))
