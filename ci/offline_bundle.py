#!/usr/bin/env python3
"""An offline bundle of a vLLM release for a GPU runner that has no package index.

Three commands, one file (the runner side needs nothing but Python 3.9+):

  make     on a machine with a package index: resolve vLLM's stack for the runner's
           Python and glibc, keep what the runner already has (its `pip freeze`), drop what
           the release never imports on the serving path, slim the wheels, and write each
           layer as a zstd-compressed tar split into pieces of a given size, with a
           manifest (sizes, sha256) and a copy of this file.
  install  on the runner: take the pieces that have arrived (all at once, or a few per
           transfer), verify, join and unpack every layer that is complete into one
           directory, link the runner's own NVIDIA libraries that the bundle does not carry,
           and write an environment file to source.
  probe    on the runner: import torch from the bundle and check CUDA, a matmul, a one-rank
           NCCL group, a cuDNN convolution, a Triton kernel and `import vllm`; one JSON line
           per check.

    python3 ci/offline_bundle.py make --vllm 0.32.0 --runner-freeze runner.txt --out bundle/
    python3 bundle/install.py install --bundle bundle/ --site /opt/vllm-site
    source /opt/vllm-site.env && python3 bundle/install.py probe

A profile (TOML, `--profile`, default `ci/bundles/vllm-<version>.toml` when present) holds
what is release-specific, each entry with its reason: the layers in their order, packages
left out, packages whose runner version is kept, and paths slimmed out of wheels.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import NoReturn

MIB = 1 << 20
MANIFEST = "manifest.json"
INSTALLER = "install.py"
ZSTANDARD = "zstandard==0.25.0"  # the runner's decompressor when it has no `zstd` binary


def canon(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def say(*parts: object) -> None:
    print("[bundle]", *parts, flush=True)


def fail(message: str) -> NoReturn:
    print(f"offline_bundle: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------------- make


def read_freeze(path: Path) -> dict[str, str | None]:
    """`pip freeze` of the runner: {name: version}; a bare name means present, version
    unknown (kept unless a requirement asks for another version exactly)."""
    have: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        if " @ " in line:  # name @ file:///... : present, version unknown
            have[canon(line.split(" @ ", 1)[0])] = None
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:(?:==|===)\s*([^\s;]+))?", line)
        if not m:
            fail(f"{path}: cannot read line {raw!r} (expected name==version or a bare name)")
        have[canon(m.group(1))] = m.group(2)
    return have


def parse_compiled(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """A `uv pip compile` output: {name: version} and {name: {parents}} from its `# via`."""
    pins: dict[str, str] = {}
    via: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            current = canon(m.group(1))
            pins[current] = m.group(2)
            via[current] = set()
            inline = re.search(r"#\s*via\s+(.*)$", line)
            if inline:
                via[current].update(canon(p) for p in re.split(r"[,\s]+", inline.group(1)) if p)
            continue
        m = re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if m and current and not line.strip().startswith("# via -r"):
            parent = m.group(1)
            if parent != "via":
                via[current].add(canon(re.sub(r"\[.*", "", parent)))
    return pins, via


def choose(pins: dict[str, str], via: dict[str, set[str]], have: dict[str, str | None],
           leave_out: set[str], keep_runner: set[str], root: str) -> tuple[dict[str, str], dict[str, str]]:
    """What to carry: {name: version}, and for every resolved package not carried, why."""
    why: dict[str, str] = {}
    dropped = {n for n in pins if n in leave_out}
    for n in dropped:
        why[n] = "left out (profile)"
    # A package needed only by left-out packages is left out too.
    changed = True
    while changed:
        changed = False
        for n, parents in via.items():
            if n in dropped or n == root or not parents:
                continue
            if parents <= dropped:
                dropped.add(n)
                why[n] = "needed only by left-out " + ", ".join(sorted(parents))
                changed = True
    carry: dict[str, str] = {}
    for n, v in sorted(pins.items()):
        if n in dropped:
            continue
        if n in have:
            hv = have[n]
            if hv is None:
                why[n] = "on the runner (version not listed)"
                continue
            if hv == v:
                why[n] = f"on the runner ({hv})"
                continue
            if n in keep_runner:
                why[n] = f"runner's {hv} kept (profile), resolver chose {v}"
                continue
        carry[n] = v
    return carry, why


def platform_tags(platform: str) -> list[str]:
    """`x86_64-manylinux_2_39` -> every manylinux tag a wheel for that runner may carry."""
    m = re.fullmatch(r"(x86_64|aarch64)-manylinux_2_(\d+)", platform)
    if not m:
        fail(f"--platform {platform!r}: expected ARCH-manylinux_2_N, e.g. x86_64-manylinux_2_39")
    arch, top = m.group(1), int(m.group(2))
    tags = [f"manylinux_2_{n}_{arch}" for n in range(top, 4, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}", f"linux_{arch}", "any"]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if r.returncode != 0:
        fail(f"{' '.join(cmd[:6])} ... exited {r.returncode}:\n{(r.stderr or r.stdout)[-3000:]}")
    return r


def resolve(reqs: list[str], have: dict[str, str | None], args) -> str:
    """Resolve for the runner with uv, preferring the runner's versions: uv reads the pins
    already in its output file as preferences, so the runner's freeze goes there first."""
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists() and not shutil.which(uv):
        fail("make needs uv (pip install uv) to resolve for another platform")
    with tempfile.TemporaryDirectory() as tmp:
        req_in = Path(tmp, "requirements.in")
        req_in.write_text("\n".join(reqs) + "\n")
        out = Path(tmp, "resolved.txt")
        out.write_text("".join(f"{n}=={v}\n" for n, v in sorted(have.items()) if v))
        run([uv, "pip", "compile", "-q", str(req_in), "-o", str(out), "--python-platform", args.platform,
             "--python-version", args.python, "--only-binary", ":all:", "--no-header"])
        return out.read_text()


