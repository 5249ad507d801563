"""shm (the harness's reference backend): safetensors on /dev/shm.

vLLM loads weight-transfer engines in the worker processes it spawns, so the script
registers the worker-side engine (a file next to it, a copy of
harness/transfer/shm_engine.py) through a vLLM general plugin: ``setup_shm`` puts a copy
of the script (``__file__``: this code runs inside the emitted script) and of the engine
file in WORKDIR/plugin with a *.dist-info/entry_points.txt, first on the PYTHONPATH the
server inherits; vLLM then calls ``register_shm_engine`` in every process it starts. The
engine is registered as "repro_shm", so that an installed harness (which registers "shm")
cannot shadow it."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.portable.base import Unusable
from harness.portable.bucketing import buckets

SHM_BACKEND = "repro_shm"          # the name the shm engine is registered under here
SHM_ENGINE_MODULE = "repro_shm_engine"
SHM_PLUGIN_MODULE = "repro_shm_plugin"
DEFAULT_BUCKET_BYTES = 16 << 20  # unpacked: buckets of at most this many bytes


def setup_shm(sc: dict[str, Any], workdir: Path) -> None:
    """Before the server starts: the plugin directory first on the PYTHONPATH it inherits."""
    plugin = write_shm_plugin(workdir / "plugin", shm_engine_file(sc))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin),
                                                             os.environ.get("PYTHONPATH")]))


def send_shm(client: Any, weights: list, sc: dict[str, Any], timeout: float) -> str:
    """A fresh directory on /dev/shm for the group (/init_weight_transfer_engine), then
    one update of its buckets (``send_buckets``)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="repro-shm-", dir=base))
    try:
        client.init_weight_transfer_engine({"root": str(root)})
        send_buckets(client, weights, root, None if sc["packed"] else DEFAULT_BUCKET_BYTES)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return "safetensors buckets on tmpfs, routes called by this script"


def send_buckets(client: Any, weights: Any, root: Path, bucket_bytes: int | None,
                 bucket_delay_s: float = 0.0, weight_version: str | None = None) -> dict:
    """One update (/start_weight_update ... /finish_weight_update) of a group already
    opened: one safetensors file per bucket under ``root`` (``bucket_bytes`` None: one
    bucket), each named in an /update_weights with the names, dtypes and shapes it holds,
    and removed once the server has acknowledged it. The harness's shm sender and the
    repro scripts both send through this function. ``bucket_delay_s``: a wait after each
    acknowledged bucket but the last (the fault tests stop a trainer mid-update);
    ``weight_version`` rides /finish_weight_update."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    sent: dict[str, Any] = {"tensors": 0, "bytes": 0, "buckets": 0, "names": []}
    client.start_weight_update()
    for i, bucket in enumerate(buckets(weights, bucket_bytes)):
        # [region harness]
        if i and bucket_delay_s:
            print(f"shm: {i} bucket(s) acknowledged, waiting {bucket_delay_s}s", flush=True)
            time.sleep(bucket_delay_s)
        # [end]
        path = root / f"bucket-{os.getpid()}-{i:05d}.safetensors"
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in bucket}
        save_file(tensors, str(path))
        try:
            client.update_weights({
                "path": str(path), "names": [n for n, _ in bucket],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket]})
        finally:
            path.unlink(missing_ok=True)
        sent["buckets"] += 1
        sent["tensors"] += len(bucket)
        sent["bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        sent["names"] += [n for n, _ in bucket]
    # [region harness]
    if weight_version is not None:
        client.finish_weight_update(weight_version)
        return sent
    # [end]
    client.finish_weight_update()
    return sent


def register_shm_engine() -> None:
    """vLLM general plugin (the entry point write_shm_plugin writes): register the shm
    engine file copied next to this module as the weight-transfer backend "repro_shm"."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if SHM_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(SHM_BACKEND, SHM_ENGINE_MODULE,
                                                    "ShmWeightTransferEngine")


def shm_engine_file(sc: dict[str, Any]) -> Path:
    name = sc.get("shm_engine_file")
    path = Path(__file__).resolve().parent / (name or "")
    if not name or not path.is_file():
        raise Unusable(f"the shm backend needs its engine file next to this script ({name}): "
                       "`harness repro --emit` writes the two files together; copy both")
    return path


def write_shm_plugin(plugin_dir: Path, engine_file: Path) -> Path:
    """A directory that makes vLLM register the shm engine in each of its processes
    once it is on their PYTHONPATH: the engine module, this script as the plugin
    module, and a *.dist-info whose entry_points.txt names register_shm_engine."""
    plugin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(engine_file, plugin_dir / f"{SHM_ENGINE_MODULE}.py")
    shutil.copyfile(Path(__file__).resolve(), plugin_dir / f"{SHM_PLUGIN_MODULE}.py")
    info = plugin_dir / f"{SHM_PLUGIN_MODULE}-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: repro-shm-plugin\n"
                                   "Version: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{SHM_BACKEND} = {SHM_PLUGIN_MODULE}:register_shm_engine\n")
    return plugin_dir
