"""``harness repro``: one scenario, step by step, with a verdict; ``--emit`` writes it
as a standalone script for a bug report.

    harness repro --vllm-backend shm --vllm-model llama --vllm-dtype float32 \\
        --vllm-layout cpu [--pause-mode keep] [--corrupt drop] [--vllm-url URL] \\
        [--emit [PATH]]

Steps (each printed as it runs): build/resolve the model, start the server (its log
path is printed; the tail is printed on failure), Hugging Face reference, observe
before the sync, /pause, sync (the harness trainer in its own process, optionally
corrupting the weights), /resume, observe after, compare.

``--emit PATH`` writes, after the run, a script assembled from ``harness/commands/repro/script.py``
and the modules of ``harness/portable`` the scenario needs, with the scenario filled in
as data (``harness.commands.repro.emit``): a script that needs vLLM and what it installs, not the
harness, and that expects the verdict observed here. An NCCL or IPC script holds one
of vLLM's trainer APIs, the installed release's unless ``--trainer-api`` names one.
``--emit-only`` writes it without running anything, and the script says so. Every
option is checked before anything starts: a bad value is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import inspect
import shlex
import sys
import time
from pathlib import Path
from typing import Any

VERDICTS = ("parity", "mismatch", "error")
EXIT = {"parity": 0, "mismatch": 1, "error": 3}
EXIT_USAGE = 2
PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode, 0.26 to 0.32


def _default_engine() -> str:
    from harness.transfer.registry import DEFAULT_ENGINE

    return DEFAULT_ENGINE


def _shorthands() -> dict[str, str]:
    from harness.transfer import SHORTHANDS

    return SHORTHANDS

EXIT_HELP = """\
exit status:
  0  parity: after the sync vLLM matches the Hugging Face reference
     (with --emit-only: the script was written; nothing ran)
  1  mismatch: it does not (reproduced); with --expect: the verdict is not the expected one
  2  usage error: a bad option value, or options that contradict each other
  3  harness or server error: a step failed (server start, HTTP call, trainer)
