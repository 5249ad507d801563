"""One ``harness bench`` measuring run: the sized models, the raw limits, servers
started in waves, trainers prepared side by side, then the timed syncs, one at a
time, each through ``harness.run.sync.paused_sync`` with the server's GPU memory sampled
(``harness.core.measure.ServerMemory``). The plan it runs and the command line are in
``harness.commands.bench``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import sys
import time
from pathlib import Path

from harness import transfer
from harness.commands.bench.benchfile import GB, limit_at, summarize_case, sync_record, write_json
from harness.commands.bench.view import _f
from harness.core.measure import ServerMemory, process_tree
from harness.run.sync import paused_sync

# ----------------------------------------------------------------------------- progress

class Progress:
    """One line per step (a sync), with the count of steps and the elapsed time, and
    notes between them (servers started, trainers prepared), on stderr: the table goes
    to stdout."""

    def __init__(self, total: int, stream=None):
        self.total, self.done = total, 0
        self.t0 = time.monotonic()
        self.stream = stream or sys.stderr

    def note(self, msg: str) -> None:
        print(f"[{self._clock()}] {msg}", file=self.stream, flush=True)

    def step(self, msg: str) -> None:
        self.done += 1
        print(f"[{self._clock()} {self.done:>{len(str(self.total))}}/{self.total}] {msg}",
              file=self.stream, flush=True)

    def _clock(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60:d}:{s % 60:02d}"


# ----------------------------------------------------------------------------- the run

@dataclasses.dataclass
class Plan:
    cases: list            # harness.run.cases.Case, one per backend x size
    sizes: list[float]
    dtype: str
    warm: int
    gpus_needed: int


class BenchRun:
    """One ``harness bench`` run: models, raw limits, servers in waves, trainers, syncs."""

    def __init__(self, plan: Plan, args: argparse.Namespace, doc: dict, out: Path):
        self.plan, self.args, self.doc, self.out = plan, args, doc, out
        self.json_path = out / "bench.json"
        self.progress = Progress(total=len(plan.cases) * len(plan.sizes) * (1 + plan.warm))
        self.t0 = time.monotonic()

    def save(self) -> None:
        self.doc["header"]["wall_seconds"] = round(time.monotonic() - self.t0, 1)
        write_json(self.doc, self.json_path)

    # ------------------------------------------------------------------ models, limits
    def build_models(self) -> dict[float, Path]:
        from harness.models import sized

        per = {"float32": 4, "bfloat16": 2}[self.plan.dtype]
        dirs = {}
        for gb in self.plan.sizes:
            d = sized.sized_model_dir(int(gb * GB), self.plan.dtype)
            cfg = sized.sized_config(int(gb * GB), self.plan.dtype)
            params = sized.config_params(cfg)
            self.doc["models"].append({
                "size_gb": gb, "name": d.name, "bytes": params * per, "params": params,
                "tensors": 2 + cfg["num_hidden_layers"] * 9 + 1,
                "hidden_size": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
                "vocab_size": cfg["vocab_size"], "intermediate_size": cfg["intermediate_size"]})
            dirs[gb] = d
        self.progress.note("models: " + ", ".join(
            f"{m['size_gb']:g} GB ({m['tensors']} tensors)" for m in self.doc["models"]))
        return dirs

    def measure_limits(self) -> None:
        from harness.transfer.rawlimit import RawLimitError, measure

        sizes = [m["bytes"] for m in self.doc["models"]]
        wanted: dict[tuple, dict] = {}
        for c in self.plan.cases:
            path = transfer.backend(c.backend.engine).raw_limit
            lay = c.layout
            if path == "host":
                kw: dict = {}
            elif path == "d2d":
                kw = {"device": lay.server_gpus[0]}
            else:
                kw = {"src": lay.trainer_gpu, "dst": list(lay.server_gpus)}
            wanted.setdefault((path, json.dumps(kw, sort_keys=True)), kw)
        for (path, _), kw in wanted.items():
            t = time.monotonic()
            try:
                res = measure(path, sizes, reps=self.args.limit_reps,
                              timeout=self.args.vllm_sync_timeout, **kw)
                res["error"] = None
                rates = ", ".join(f"{s['gbps']:.1f}" for s in res["sizes"])
                self.progress.note(f"raw limit {path}: {res['what']}: {rates} GB/s "
                                   f"({time.monotonic() - t:.0f}s)")
            except RawLimitError as e:
                res = {"path": path, "sizes": [], "error": str(e)}
                self.progress.note(f"raw limit {path}: FAILED: {str(e).splitlines()[0]}")
            res["devices"] = kw
            self.doc["limits"].append(res)
        self.save()

    # ------------------------------------------------------------------ servers, syncs
    def run(self) -> bool:
        """Measure every case; True when one failed (its error is in its record)."""
        from harness.run.cases import server_config_for
        from harness.run.pool import ServerPool

        dirs = self.build_models()
        self.measure_limits()
        work = []  # (case, size, server config), servers of one engine/size shared
        for gb in self.plan.sizes:
            for c in self.plan.cases:
                work.append((c, gb, server_config_for(c, str(dirs[gb]))))
        configs = list(dict.fromkeys(cfg for _, _, cfg in work))
        gpu = any(cfg.device_ids for cfg in configs)
        per_wave = self.args.vllm_max_servers or min(len(configs), 8 if gpu else 3)
        pool = ServerPool(Path(self.args.vllm_log_dir).resolve(),
                          start_timeout=self.args.vllm_start_timeout, max_alive=per_wave)
        failed = False
        try:
            for i in range(0, len(configs), per_wave):
                wave = configs[i:i + per_wave]
                failed |= self._wave(pool, wave, [w for w in work if w[2] in wave], dirs)
        finally:
            try:
                pool.stop_all()
            except Exception as e:  # never hide the results behind a shutdown problem
                self.progress.note(f"WARNING: stopping the servers: {e}")
            self.save()
        return failed

    def _wave(self, pool, wave: list, work: list, dirs: dict) -> bool:
        from harness.trainer.handle import TrainerError, TrainerSpec
        from harness.vllm.client import ServerClient
        from harness.vllm.server import ServerError

        pool.plan(wave)
        t = time.monotonic()
        self.progress.note(f"starting {len(wave)} server{'s' if len(wave) > 1 else ''} side by "
                           f"side: " + "; ".join(cfg.describe() for cfg in wave))
        servers, down = {}, {}
        for cfg in wave:
            try:
                servers[cfg] = pool.get(cfg)
            except ServerError as e:
                down[cfg] = str(e)
            self.doc["servers"].append({
                "config": cfg.describe(), "engine": cfg.backend,
                "start_seconds": servers[cfg].start_seconds if cfg in servers else None,
                "version": servers[cfg].version if cfg in servers else None,
                "log": _rel(servers[cfg].log_path) if cfg in servers else None,
                "error": down.get(cfg, "").splitlines()[0] if cfg in down else None})
        self.progress.note(f"servers ready after {time.monotonic() - t:.0f}s"
                           + (f"; {len(down)} failed to start" if down else ""))
        records, trainers = [], {}
        for case, gb, cfg in work:
            rec = {**case.as_dict(), "model": dirs[gb].name, "size_gb": gb,
                   "limit_path": transfer.backend(case.backend.engine).raw_limit, "error": None,
                   "cold": None, "warm": []}
            records.append(rec)
            self.doc["cases"].append(rec)
            if cfg in down:
                rec["error"] = f"server did not start: {down[cfg]}"
                continue
            srv = servers[cfg]
            spec = TrainerSpec.make(url=srv.url, engine=case.backend.engine,
                                    packed=case.backend.packed, dtype=case.dtype,
                                    device=case.layout.trainer_device,
                                    timeout=self.args.vllm_sync_timeout,
                                    options={"device": case.layout.trainer_device})
            trainers[id(rec)] = pool.trainer(cfg, spec)

        # trainers side by side: imports, CUDA contexts and weights, no route called
        t = time.monotonic()
        ready = [r for r in records if id(r) in trainers]
        with cf.ThreadPoolExecutor(max_workers=max(1, len(ready))) as ex:
            futures = {ex.submit(trainers[id(r)].prepare, str(dirs[r["size_gb"]]),
                                 timeout=self.args.vllm_sync_timeout): r for r in ready}
            for f in cf.as_completed(futures):
                rec = futures[f]
                try:
                    rec["prepare_seconds"] = f.result().get("seconds")
                except (TrainerError, OSError) as e:
                    rec["error"] = f"trainer could not be prepared: {e}"
        if ready:
            self.progress.note(f"{len(ready)} trainer{'s' if len(ready) > 1 else ''} prepared "
                               f"side by side in {time.monotonic() - t:.0f}s")
        self.save()

        failed = bool(down)
        for (case, gb, cfg), rec in zip(work, records):
            if rec["error"]:
                failed = True
                self.progress.done += 1 + self.plan.warm
                continue
            srv = servers[cfg]
            client = ServerClient(srv.url, timeout=self.args.vllm_sync_timeout,
                                  context=srv.describe_failure)
            mem = ServerMemory(cfg.device_ids, lambda srv=srv: process_tree(
                srv.proc.pid if srv.proc else None))
            try:
                self._measure(rec, trainers[id(rec)], client, mem, dirs[gb])
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                failed = True
                self.progress.done += 1 + self.plan.warm - (rec["cold"] is not None) \
                    - len(rec["warm"])  # the syncs it will not make
                self.progress.note(f"{rec['backend']} {gb:g} GB: FAILED: {str(e).splitlines()[0]}")
                # the failed trainer is gone (its group's state is unknown); the server's
                # other variant still gets its turn, with a trainer of its own
            self.save()
        for cfg in wave:
            pool.release(cfg)
        return failed

    def _measure(self, rec: dict, trainer, client, mem: ServerMemory, weights: Path) -> None:
        lim = limit_at(self.doc["limits"], rec["limit_path"],
                       next((m["bytes"] for m in self.doc["models"]
                             if m["size_gb"] == rec["size_gb"]), None))
        try:
            self._syncs(rec, trainer, client, mem, weights)
        finally:  # what was measured before a failure still counts
            rec["summary"] = summarize_case(rec["cold"], rec["warm"],
                                            lim["gbps"] if lim else None)

    def _syncs(self, rec: dict, trainer, client, mem: ServerMemory, weights: Path) -> None:
        label = f"{rec['backend']} {rec['size_gb']:g} GB"
        for i in range(1 + self.plan.warm):
            memory: dict = {}

            def push() -> dict:
                try:
                    return trainer.sync(str(weights), timeout=self.args.vllm_sync_timeout)
                finally:
                    memory.update(mem.stop())

            mem.start()
            run = paused_sync(client, push)
            result, t = run.result, run.timings
            r = sync_record(result, pause_seconds=t.pause_seconds,
                            resume_seconds=t.resume_seconds,
                            pause_to_resume_seconds=t.pause_to_resume_seconds,
                            server_memory=memory)
            if i == 0:
                rec["cold"] = r
                for k in ("tensors", "bytes", "chunks", "api_path"):
                    rec[k] = result.get(k)
                what = (f"cold: {r['pause_to_resume_seconds']:.2f}s pause->resume "
                        f"(init {_f(r['init_seconds'], '{:.2f}')}s)")
            else:
                rec["warm"].append(r)
                what = (f"warm {i}/{self.plan.warm}: send {r['sync_seconds']:.3f}s, "
                        f"{_f(r['gbps'], '{:.2f}')} GB/s")
            self.progress.step(f"{label}: {what}")


def _rel(p: Path | None) -> str | None:
    """A path as the JSON records it: relative to the working directory when under it
    (committed results must not name the machine's directories), else its name."""
    if p is None:
        return None
    try:
        return str(Path(p).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return Path(p).name