def download(carry: dict[str, str], dest: Path, args) -> dict[str, Path]:
    dest.mkdir(parents=True, exist_ok=True)
    plats = [x for t in platform_tags(args.platform) for x in ("--platform", t)]
    missing = [f"{n}=={v}" for n, v in carry.items() if not find_wheel(dest, n, v)]
    if missing:
        say(f"downloading {len(missing)} wheel(s)")
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", args.python, "--implementation", "cp", *plats, "-d", str(dest), *missing])
    wheels = {}
    for n, v in carry.items():
        w = find_wheel(dest, n, v)
        if not w:
            fail(f"no wheel of {n}=={v} for {args.platform}, Python {args.python}")
        wheels[n] = w
    return wheels


def find_wheel(dest: Path, name: str, version: str) -> Path | None:
    for w in dest.glob("*.whl"):
        parts = w.name.split("-")
        if canon(parts[0]) == name and parts[1] == version:
            return w
    return None


def unpack_wheel(wheel: Path, root: Path) -> None:
    """Install a wheel the way pip --target does, minus scripts: purelib/platlib at the
    root; scripts are not needed (everything runs as `python -m`)."""
    import zipfile
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            m = re.match(r"^[^/]+\.data/(purelib|platlib|headers|scripts|data)/(.*)$", name)
            if m:
                if m.group(1) not in ("purelib", "platlib") or not m.group(2):
                    continue
                name = m.group(2)
            target = root / name
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 4 * MIB)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(target, mode)


def slim(root: Path, globs: list[str]) -> int:
    """Delete the profile's slim globs under root; the bytes freed."""
    freed = 0
    for pattern in globs:
        for p in root.glob(pattern):
            if p.is_file() or p.is_symlink():
                freed += p.lstat().st_size
                p.unlink()
            elif p.is_dir():
                freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                shutil.rmtree(p)
    return freed