With --expect VERDICT: 0 when the verdict is VERDICT, 3 for an unexpected error, else 1.
"""


# Where --emit without a path writes: under the harness's own cache folder, which the
# project's .gitignore leaves out, not beside the user's sources.
DEFAULT_EMIT = Path(".harness-cache") / "repro" / "repro.py"


class UsageError(ValueError):
    """A bad option value; printed as one line, exit status 2."""


def _uses():
    """The options it shares with pytest, from the one table (harness.run.settings.OPTIONS)."""
    from harness.commands.options import Use
    from harness.run.cases import REPRO_MODEL

    return (
        Use("vllm_backend", default=_default_engine(), shorthands=_shorthands(),
            why="nccl and ipc mean the packed variants"),
        Use("vllm_model", default=REPRO_MODEL,
            why="a tiny model the emitted script rebuilds with vLLM's dependencies alone"),
        Use("vllm_dtype"),
        Use("vllm_layout", default=None,
            shown="the backend's own (the first of its layouts: harness/transfer/<engine>.py)"),
        Use("vllm_url", why="a server given here must be fresh: dummy weights, never synced, "
                            "and match the backend, model and dtype"),
        Use("vllm_log_dir", default=".harness-cache/logs/repro"),
        Use("vllm_start_timeout"),
        Use("vllm_sync_timeout"),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Values are checked in Scenario (one line, exit 2), not by argparse types/choices,
    # whose errors print the whole usage.
    from harness.commands.options import add_command_options
    from harness.trainer.handle import CORRUPTIONS

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EXIT_HELP
    add_command_options(p, _uses())
    p.add_argument("--pause-mode", default=None,
                   help=f"mode for /pause ({', '.join(PAUSE_MODES)}); default: the server's")
    p.add_argument("--corrupt", default=None, metavar="KIND",
                   help=f"damage the weights the trainer sends ({', '.join(CORRUPTIONS)}); "
                        "the verdict should be mismatch")
    p.add_argument("--expect", default=None, metavar="VERDICT",
                   help=f"exit 0 iff the verdict is this one ({', '.join(VERDICTS)})")
    p.add_argument("--emit", type=Path, nargs="?", const=DEFAULT_EMIT, default=None,
                   metavar="PATH",
                   help="also write a standalone script that reproduces this scenario (for "
                        "shm, also PATH's stem + _shm_engine.py next to it); without PATH, "
                        f"{DEFAULT_EMIT}, a folder git ignores")
    p.add_argument("--trainer-api", default=None, metavar="API",
                   help="nccl and ipc: the vLLM trainer API the emitted script holds (factory: "
                        "vLLM 0.27.1+ for IPC, 0.28.0+ for NCCL; static: 0.26); default: the one "
                        "of the vLLM installed here")
    p.add_argument("--emit-only", action="store_true",
                   help="with --emit: write the script without running anything (it expects "
                        "mismatch with --corrupt, else parity, or --expect)")


# ----------------------------------------------------------------------------- scenario

def _one_of(option: str, value: str, known) -> str:
    if value not in known:
        raise UsageError(f"unknown {option} {value!r}; known: {', '.join(known)}")
    return value


class Scenario:
    """The checked options of one run. Raises UsageError naming the option and what
    it may be; nothing is built or started here."""

    def __init__(self, args: argparse.Namespace):
        from harness import models
        from harness.commands.options import resolve_command
        from harness.run.settings import SettingsError
        from harness.run import cases
        from harness.run import layouts
        from harness.trainer.handle import CORRUPTIONS
        from harness.transfer import VARIANTS

        try:
            self.notes = resolve_command(args, _uses())  # backend, model, dtype, ...: checked
        except SettingsError as e:
            raise UsageError(str(e)) from None
        backend = args.vllm_backend
        self.variant = VARIANTS[backend]
        name = args.vllm_layout or cases.default_layout(backend)
        self.layout = layouts.LAYOUTS[name]
        if not layouts.runs_on(self.variant, self.layout):
            raise UsageError(f"--vllm-backend {backend} does not run on --vllm-layout {name}; "
                             f"it runs on {', '.join(layouts.layouts_for(self.variant))}")
        self.dtype = args.vllm_dtype
        self.model_kind, self.model_ref = models.classify_model(args.vllm_model)
        self.model = args.vllm_model
        self.pause_mode = (_one_of("--pause-mode", args.pause_mode, PAUSE_MODES)
                           if args.pause_mode is not None else None)
        self.corrupt = (_one_of("--corrupt", args.corrupt, CORRUPTIONS)
                        if args.corrupt is not None else None)
        if args.expect is not None:
            _one_of("--expect", args.expect, VERDICTS)
        if self.corrupt is not None and args.expect == "parity":
            raise UsageError(f"--corrupt {self.corrupt} damages the sync on purpose, so its "
                             "verdict cannot be parity: --expect mismatch, or no --expect")
        if args.emit_only and args.emit is None:
            raise UsageError("--emit-only needs --emit PATH")
        if args.emit_only and args.vllm_url is not None:
            raise UsageError("--emit-only runs nothing, so --vllm-url would be ignored; the "
                             "emitted script starts its own server")
        if args.emit is not None and args.emit.is_dir():
            raise UsageError(f"--emit {args.emit} is a directory; name the script file")
        if args.emit == DEFAULT_EMIT:
            DEFAULT_EMIT.parent.mkdir(parents=True, exist_ok=True)
        if args.emit is not None:  # the rule of every output file (--harness-report's)
            from harness.run.settings import output_file

            try:
                output_file("--emit", str(args.emit))
            except SettingsError as e:
                raise UsageError(str(e)) from None
        self.trainer_api = self._trainer_api(args)

    def _trainer_api(self, args: argparse.Namespace) -> str | None:
        """The trainer API the emitted script holds: --trainer-api, else the installed
        vLLM's (asked only when a script is to be written); None for shm."""
        from harness import transfer
        from harness.commands.repro import emit as repro_emit

        engine = self.variant.engine
        if transfer.backend(engine).vllm_api is None:
            if args.trainer_api is not None:
                raise UsageError(f"--trainer-api is for nccl and ipc; {self.variant.id} "
                                 "takes no vLLM trainer API")
            return None
        if args.trainer_api is not None:
            return _one_of("--trainer-api", args.trainer_api, repro_emit.TRAINER_APIS)
        if args.emit is None:
            return None
        try:
            return repro_emit.installed_trainer_api(engine)
        except repro_emit.EmitError as e:
            raise UsageError(f"--trainer-api: {e}") from None

    def as_dict(self) -> dict:
        return {"backend": self.variant.id, "engine": self.variant.engine,
                "packed": self.variant.packed, "layout": self.layout.name, "dtype": self.dtype,
                "model": self.model, "pause_mode": self.pause_mode, "corrupt": self.corrupt}

    def case(self):
        from harness.run.cases import Case

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
    from harness.oracles import parity
    from harness.run.flow import SyncSession, resolve_model_path, seed_flow
    from harness.run.pool import ServerPool

    step = _Steps(9)
    facts: dict[str, Any] = {}
    pool = ServerPool(Path(args.vllm_log_dir).resolve(), start_timeout=args.vllm_start_timeout,
                      max_alive=1, url=args.vllm_url)
    s = None
    current = "resolve the model"
    try:
        step(f"model {sc.model}")
        _say(f"directory: {resolve_model_path(sc.model)}")
        current = "start the server"
        step(f"attach to {args.vllm_url}" if args.vllm_url
             else f"start vLLM with dummy weights; logs under {pool.log_dir}")
        s = SyncSession(sc.case(), pool, fresh=True, sync_timeout=args.vllm_sync_timeout)
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
    from harness.vllm.server import build_command

    return build_command(srv.cfg, srv.port or int(srv.url.rsplit(":", 1)[1]), srv.python)


