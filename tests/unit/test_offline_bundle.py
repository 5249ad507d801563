"""ci/offline_bundle.py: what a runner lacks, how the pieces are cut, and the runner's side
(pieces arriving a few at a time, verified, joined and unpacked into a scratch site).
No package index and no GPU: wheels are made here, and `make`'s resolver is fed text."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "ci" / "offline_bundle.py")
ob = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ob)

needs_zstd = pytest.mark.skipif(not shutil.which("zstd"), reason="the zstd program is not installed")

COMPILED = """\
torch==2.13.0
    # via
    #   vllm
    #   tilelang
nvidia-nccl-cu13==2.29.7
    # via torch
tilelang==0.1.12
    # via vllm
z3-solver==4.15.4.0
    # via tilelang
numpy==2.3.5
    # via
    #   tilelang
    #   vllm
transformers==5.17.0
    # via vllm
vllm==0.32.0
    # via -r requirements.in
"""


def test_the_resolver_output_is_read_with_its_parents():
    pins, via = ob.parse_compiled(COMPILED)
    assert pins["torch"] == "2.13.0" and pins["vllm"] == "0.32.0"
    assert via["torch"] == {"vllm", "tilelang"}
    assert via["z3-solver"] == {"tilelang"}
    assert via["vllm"] == set()


def test_what_the_runner_has_is_not_carried_and_left_out_packages_take_their_own_deps(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# a comment\ntorch==2.11.0\nnvidia_nccl_cu13==2.28.9\nNumPy==2.5.2\ntransformers==5.17.0\n"
                      "z3-solver\nfoo @ file:///x/foo.whl\n")
    have = ob.read_freeze(freeze)
    assert have == {"torch": "2.11.0", "nvidia-nccl-cu13": "2.28.9", "numpy": "2.5.2",
                    "transformers": "5.17.0", "z3-solver": None, "foo": None}
    pins, via = ob.parse_compiled(COMPILED)
    carry, why = ob.choose(pins, via, have, leave_out={"tilelang"}, keep_runner={"numpy"}, root="vllm")
    # another version on the runner: carried; a bare name: kept; keep_runner: kept
    assert carry == {"torch": "2.13.0", "nvidia-nccl-cu13": "2.29.7", "vllm": "0.32.0"}
    assert why["transformers"] == "on the runner (5.17.0)"
    assert why["numpy"].startswith("runner's 2.5.2 kept")
    assert why["tilelang"] == "left out (profile)"
    assert why["z3-solver"] == "needed only by left-out tilelang"
    assert "torch" in carry  # tilelang is left out, but vllm still needs torch


def test_a_freeze_line_it_cannot_read_is_one_line(tmp_path, capsys):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch>=2\n")
    with pytest.raises(SystemExit) as e:
        ob.read_freeze(freeze)
    assert e.value.code == 2
    assert "cannot read line 'torch>=2'" in capsys.readouterr().err


def test_platform_tags_cover_every_older_glibc():
    tags = ob.platform_tags("x86_64-manylinux_2_39")
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_5_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux_2_40_x86_64" not in tags
    with pytest.raises(SystemExit):
        ob.platform_tags("win_amd64")


def _wheel(dest: Path, name: str, files: dict[str, bytes]) -> Path:
    w = dest / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return w


def _bundle(tmp_path: Path, piece_bytes: int) -> tuple[Path, dict]:
    """A two-layer bundle made with make's own steps from wheels built here."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    big = bytes(range(256)) * 4096  # 1 MiB that compresses poorly enough to need pieces
    import os
    noise = os.urandom(300_000)
    layers = {
        "alpha": [_wheel(wheels, "alpha", {"alpha/__init__.py": b"VALUE = 'alpha'\n", "alpha/blob.bin": noise,
                                           "alpha-1.0.data/purelib/alpha_extra.py": b"X = 1\n",
                                           "alpha-1.0.data/scripts/alpha": b"#!/bin/sh\n"})],
        "beta": [_wheel(wheels, "beta", {"beta/__init__.py": b"from alpha import VALUE\nBETA = VALUE + '+beta'\n",
                                         "beta/big.bin": big, "beta/fa2.so": b"x" * 1000})],
    }
    out = tmp_path / "bundle"
    out.mkdir()
    manifest = {"vllm": "0.0.0", "layers": [], "piece_bytes": piece_bytes}
    for i, (name, ws) in enumerate(layers.items()):
        root = tmp_path / f"site-{name}"
        for w in ws:
            ob.unpack_wheel(w, root)
        freed = ob.slim(root, ["beta/fa2.so", "**/__pycache__"])
        zst = tmp_path / f"{name}.tar.zst"
        ob.compress(root, zst, level=3)
        pieces = ob.split(zst, piece_bytes, f"{i + 1:02d}-{name}", out)
        manifest["layers"].append({"name": name, "packages": [f"{name}==1.0"], "unpacked_bytes": 1,
                                   "slimmed_bytes": freed, "pieces": pieces})
    (out / ob.MANIFEST).write_text(json.dumps(manifest))
    shutil.copy(ROOT / "ci" / "offline_bundle.py", out / ob.INSTALLER)
    return out, manifest


