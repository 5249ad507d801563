"""``harness demo``: the flow of vLLM's rlhf_http examples, narrated and asserted.

start server (dummy weights) -> generate (gibberish) -> pause -> sync -> resume ->
generate (the trainer's text) -> compare with Hugging Face -> pass/fail table.
Exit code 0 only if every step passed. If the text after the sync is not what
Hugging Face produces for the same weights, the demo says so plainly: that is a
finding about vLLM or the harness, never something to paper over.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path

from harness.commands import options as command_options
from harness.oracles import parity
from harness.run.cases import DEMO_MODEL
from harness import transfer
from harness.transfer import SHORTHANDS
from harness.transfer.registry import DEFAULT_ENGINE


# The options it shares with pytest, from the one table (harness.run.settings.OPTIONS).
USES = (
    command_options.Use("vllm_backend", default=DEFAULT_ENGINE, shorthands=SHORTHANDS,
                 why="nccl and ipc mean the packed variants"),
    command_options.Use("vllm_model", default=DEMO_MODEL,
                 why="real weights, so that the text after the sync reads as English; the "
                     "tests and harness repro default to llama, a tiny model built in seconds"),
    command_options.Use("vllm_dtype"),
    command_options.Use("vllm_layout", default=None,
                 shown="the backend's own: cpu for shm, 1gpu-colocated for ipc, 2gpu-split "
                       "for nccl"),
    command_options.Use("vllm_url"),
    command_options.Use("vllm_log_dir"),
    command_options.Use("vllm_start_timeout"),
    command_options.Use("vllm_sync_timeout"),
)


EXIT_HELP = """\
exit status:
  0  every step passed: gibberish before the sync, parity with Hugging Face after it,
     /pause and /resume as they should be
  1  a step failed (the table says which and why): the server did not start, the
     sync failed, or vLLM does not match the Hugging Face reference
  2  usage error: a bad option value, a layout that needs more GPUs than this host
     has, or a model that cannot be served (one line each, before anything starts)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EXIT_HELP
    command_options.add_command_options(p, USES)
    p.add_argument("--max-tokens", type=int, default=16,
                   help="greedy tokens generated per prompt; default 16")
    p.add_argument("--no-workaround", action="store_true",
                   help="do not work around known vLLM bugs (shows them failing)")


class _Ticker:
    """The thread behind ``progress``; ``done()`` silences it for good (the wait it
    narrates is over, though the block it wraps goes on)."""

    def __init__(self, label: str, every: float, out):
        self.label, self.every, self.out = label, every, out
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.lock = threading.Lock()  # done() returns only once no line can follow
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self.stop.wait(self.every):
            with self.lock:
                if self.stop.is_set():
                    return
                self.out(f"     still {self.label.lower()} ({time.monotonic() - self.t0:.0f}s)")

    def done(self) -> None:
        with self.lock:
            self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join()


