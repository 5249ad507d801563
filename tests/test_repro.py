"""``harness repro``'s emitted script against the installed vLLM: its shm plugin inside
a vLLM process, its trainer-API detection, and a whole run against a real CPU server."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.commands import cli
from harness.commands.repro import emit as repro_emit

if importlib.util.find_spec("vllm") is None:  # asked without importing vLLM here
    pytest.skip("needs vLLM installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


def _emit(tmp_path: Path, name: str, *argv: str) -> Path:
    path = tmp_path / name
    assert cli.main(["repro", *argv, "--emit-only", "--emit", str(path)]) == 0
    return path


def _load(path: Path):
    """Import an emitted script as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(f"emitted_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shm_plugin_registers_the_engine_in_a_vllm_process(tmp_path):
    script = _load(_emit(tmp_path, "repro_plugin.py"))
    d = script.write_shm_plugin(tmp_path / "plugin", repro_emit.SHM_ENGINE)
    eps = [ep for dist in importlib.metadata.distributions(path=[str(d)])
           for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in eps] == [
        ("repro_shm", "repro_shm_plugin:register_shm_engine")]
    assert (d / "repro_shm_engine.py").read_text() == repro_emit.SHM_ENGINE.read_text()  # as given
    assert (d / "repro_shm_plugin.py").read_text() == Path(script.__file__).read_text()
    # what vLLM does in each process it starts: load the entry point, call it, and later
    # let the factory import the engine class
    code = ("import importlib.metadata as md\n"
            f"ep = [e for d in md.distributions(path=[{str(d)!r}]) for e in d.entry_points][0]\n"
            "ep.load()()\n"
            "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory\n"
            "print(WeightTransferEngineFactory._registry['repro_shm']().__name__)\n")
    env = dict(os.environ, PYTHONPATH=str(d))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ShmWeightTransferEngine"


def test_trainer_api_agrees_with_the_harness_on_the_installed_vllm():
    """The script's detection and harness.vllm.api's, on the vLLM installed here."""
    from harness.transfer import registry

    probe = registry.probe(isolated=True)
    code = ("import harness.portable.trainer_api as s\n"
            "for e in ('nccl', 'ipc'):\n"
            "    try: print(e, s.trainer_api(e))\n"
            "    except s.Unusable as x: print(e, 'unusable', x)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-3000:]
    got = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line[:4] in ("nccl",
                                                                                     "ipc "))
    for engine in ("nccl", "ipc"):
        path = probe[f"{engine}_path"]
        if path in ("factory", "static"):
            assert got[engine] == path, (engine, got, path)
        else:
            assert got[engine].startswith("unusable"), (engine, got, path)


def test_an_emitted_script_holds_the_installed_vllms_trainer_api(tmp_path):
    """Without --trainer-api, a script holds the API the installed release offers."""
    from harness.transfer import registry

    probe = registry.probe(isolated=True)
    for engine in ("nccl", "ipc"):
        if probe[f"{engine}_path"] not in ("factory", "static"):
            continue
        text = _emit(tmp_path, f"{engine}.py", "--vllm-backend", engine).read_text()
        assert repro_emit.read_scenario(text)["trainer_api"] == probe[f"{engine}_path"]


def python_without_the_harness(root: Path, env: dict) -> Path:
    """A Python with this environment's packages (vLLM, torch, ...) but not the harness,
    as a bug reporter's: a venv without pip whose site-packages links every entry of ours
    except the harness's own (its package, its dist-info with the vLLM plugin entry
    point, and the .pth or finder of its editable install). Asserted: ``import harness``
    fails there, ``import safetensors`` works."""
    import sysconfig

    venv = root / "venv-without-the-harness"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120, stdin=subprocess.DEVNULL)
    py = venv / "bin" / "python"
    theirs = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig."
                                  "get_paths()['purelib'])"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout.strip())
    ours = list(dict.fromkeys(
        [Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")]
        + [Path(p) for p in sys.path if p.endswith(("site-packages", "dist-packages"))]))

    def the_harness(entry: Path) -> bool:
        name = entry.name.lower().replace("-", "_")
        if name == "harness" or "weight_sync_harness" in name:
            return True
        if entry.suffix == ".pth":
            text = entry.read_text(errors="replace")
            return str(ROOT) in text or "weight_sync_harness" in text
        return False

    for site in ours:
        for entry in (site.iterdir() if site.is_dir() else ()):
            if not the_harness(entry) and not (theirs / entry.name).exists():
                (theirs / entry.name).symlink_to(entry)
    check = subprocess.run([str(py), "-c", "import safetensors\nimport harness"],
                           capture_output=True, text=True, timeout=120, cwd=root, env=env,
                           stdin=subprocess.DEVNULL)
    assert check.returncode != 0 and "No module named 'harness'" in check.stderr, (
        "the harness is importable where the emitted script must run without it: "
        + check.stdout[-500:] + check.stderr[-1500:])
    return py


def test_an_emitted_shm_script_reproduces_parity_against_a_real_server(tmp_path):
    """The script, run as a bug reporter would (its own process, its own vLLM server on
    the CPU, a Python in which the harness cannot be imported), gets parity and exits 0.
    Its second file, the shm engine, carries the reload calls it takes from the harness."""
    path = _emit(tmp_path, "repro_case.py")
    engine = (path.parent / repro_emit.engine_file_name(path)).read_text()
    assert "import harness" not in engine and "from harness" not in engine
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    py = python_without_the_harness(tmp_path, env)
    out = subprocess.run([str(py), str(path), "--workdir", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path,
                         stdin=subprocess.DEVNULL, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "[9/9] verdict: PARITY" in out.stdout
    assert "REPRODUCED: the verdict is 'parity', as expected." in out.stdout


@pytest.mark.gpu
def test_an_emitted_ipc_script_reproduces_parity_on_a_gpu_without_the_harness(tmp_path):
    """The CUDA IPC script (one file), run as a bug reporter would: its own process, its
    own vLLM server on GPU 0, a Python in which the harness cannot be imported; it gets
    parity and exits 0. (vLLM 0.26's IPC engine imports ray: stubbed where it is not
    installed.)"""
    import importlib.util

    if not os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() or not _has_cuda():
        pytest.skip("CUDA IPC needs a GPU")
    path = _emit(tmp_path, "repro_ipc.py", "--vllm-backend", "ipc")
    text = path.read_text()
    assert "import harness" not in text and "from harness" not in text
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    py = python_without_the_harness(tmp_path, env)
    argv = [str(py), str(path), "--workdir", str(tmp_path / "work")]
    if importlib.util.find_spec("ray") is None:
        argv.append("--stub-ray")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                         stdin=subprocess.DEVNULL, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "REPRODUCED: the verdict is 'parity', as expected." in out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("drop_last", [False, True], ids=["same", "harness-drops-one"])
@pytest.mark.parametrize("packed", [True, False], ids=["ipc-packed", "ipc-unpacked"])
def test_the_harness_and_an_emitted_script_send_the_same_ipc_bytes(packed, drop_last,
                                                                   tmp_path):
    """One IPC sender, on the installed vLLM and a GPU: the harness's and an emitted
    script's updates, their handles opened in another process as vLLM's worker opens
    them, carry the same names, dtypes, shapes and bytes, every tensor's. With the
    harness's sender leaving out a tensor on purpose, the comparison tells them apart."""
    import json

    if not os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() or not _has_cuda():
        pytest.skip("CUDA IPC needs a GPU")
    script = _emit(tmp_path, "ipc.py", "--vllm-backend", "ipc")
    argv = [sys.executable, str(ROOT / "tests" / "ipc_capture.py"), str(script)]
    r = subprocess.run(argv + ["--packed"] * packed + ["--drop-last"] * drop_last, cwd=ROOT,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    updates = {who: [c[1] for c in got[who] if c[0] == "/update_weights"]
               for who in ("harness", "script")}
    sent = {who: ([n for u in ups for n in u["names"]], [h for u in ups for h in u["sha256"]])
            for who, ups in updates.items()}
    assert sent["script"] == (got["names"], got["sha256"]), got["script"]
    if drop_last:
        assert sent["harness"] == (got["names"][:-1], got["sha256"][:-1])
        assert got["harness"] != got["script"]
    else:
        assert got["harness"] == got["script"], (got["harness_api"], got["script_api"])
        assert packed == all(u.get("tensor_sizes") for u in updates["harness"])


def _has_cuda() -> bool:
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