def compress(src_dir: Path, out: Path, level: int) -> None:
    if not shutil.which("zstd"):
        fail("make needs the zstd program (apt-get install zstd)")
    tar = subprocess.Popen(["tar", "cf", "-", "--sort=name", "-C", str(src_dir), "."], stdout=subprocess.PIPE)
    z = subprocess.run(["zstd", "-q", "-f", f"-{level}", "--long=27", "-T0", "-o", str(out)], stdin=tar.stdout)
    tar.stdout.close()
    if tar.wait() != 0 or z.returncode != 0:
        fail(f"compressing {src_dir} failed")


def split(path: Path, piece_bytes: int, stem: str, out_dir: Path) -> list[dict]:
    pieces = []
    with open(path, "rb") as f:
        k = 0
        while True:
            chunk = f.read(piece_bytes)
            if not chunk:
                break
            name = f"{stem}.part{k:02d}"
            Path(out_dir, name).write_bytes(chunk)
            pieces.append({"file": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            k += 1
    return pieces


def load_profile(args) -> dict:
    path = args.profile or Path(__file__).with_name("bundles") / f"vllm-{args.vllm}.toml"
    if not Path(path).exists():
        if args.profile:
            fail(f"--profile {path}: no such file")
        return {}
    import tomllib
    return tomllib.loads(Path(path).read_text())


def names_of(entries: list) -> set[str]:
    """Profile lists hold tables {name, why} or bare names."""
    return {canon(e["name"] if isinstance(e, dict) else e) for e in entries or []}


def cmd_make(args) -> int:
    t0 = time.monotonic()
    profile = load_profile(args)
    have = read_freeze(args.runner_freeze) if args.runner_freeze else {}
    reqs = [f"vllm=={args.vllm}", *profile.get("extra_requirements", []), *args.require]
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = args.cache
    cache.mkdir(parents=True, exist_ok=True)
    say(f"resolving {' '.join(reqs)} for {args.platform}, Python {args.python}"
        f"{f', preferring the {len(have)} packages of {args.runner_freeze}' if have else ''}")
    compiled = resolve(reqs, have, args)
    pins, via = parse_compiled(compiled)
    leave_out = names_of(profile.get("leave_out")) | {canon(n) for n in args.leave_out}
    keep_runner = names_of(profile.get("keep_runner"))
    carry, why = choose(pins, via, have, leave_out, keep_runner, root="vllm")
    for n, v in sorted(carry.items()):
        why[n] = f"carried {v}" + (f" (runner has {have[n]})" if have.get(n) else "")
    Path(out, "resolution.txt").write_text(
        "".join(f"{n}=={pins[n]}  # {why[n]}\n" for n in sorted(pins)))
    say(f"{len(pins)} resolved, {len(carry)} to carry, {len(pins) - len(carry)} on the runner or left out"
        f" (resolution.txt says why for each)")
    if args.resolve_only:
        print("".join(f"{n}=={v}\n" for n, v in sorted(carry.items())), end="")
        return 0
    wheels = download(carry, cache / "wheels", args)

    layers_spec = [(canon_list(l.get("packages", [])), l) for l in profile.get("layers", [])]
    assigned: dict[str, list[str]] = {}
    for pkgs, spec in layers_spec:
        assigned[spec["name"]] = [n for n in pkgs if n in carry]
    rest = [n for n in carry if not any(n in v for v in assigned.values())]
    assigned["rest"] = assigned.get("rest", []) + rest
    slim_globs = profile.get("slim", [])
    piece_bytes = int(args.piece_mib * MIB)
    for old in out.glob("*.part*"):
        old.unlink()
    manifest = {"vllm": args.vllm, "python": args.python, "platform": args.platform,
                "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "piece_bytes": piece_bytes,
                "layers": [], "left_out": sorted(n for n in pins if why.get(n, "").startswith(("left", "needed only"))),
                "hide_runner": sorted(names_of(profile.get("hide_runner")))}
    for i, (layer, names) in enumerate((k, v) for k, v in assigned.items() if v):
        key = hashlib.sha256(json.dumps([sorted(f"{n}=={carry[n]}" for n in names), slim_globs,
                                         args.level]).encode()).hexdigest()[:16]
        zst = cache / f"{layer}-{key}.tar.zst"
        stats_file = zst.with_suffix(".json")
        if not zst.exists():
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                root = Path(tmp, "site")
                for n in names:
                    unpack_wheel(wheels[n], root)
                unpacked = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
                freed = slim(root, [g["path"] if isinstance(g, dict) else g for g in slim_globs])
                say(f"layer {layer}: {len(names)} package(s), {unpacked / MIB:.0f} MiB unpacked, "
                    f"{freed / MIB:.0f} MiB slimmed out; compressing (zstd -{args.level})")
                compress(root, zst, args.level)
                stats_file.write_text(json.dumps({"unpacked": unpacked - freed, "slimmed": freed}))
        stats = json.loads(stats_file.read_text())
        stem = f"{i + 1:02d}-{layer}"
        pieces = split(zst, piece_bytes, stem, out)
        manifest["layers"].append({"name": layer, "packages": sorted(f"{n}=={carry[n]}" for n in names),
                                   "unpacked_bytes": stats["unpacked"], "slimmed_bytes": stats["slimmed"],
                                   "pieces": pieces})
        say(f"layer {layer}: {zst.stat().st_size / MIB:.0f} MiB compressed, {len(pieces)} piece(s)")
    Path(out, MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.copy(__file__, out / INSTALLER)
    zs = download({"zstandard": ZSTANDARD.split("==")[1]}, cache / "wheels", args)["zstandard"]
    shutil.copy(zs, out / zs.name)
    n = sum(len(l["pieces"]) for l in manifest["layers"])
    total = sum(p["bytes"] for l in manifest["layers"] for p in l["pieces"])
    say(f"wrote {out}: {n} piece(s), {total / MIB:.0f} MiB, in {time.monotonic() - t0:.0f} s; "
        f"on the runner: python3 {out / INSTALLER} install --bundle {out} --site DIR")
    return 0


def canon_list(xs: list[str]) -> list[str]:
    return [canon(x) for x in xs]


# ---------------------------------------------------------------------------- install


def import_zstandard(keep: Path):
    """The zstandard module: the runner's own, or the wheel that came with the bundle."""
    try:
        import zstandard  # type: ignore
        return zstandard
    except ImportError:
        pass
    wheels = sorted(keep.glob("zstandard-*.whl"))
    if not wheels:
        fail("no zstd program, no zstandard module and no zstandard wheel in the bundle")
    target = keep / "_zstandard"
    if not target.exists():
        unpack_wheel(wheels[-1], target)
    sys.path.insert(0, str(target))
    import zstandard  # type: ignore
    return zstandard


class Joined:
    """The pieces of one layer, read as one stream (no joined copy on disk)."""

    def __init__(self, paths: list[Path]):
        self.paths, self.i, self.f = list(paths), 0, None

    def read(self, n: int = -1) -> bytes:
        while self.i < len(self.paths):
            if self.f is None:
                self.f = open(self.paths[self.i], "rb")
            data = self.f.read(n if n and n > 0 else 8 * MIB)
            if data:
                return data
            self.f.close()
            self.f, self.i = None, self.i + 1
        return b""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 * MIB), b""):
            h.update(chunk)
    return h.hexdigest()


def unpack_layer(paths: list[Path], site: Path, keep: Path) -> None:
    """Decompress the joined pieces (the zstd program where there is one, else zstandard)
    straight into tar's extraction."""
    joined = Joined(paths)
    proc = None
    if shutil.which("zstd"):
        import threading
        proc = subprocess.Popen(["zstd", "-d", "-q", "--long=27", "-c"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)

        def feed():
            try:
                for chunk in iter(lambda: joined.read(8 * MIB), b""):
                    proc.stdin.write(chunk)
            except BrokenPipeError:
                pass
            finally:
                proc.stdin.close()
        threading.Thread(target=feed, daemon=True).start()
        stream = proc.stdout
    else:
        stream = import_zstandard(keep).ZstdDecompressor(max_window_size=2 ** 31).stream_reader(joined)
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        if sys.version_info >= (3, 12):
            tar.extractall(site, filter="fully_trusted")
        else:
            tar.extractall(site)
    if proc is not None and proc.wait(timeout=600):
        fail(f"zstd -d exited {proc.returncode}")


def runner_site_packages(site: Path) -> list[Path]:
    """The runner's own site-packages (those of the Python running this, minus the bundle)."""
    import site as site_mod
    dirs = [Path(p) for p in site_mod.getsitepackages() + [site_mod.getusersitepackages()]]
    return [d for d in dirs if d.is_dir() and d.resolve() != site.resolve()]


def unlink_runner_libraries(site: Path) -> None:
    """Remove the links to the runner's libraries: a layer unpacked over one would write
    into the runner's own site-packages. They are made again after unpacking."""
    ours = site / "nvidia"
    if ours.is_dir():
        for p in ours.iterdir():
            if p.is_symlink():
                p.unlink()


def write_hiding(site: Path, names: list[str]) -> None:
    """The runner's packages built against its own torch (torchaudio, say) cannot load
    with the carried one, and libraries import them whenever they are found. A
    sitecustomize on the bundle's path makes them absent (`sys.modules[name] = None`:
    importlib.util.find_spec answers None, import raises ImportError) in every process
    that has the site on PYTHONPATH. It takes the place of the runner's sitecustomize."""
    target = site / "sitecustomize.py"
    if not names:
        if target.exists() and target.read_text().startswith(HIDING_HEADER):
            target.unlink()
        return
    target.write_text(f"{HIDING_HEADER}\nimport sys\n\nfor _name in {tuple(names)!r}:\n"
                      "    sys.modules.setdefault(_name, None)\n")


HIDING_HEADER = "# written by offline_bundle.py install: the runner's packages hidden from the bundle"


def link_runner_libraries(site: Path) -> list[str]:
    """NVIDIA library folders the bundle does not carry come from the runner: torch finds
    its libraries through RPATHs relative to itself (site/nvidia/<lib>/lib), so each of the
    runner's site-packages/nvidia/<lib> that the bundle lacks is linked in."""
    linked = []
    ours = site / "nvidia"
    if not ours.is_dir():
        return linked
    for sp in runner_site_packages(site):
        theirs = sp / "nvidia"
        if not theirs.is_dir():
            continue
        for lib in sorted(theirs.iterdir()):
            dst = ours / lib.name
            if lib.is_dir() and not dst.exists() and lib.name != "__pycache__":
                dst.symlink_to(lib)
                linked.append(f"nvidia/{lib.name} -> {lib}")
    return linked


def cmd_install(args) -> int:
    bundle, keep, site = args.bundle.resolve(), (args.keep or args.bundle).resolve(), args.site.resolve()
    keep.mkdir(parents=True, exist_ok=True)
    site.mkdir(parents=True, exist_ok=True)
    if keep != bundle:  # pieces that arrived in this transfer join those kept from earlier ones
        for f in bundle.iterdir():
            if f.is_file():
                shutil.copy(f, keep / f.name)
    if not (keep / MANIFEST).exists():
        fail(f"no {MANIFEST} in {bundle} or {keep}: carry it with the first pieces")
    manifest = json.loads((keep / MANIFEST).read_text())
    done_dir = site / ".bundle-layers"
    done_dir.mkdir(exist_ok=True)
    status = []
    for layer in manifest["layers"]:
        name = layer["name"]
        if (done_dir / name).exists():
            status.append((name, "installed"))
            continue
        paths = [keep / p["file"] for p in layer["pieces"]]
        absent = [p.name for p in paths if not p.exists()]
        if absent:
            status.append((name, f"waiting for {len(absent)} of {len(paths)} piece(s): {' '.join(absent)}"))
            continue
        bad = [p["file"] for p in layer["pieces"] if sha256(keep / p["file"]) != p["sha256"]]
        if bad:
            fail(f"layer {name}: sha256 mismatch in {' '.join(bad)} (a transfer was cut: carry them again)")
        t0 = time.monotonic()
        unlink_runner_libraries(site)
        unpack_layer(paths, site, keep)
        (done_dir / name).write_text("\n".join(layer["packages"]) + "\n")
        if not args.keep_pieces and keep != bundle:
            for p in paths:
                p.unlink()
        status.append((name, f"installed now ({layer['unpacked_bytes'] / MIB:.0f} MiB in {time.monotonic() - t0:.0f} s)"))
    for line in link_runner_libraries(site):
        say("linked", line)
    write_hiding(site, manifest.get("hide_runner", []))
    shim = site / ".bin"
    shim.mkdir(exist_ok=True)
    (shim / "vllm").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vllm.entrypoints.cli.main "$@"\n')
    (shim / "vllm").chmod(0o755)
    env = args.env_file or Path(str(site) + ".env")
    env.write_text(f'export PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}"\nexport PATH="{shim}:$PATH"\n')
    for name, s in status:
        say(f"layer {name}: {s}")
    complete = all(s.startswith("installed") for _, s in status)
    say(("complete" if complete else "incomplete") + f"; environment: source {env}")
    if complete and not args.no_check:
        probe = subprocess.run([sys.executable, "-c", "import torch, vllm; print('torch', torch.__version__, "
                                "'cuda', torch.cuda.is_available(), 'vllm', vllm.__version__)"],
                               env={**os.environ, "PYTHONPATH": str(site)}, text=True, capture_output=True)
        say((probe.stdout or probe.stderr).strip().splitlines()[-1] if (probe.stdout or probe.stderr) else "no output")
    return 0 if complete or args.partial_ok else 3


# ---------------------------------------------------------------------------- probe

PROBES = {
    "torch": "import torch; print(torch.__version__, torch.version.cuda, torch.__file__)",
    "cuda": "import torch; assert torch.cuda.is_available(), 'no CUDA device'; "
            "print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))",
    "matmul": "import torch; a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16); "
              "b = (a @ a).float(); torch.cuda.synchronize(); "
              "ref = (a.double().cpu() @ a.double().cpu()); err = (b.cpu().double() - ref).abs().max().item(); "
              "assert err < 2.0, err; print('max abs err', err)",
    "nccl": "import os, torch, torch.distributed as dist; os.environ.setdefault('MASTER_ADDR', '127.0.0.1'); "
            "os.environ.setdefault('MASTER_PORT', '29517'); torch.cuda.set_device(0); "
            "dist.init_process_group('nccl', rank=0, world_size=1); t = torch.ones(8, device='cuda'); "
            "dist.all_reduce(t); torch.cuda.synchronize(); assert t.sum().item() == 8; "
            "print('nccl', '.'.join(map(str, torch.cuda.nccl.version()))); dist.destroy_process_group()",
    "cudnn": "import torch; x = torch.randn(2, 3, 32, 32, device='cuda'); "
             "c = torch.nn.Conv2d(3, 8, 3).cuda(); y = c(x); torch.cuda.synchronize(); "
             "print('cudnn', torch.backends.cudnn.version(), tuple(y.shape))",
    "triton": "import torch, triton, triton.language as tl\n"  # run from a file: @jit reads its source
              "@triton.jit\ndef k(x, y, n, B: tl.constexpr):\n"
              "    i = tl.program_id(0) * B + tl.arange(0, B); m = i < n\n"
              "    tl.store(y + i, tl.load(x + i, mask=m) * 2, mask=m)\n"
              "x = torch.arange(1000, device='cuda', dtype=torch.float32); y = torch.empty_like(x)\n"
              "k[(4,)](x, y, 1000, B=256); torch.cuda.synchronize(); assert torch.equal(y, x * 2)\n"
              "print('triton', triton.__version__)",
    "vllm": "import vllm, vllm._C_stable_libtorch as c; print('vllm', vllm.__version__)",
}


def cmd_probe(args) -> int:
    env = dict(os.environ)
    if args.site:
        env["PYTHONPATH"] = f"{args.site}{os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''}"
    unknown = [c for c in args.checks if c not in PROBES]
    if unknown:
        fail(f"probe: unknown check(s) {' '.join(unknown)}; known: {' '.join(PROBES)}")
    failed = 0
    for name in args.checks or PROBES:
        t0 = time.monotonic()
        with tempfile.NamedTemporaryFile("w", suffix=f"_probe_{name}.py", delete=False) as f:
            f.write(PROBES[name] + "\n")
        try:
            r = subprocess.run([sys.executable, f.name], env=env, text=True,
                               capture_output=True, timeout=args.timeout)
            ok, out = r.returncode == 0, (r.stdout if r.returncode == 0 else r.stderr).strip()
        except subprocess.TimeoutExpired:
            ok, out = False, f"timed out after {args.timeout} s"
        finally:
            os.unlink(f.name)
        failed += not ok
        line = out.splitlines()[-1] if out else ""
        print(json.dumps({"check": name, "ok": ok, "seconds": round(time.monotonic() - t0, 1), "result": line}),
              flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="resolve, download, slim, compress and split (needs a package index)")
    m.add_argument("--vllm", required=True, help="the vLLM release, e.g. 0.32.0")
    m.add_argument("--out", type=Path, required=True, help="the bundle's folder")
    m.add_argument("--runner-freeze", type=Path, help="`pip freeze` of the runner: what it has is not carried")
    m.add_argument("--profile", type=Path, help="release profile (default ci/bundles/vllm-VERSION.toml)")
    m.add_argument("--python", default="3.12", help="the runner's Python (default 3.12)")
    m.add_argument("--platform", default="x86_64-manylinux_2_39", help="the runner's platform (default %(default)s)")
    m.add_argument("--piece-mib", type=float, default=60.0, help="largest piece in MiB (default 60)")
    m.add_argument("--level", type=int, default=19, help="zstd level (default 19)")
    m.add_argument("--cache", type=Path, default=Path(os.environ.get("BUNDLE_CACHE", "/tmp/offline-bundle-cache")))
    m.add_argument("--require", action="append", default=[], help="another requirement to carry (repeatable)")
    m.add_argument("--leave-out", action="append", default=[], help="a package not to carry (repeatable)")
    m.add_argument("--resolve-only", action="store_true", help="print what would be carried, download nothing")
    m.set_defaults(func=cmd_make)
    i = sub.add_parser("install", help="on the runner: join, verify and unpack what has arrived")
    i.add_argument("--bundle", type=Path, default=Path(__file__).parent, help="where the pieces arrived")
    i.add_argument("--site", type=Path, required=True, help="where to unpack (goes first on PYTHONPATH)")
    i.add_argument("--keep", type=Path, help="where pieces wait for the rest of their layer (default: --bundle)")
    i.add_argument("--env-file", type=Path, help="environment file to write (default SITE.env)")
    i.add_argument("--keep-pieces", action="store_true", help="keep pieces after unpacking")
    i.add_argument("--partial-ok", action="store_true", help="exit 0 while layers still wait for pieces")
    i.add_argument("--no-check", action="store_true", help="once complete, do not import torch and vllm")
    i.set_defaults(func=cmd_install)
    r = sub.add_parser("probe", help="on the runner: torch, CUDA, matmul, NCCL, cuDNN, Triton, vLLM")
    r.add_argument("--site", type=Path, help="the bundle's site (else what PYTHONPATH says)")
    r.add_argument("--timeout", type=float, default=300.0)
    r.add_argument("checks", nargs="*", metavar="CHECK", help=f"default: all of {', '.join(PROBES)}")
    r.set_defaults(func=cmd_probe)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