def _say(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def progress(label: str, every: float = 15.0, out=_say):
    """Print ``label`` and, on long waits, the elapsed seconds every ``every`` seconds
    (at most one line every 15 s by default), until the block ends or ``done()``."""
    out(f"  .. {label}")
    ticker = _Ticker(label, every, out)
    ticker.thread.start()
    try:
        yield ticker
    finally:
        ticker.done()


class Steps:
    def __init__(self):
        self.rows: list[tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.rows.append((name, ok, detail))
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        return ok

    def table(self) -> str:
        w = max(len(r[0]) for r in self.rows)
        lines = [f"{'step'.ljust(w)}  result  detail", f"{'-' * w}  ------  {'-' * 40}"]
        lines += [f"{n.ljust(w)}  {'pass' if ok else 'FAIL'}    {d}" for n, ok, d in self.rows]
        return "\n".join(lines)


def _show(title: str, ref, texts: list[str]) -> None:
    print(f"\n  {title}")
    for pr, text in zip(ref.prompts, texts):
        print(f"    {pr.prompt!r} -> {text!r}")
    print()


class _Narrator:
    """Presents the flow's steps (harness.run.flow.seed_flow) as the demo's numbered story."""

    def __init__(self, steps: Steps, args: argparse.Namespace, ticker=None):
        self.steps, self.args = steps, args
        self.ticker = ticker  # the "computing the reference" wait, over with step 2
        self.ref = None

    def __call__(self, name: str, **f) -> None:
        steps = self.steps
        if name == "reference":
            if self.ticker is not None:
                self.ticker.done()
            self.ref = f["reference"]
            steps.add("reference", True, f"{len(self.ref.prompts)} prompts x "
                                         f"{self.args.max_tokens} greedy tokens from transformers")
            print("[3/7] generate before the sync (dummy weights: expect gibberish)")
        elif name == "before":
            _show("before sync:", self.ref, f["texts"])
            try:
                parity.assert_gibberish(f["report"])
                steps.add("gibberish before", True, f"mean |Δlogprob| vs reference "
                          f"{f['report'].mean_abs:.2f} nats; greedy identical "
                          f"{sum(f['report'].greedy_identical)}/{len(self.ref.prompts)}")
            except AssertionError as e:
                steps.add("gibberish before", False, str(e).splitlines()[0])
            print("[4/7] pause generation")
        elif name == "pause":
            steps.add("pause", f["paused"], f"/pause -> /is_paused says {f['paused']}")
            print("[5/7] sync: the trainer (own process) pushes its weights")
        elif name == "sync":
            r = f["result"]
            steps.add("sync", True, f"{r['tensors']} tensors, {r['bytes'] / 1e6:.1f} MB in "
                                    f"{r['sync_seconds']:.2f}s via {r.get('api_path')}")
        elif name == "resume":
            print("[6/7] resume generation")
            steps.add("resume", not f["paused"], f"/resume -> /is_paused says {f['paused']}")
            print("[7/7] generate after the sync and compare with Hugging Face")
        elif name == "after":
            self.after(f["report"], f["texts"])

    def after(self, after, texts: list[str]) -> None:
        ref, steps = self.ref, self.steps
        _show("after sync:", ref, texts)
        _show("Hugging Face, same weights:", ref, [p.greedy_text for p in ref.prompts])
        same = list(after.greedy_identical)
        if all(same):
            steps.add("greedy text", True, f"identical to Hugging Face for all {len(same)} prompts")
        else:
            steps.add("greedy text", False,
                      f"DIFFERS from Hugging Face for {same.count(False)} of {len(same)} "
                      "prompts: vLLM does not serve the trainer's weights as transformers runs "
                      "them. " + "; ".join(after.greedy_divergence + after.greedy_ties))
        tol = parity.tolerance_for(self.args.vllm_dtype).max_abs_logprob
        try:
            parity.assert_logprobs_close(after)
            steps.add("logprob parity", True, f"max |Δlogprob| {after.max_abs:.2g} <= {tol:g} "
                                              f"over {after.tokens_compared} teacher-forced tokens")
        except AssertionError as e:
            steps.add("logprob parity", False, " ".join(str(e).split("\n")[:2]))


def run(args: argparse.Namespace) -> int:
    from harness.run.cases import make_case
    from harness.run.flow import SyncSession, seed_flow
    from harness.run.layouts import gpu_count
    from harness.run.pool import ServerPool
    from harness.trainer.handle import TrainerError
    from harness.vllm.server import ServerError

    try:
        for note in command_options.resolve_command(args, USES):
            print(f"harness demo: {note}", file=sys.stderr)
        case = make_case(args.vllm_backend, args.vllm_layout, args.vllm_dtype, args.vllm_model)
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens: at least 1, got {args.max_tokens}")
    except ValueError as e:  # SettingsError is one
        print(f"harness demo: {e}", file=sys.stderr)
        return 2
    from harness.models import classify_model, hub_unavailable

    kind, ref = classify_model(args.vllm_model)
    why = hub_unavailable(ref) if kind == "hub" else None
    if why:  # refused now, not by a Hugging Face traceback after the server started
        print(f"harness demo: --vllm-model: {why}", file=sys.stderr)
        return 2
    layout = case.layout
    if kind == "path":  # what vLLM needs of the directory, known before any server starts
        from harness.models import requirements

        said = requirements.problems(ref, cpu_server=not layout.server_gpus)
        for line in said:
            print(f"harness demo: --vllm-model: {line}", file=sys.stderr)
        if said:
            return 2
    if layout.gpus_needed > gpu_count():
        print(f"harness demo: layout {layout.name} needs {layout.gpus_needed} GPU(s), "
              f"{gpu_count()} available", file=sys.stderr)
        return 2
    steps = Steps()
    print(f"weight-sync demo: backend {case.backend.id}, model {args.vllm_model}, "
          f"{args.vllm_dtype}, layout {layout.name}")
    pool = ServerPool(Path(args.vllm_log_dir), start_timeout=args.vllm_start_timeout,
                      max_alive=1, url=args.vllm_url)
    try:
        print("\n[1/7] trainer weights")
        with progress("building / converting the model (cached after the first run)"):
            from harness.run.flow import resolve_model_path

            model_path = resolve_model_path(args.vllm_model)
        print("\n[2/7] vLLM server with dummy weights")
        try:
            with progress(f"starting server (log: {args.vllm_log_dir})"):
                s = SyncSession(case, pool, fresh=True, sync_timeout=args.vllm_sync_timeout)
        except ServerError as e:
            steps.add("server start", False, str(e).splitlines()[0])
            print(str(e), file=sys.stderr)
            print("\n" + steps.table())
            return 1
        steps.add("server start", True, f"vLLM {s.server.version} healthy at {s.server.url} "
                                        f"after {s.server.start_seconds:.1f}s; log "
                                        f"{s.server.log_path}")
        options = {}
        if _needs_tied_workaround(case.backend, layout, model_path) and not args.no_workaround:
            options["reprocess_tied"] = True
            print(TIED_NOTE)
        try:
            with progress("computing the Hugging Face reference") as ticker:
                seed_flow(s, options=options, on_step=_Narrator(steps, args, ticker),
                          max_tokens=args.max_tokens)
        except TrainerError as e:
            steps.add("sync", False, str(e).splitlines()[0])
            print(str(e), file=sys.stderr)
    finally:
        pool.stop_all()
    print("\n" + steps.table())
    ok = all(r[1] for r in steps.rows)
    print(f"\n{'PASSED' if ok else 'FAILED'}: {sum(r[1] for r in steps.rows)}/{len(steps.rows)} "
          "steps passed")
    return 0 if ok else 1


TIED_NOTE = """\
  NOTE  known vLLM issue cpu-tied-lm-head-stale (docs/known-issues.md): on CPU,
        vLLM prepacks GEMM weights at load time, and after a layerwise reload a
        tied lm_head (this model ties it to the input embedding) keeps its stale
        prepacked copy, so generation would still use the dummy lm_head. The
        harness sends init_info {"reprocess_tied": true}: its shm engine re-runs
        vLLM's process_weights_after_loading on tied modules after the reload.
        The weights sent are unchanged. --no-workaround shows the bug."""


def _needs_tied_workaround(variant, layout, model_path: str) -> bool:
    import json

    if "reprocess_tied" not in transfer.backend(variant.engine).workarounds or layout.server_gpus:
        return False
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except OSError:
        return False
    return bool(cfg.get("tie_word_embeddings", cfg.get("model_type") in ("opt", "gpt2")))