# ----------------------------------------------------------------------------- emit

def server_config(sc: Scenario, model_path: str):
    """The harness's server configuration for this scenario (the one place the runner
    asks the case table for it)."""
    from harness.run.cases import server_config_for

    return server_config_for(sc.case(), model_path)


def scenario_data(sc: Scenario, args: argparse.Namespace, expectation, emit_path: Path) -> dict:
    """What the emitted script runs: this scenario as plain data."""
    from harness import models, transfer
    from harness.commands.repro import emit as repro_emit
    from harness.core import facts
    from harness.oracles import parity
    from harness.oracles import reference
    from harness.vllm.server import build_command, build_env

    cfg = server_config(sc, "MODEL")
    argv = build_command(cfg, 0)
    flags = argv[argv.index("--host") + 4:]  # after --host H --port P
    script = transfer.backend(sc.variant.engine).script
    if script is not None and script.engine_file:
        flags = repro_emit.shm_flags(flags)
    env = build_env(cfg)
    # only what the harness sets for a server, not this shell's environment
    keys = {"VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_INSECURE_SERIALIZATION", "PYTHONUNBUFFERED",
            "CUDA_VISIBLE_DEVICES", "VLLM_CPU_KVCACHE_SPACE"} | {k for k, _ in cfg.extra_env}
    server_env = {k: v for k, v in env.items() if k in keys}

    if sc.model_kind == "zoo":
        spec = models.ZOO[sc.model]
        model = ({"name": spec.name, "source": "smollm2-gguf", "description": spec.description}
                 if spec.real_weights else
                 {"name": spec.name, "source": "zoo", "description": spec.description,
                  "recipe": spec.recipe()})
    elif sc.model_kind == "path":
        model = {"name": Path(sc.model_ref).name, "source": "path", "path": sc.model_ref}
    else:
        model = {"name": sc.model_ref, "source": "hub", "id": sc.model_ref}

    defaults = inspect.signature(reference.hf_reference).parameters
    tol = parity.tolerance_for(sc.dtype)
    check = {"prompts": list(reference.DEFAULT_PROMPTS),
             "max_tokens": defaults["max_tokens"].default, "top_k": defaults["top_k"].default,
             "tolerance": tol.max_abs_logprob, "tolerance_reason": tol.reason,
             "gibberish_min_mean_abs": parity.GIBBERISH_MIN_MEAN_ABS}
    vllm, dist = facts.installed_vllm()
    versions = {"harness": facts.dist_version("weight-sync-harness"),
                "vllm": f"{vllm} ({dist})" if vllm else None,
                "torch": facts.dist_version("torch"),
                "transformers": facts.dist_version("transformers"), "date": repro_emit.today()}
    return repro_emit.scenario_data(
        variant=sc.variant, layout=sc.layout, dtype=sc.dtype, model=model,
        pause_mode=sc.pause_mode, corrupt=sc.corrupt, server_flags=flags, server_env=server_env,
        check=check, expectation=expectation,
        timeouts={"start": args.vllm_start_timeout, "sync": args.vllm_sync_timeout},
        versions=versions,
        shm_engine_file=(repro_emit.engine_file_name(emit_path)
                         if script is not None and script.engine_file else None),
        trainer_api=sc.trainer_api)