@needs_zstd
def test_pieces_never_exceed_their_size_and_join_back_bit_for_bit(tmp_path):
    out, manifest = _bundle(tmp_path, piece_bytes=100_000)
    for layer in manifest["layers"]:
        sizes = [p["bytes"] for p in layer["pieces"]]
        assert max(sizes) <= 100_000
        assert all(s == 100_000 for s in sizes[:-1])
    alpha = manifest["layers"][0]["pieces"]
    assert len(alpha) >= 3  # 300 kB of noise
    joined = b"".join((out / p["file"]).read_bytes() for p in alpha)
    assert joined == (tmp_path / "alpha.tar.zst").read_bytes()


@needs_zstd
def test_slimming_removes_the_named_paths_and_says_how_much(tmp_path):
    _, manifest = _bundle(tmp_path, piece_bytes=1 << 20)
    beta = manifest["layers"][1]
    assert beta["slimmed_bytes"] == 1000
    assert not (tmp_path / "site-beta" / "beta" / "fa2.so").exists()


def _install(bundle: Path, site: Path, keep: Path, *extra: str, env: dict | None = None):
    return subprocess.run([sys.executable, str(ROOT / "ci" / "offline_bundle.py"), "install", "--bundle", str(bundle),
                           "--site", str(site), "--keep", str(keep), "--no-check", *extra],
                          text=True, capture_output=True, timeout=120, env=env)


@needs_zstd
def test_pieces_arriving_over_several_transfers_install_layer_by_layer(tmp_path):
    out, manifest = _bundle(tmp_path, piece_bytes=100_000)
    site, keep = tmp_path / "runner-site", tmp_path / "keep"
    files = sorted(p.name for p in out.iterdir() if ".part" in p.name)
    alpha_files = [p["file"] for p in manifest["layers"][0]["pieces"]]
    # transfer 1: the manifest, the installer and all but the last piece of alpha
    t1 = tmp_path / "t1"
    t1.mkdir()
    for f in [ob.MANIFEST, ob.INSTALLER, *alpha_files[:-1]]:
        shutil.copy(out / f, t1 / f)
    r = _install(t1, site, keep, "--partial-ok")
    assert r.returncode == 0, r.stderr
    assert f"layer alpha: waiting for 1 of {len(alpha_files)} piece(s): {alpha_files[-1]}" in r.stdout
    assert "incomplete" in r.stdout
    assert not (site / "alpha").exists()
    # transfer 2: every other piece; without --partial-ok an incomplete bundle exits 3
    t2 = tmp_path / "t2"
    t2.mkdir()
    rest = [f for f in files if f not in alpha_files[:-1]]
    for f in rest[:-1]:
        shutil.copy(out / f, t2 / f)
    r = _install(t2, site, keep)
    assert r.returncode == 3
    assert "layer alpha: installed now" in r.stdout and "layer beta: waiting for 1" in r.stdout
    assert (site / "alpha" / "__init__.py").exists() and (site / "alpha_extra.py").exists()
    assert not (site / "bin").exists() and not list(site.glob("*.data"))  # scripts are not installed
    t3 = tmp_path / "t3"
    t3.mkdir()
    shutil.copy(out / rest[-1], t3 / rest[-1])
    r = _install(t3, site, keep, "--partial-ok")
    assert "layer alpha: installed\n" in r.stdout.replace("[bundle] ", "") and "layer beta: installed now" in r.stdout
    env_file = Path(str(site) + ".env")
    assert f'PYTHONPATH="{site}' in env_file.read_text()
    got = subprocess.run([sys.executable, "-c", "import beta; print(beta.BETA)"], text=True, capture_output=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert got.stdout.strip() == "alpha+beta", got.stderr
    assert (site / ".bin" / "vllm").exists()


@needs_zstd
def test_a_cut_piece_is_refused_with_its_name(tmp_path):
    out, manifest = _bundle(tmp_path, piece_bytes=100_000)
    victim = out / manifest["layers"][0]["pieces"][1]["file"]
    victim.write_bytes(victim.read_bytes()[:-10])
    r = _install(out, tmp_path / "site", tmp_path / "keep")
    assert r.returncode == 2
    assert f"sha256 mismatch in {victim.name}" in r.stderr
    assert not (tmp_path / "site" / "alpha").exists()


@needs_zstd
def test_without_a_zstd_program_the_bundled_zstandard_wheel_decompresses(tmp_path):
    """The runner image has no zstd program: install falls back to the zstandard module,
    from the wheel that travels with the bundle."""
    try:
        import zstandard  # noqa: F401
        have_module = True
    except ImportError:
        have_module = False
    wheel = next(Path(ob.__file__).parent.glob("zstandard-*.whl"), None) or _local_zstandard_wheel(tmp_path)
    if wheel is None and not have_module:
        pytest.skip("no zstandard wheel or module here")
    out, _ = _bundle(tmp_path, piece_bytes=200_000)
    if wheel is not None:
        shutil.copy(wheel, out / wheel.name)
    bin_dir = tmp_path / "bin"  # a PATH with python and tar but no zstd
    bin_dir.mkdir()
    for tool in ("tar", "sh"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    r = _install(out, tmp_path / "site", tmp_path / "keep", env={"PATH": str(bin_dir)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "beta" / "big.bin").stat().st_size == 1 << 20


def _local_zstandard_wheel(tmp_path: Path) -> Path | None:
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp_path / "zw"),
                        ob.ZSTANDARD], capture_output=True, text=True, timeout=120)
    return next((tmp_path / "zw").glob("zstandard-*.whl"), None) if r.returncode == 0 else None