def emit_script(sc: Scenario, args: argparse.Namespace, expectation) -> list[Path]:
    from harness.commands.repro import emit as repro_emit

    return repro_emit.emit(scenario_data(sc, args, expectation, args.emit), args.emit)


# ----------------------------------------------------------------------------- cli

def exit_code(verdict: str, expect: str | None) -> int:
    if expect is None:
        return EXIT[verdict]
    if verdict == expect:
        return 0
    return EXIT["error"] if verdict == "error" else EXIT["mismatch"]


def run(args: argparse.Namespace) -> int:
    from harness.commands.repro import emit as repro_emit

    try:
        sc = Scenario(args)
    except UsageError as e:
        print(f"harness repro: {e}", file=sys.stderr)
        return EXIT_USAGE
    for note in sc.notes:
        print(f"harness repro: {note}", file=sys.stderr)
    if args.emit_only:
        print(f"harness repro: {sc.describe()}")
        expectation = repro_emit.expectation_not_run(sc.corrupt, args.expect)
        try:
            written = emit_script(sc, args, expectation)
        except (OSError, repro_emit.EmitError) as e:
            print(f"harness repro: cannot write {args.emit}: {e}", file=sys.stderr)
            return EXIT["error"]
        print(f"wrote {', '.join(map(str, written))}: nothing was run; the script expects "
              f"verdict '{expectation.verdict}' ({expectation.basis})")
        return 0
    from harness.models import hub_unavailable
    from harness.run.layouts import gpu_count

    why = hub_unavailable(sc.model_ref) if sc.model_kind == "hub" else None
    if why:  # refused now, not by a Hugging Face traceback after the server started
        print(f"harness repro: --vllm-model: {why}", file=sys.stderr)
        return EXIT_USAGE
    if sc.model_kind == "path":  # what vLLM needs of the directory (models.requirements)
        from harness.models import requirements

        said = requirements.problems(sc.model_ref, cpu_server=not sc.layout.server_gpus)
        for line in said:
            print(f"harness repro: --vllm-model: {line}", file=sys.stderr)
        if said:
            return EXIT_USAGE
    if sc.layout.gpus_needed > gpu_count():  # refused now, not at the sync a minute later
        print(f"harness repro: layout {sc.layout.name} needs {sc.layout.gpus_needed} GPU(s), "
              f"{gpu_count()} available", file=sys.stderr)
        return EXIT_USAGE
    print(f"harness repro: {sc.describe()}")
    t0 = time.monotonic()
    verdict, explanation, facts = run_scenario(args, sc)
    print(f"\nverdict: {verdict.upper()} ({time.monotonic() - t0:.0f}s)\n{explanation}")
    if args.emit:
        try:
            written = emit_script(sc, args, repro_emit.expectation_observed(verdict, explanation,
                                                                            facts))
        except (OSError, repro_emit.EmitError) as e:
            print(f"harness repro: cannot write {args.emit}: {e}", file=sys.stderr)
            return EXIT["error"]
        print(f"\nwrote {', '.join(map(str, written))}: a standalone script expecting the "
              f"verdict '{verdict}' (run it with the Python of a vLLM environment; the harness "
              "is not needed)")
    if args.expect:
        print(f"expected {args.expect}: {'yes' if verdict == args.expect else 'NO'}")
    return exit_code(verdict, args.expect)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness repro", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