def test_the_probe_names_an_unknown_check(capsys):
    with pytest.raises(SystemExit) as e:
        ob.main(["probe", "gpu-magic"])
    assert e.value.code == 2
    assert "unknown check(s) gpu-magic" in capsys.readouterr().err


def test_the_probe_reports_each_check_as_a_json_line(capsys, tmp_path):
    """Without CUDA here the `cuda` check fails, on its own line, and the probe exits 1."""
    rc = ob.main(["probe", "cuda", "--timeout", "120"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["check"] for x in lines] == ["cuda"]
    assert lines[0]["ok"] is False and "no CUDA device" in lines[0]["result"]
    assert rc == 1


def test_the_release_profile_names_a_reason_for_every_entry():
    import tomllib
    for profile in (ROOT / "ci" / "bundles").glob("vllm-*.toml"):
        data = tomllib.loads(profile.read_text())
        for key in ("leave_out", "keep_runner", "slim"):
            for entry in data.get(key, []):
                assert entry.get("why"), f"{profile.name}: {key} entry {entry} has no reason"
        assert [l["name"] for l in data["layers"]][0] == "torch"  # torch is probed before the rest


def test_the_runners_own_builds_are_hidden_from_the_bundles_processes(tmp_path):
    """A package of the runner built for its own torch (torchaudio) is made absent:
    find_spec answers None, so libraries that import it when found leave it alone."""
    site = tmp_path / "site"
    site.mkdir()
    ob.write_hiding(site, ["json"])  # a module every Python has, standing in for torchaudio
    probe = ("import importlib.util, sys\nprint(importlib.util.find_spec('json') is None)\n"
             "try:\n    import json\n    print('imported')\nexcept ImportError:\n    print('hidden')\n")
    r = subprocess.run([sys.executable, "-c", probe], text=True, capture_output=True,
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert r.stdout.split() == ["True", "hidden"], r.stderr
    ob.write_hiding(site, [])  # a bundle that hides nothing removes its own file, no other
    assert not (site / "sitecustomize.py").exists()
    (site / "sitecustomize.py").write_text("# the runner's own\n")
    ob.write_hiding(site, [])
    assert (site / "sitecustomize.py").exists()


@needs_zstd
def test_a_layer_unpacked_after_the_runners_libraries_were_linked_never_writes_into_them(tmp_path, monkeypatch):
    """install links the runner's nvidia/<lib> folders that the bundle lacks; a later
    layer that carries one of them must replace the link, not write through it."""
    runner = tmp_path / "runner-site-packages"
    (runner / "nvidia" / "beta").mkdir(parents=True)
    (runner / "nvidia" / "beta" / "runner.txt").write_text("the runner's\n")
    site = tmp_path / "site"
    (site / "nvidia").mkdir(parents=True)
    monkeypatch.setattr(ob, "runner_site_packages", lambda s: [runner])
    assert ob.link_runner_libraries(site) == [f"nvidia/beta -> {runner / 'nvidia' / 'beta'}"]
    assert (site / "nvidia" / "beta").is_symlink()
    ob.unlink_runner_libraries(site)
    root = tmp_path / "layer"
    (root / "nvidia" / "beta").mkdir(parents=True)
    (root / "nvidia" / "beta" / "carried.txt").write_text("carried\n")
    ob.compress(root, tmp_path / "l.tar.zst", level=3)
    ob.unpack_layer([tmp_path / "l.tar.zst"], site, tmp_path)
    assert not (runner / "nvidia" / "beta" / "carried.txt").exists()
    assert (site / "nvidia" / "beta" / "carried.txt").exists()
    assert ob.link_runner_libraries(site) == []  # the carried folder is kept
