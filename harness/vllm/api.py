"""What vLLM's trainer-side weight-transfer API looks like in the installed release.

This is the only module that knows the API changed between releases. It decides
by feature detection (does the class exist, what does the signature take), never
by comparing version strings, so a patched or back-ported vLLM takes the path its
code supports. The generations known, release by release: ``docs/releases.md``,
"The trainer-side API, generation by generation".

Importing this module imports neither vLLM nor torch: the pytest process uses it
too, and must never load CUDA libraries. ``probe(isolated=True)`` and
``backend_importable`` look at vLLM from a child process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from harness.core.facts import installed_vllm
from harness.portable import reload as _reload  # the shm engine's, portable
from harness.portable.send_ipc import json_safe_update_info  # the scripts' own

# the worker side's reload calls by release (harness/portable/reload.py; tests call them here)
reload_lifecycle = _reload.reload_lifecycle
mtp_guard = _reload.mtp_guard

_WT = "vllm.distributed.weight_transfer"
PROBE_TIMEOUT_S = 120.0  # importing vLLM in a child takes 5-20 s; longer means it hangs

# capability name -> (module, dotted attribute): what every engine's trainer code shares.
# Each of vLLM's own engines adds its names (``EngineApi``). probe() reports each as a bool.
_WHERE: dict[str, tuple[str, str]] = {
    "WeightTransferTrainerFactory": (f"{_WT}.factory", "WeightTransferTrainerFactory"),
    "WeightSource": (f"{_WT}.base", "WeightSource"),
    "ModuleSource": (f"{_WT}.base", "ModuleSource"),
    "ParamMeta": (f"{_WT}.base", "ParamMeta"),
    "HTTPVLLMWeightSyncClient": (f"{_WT}.clients", "HTTPVLLMWeightSyncClient"),
    # 0.34: the reload lifecycle the workers' engines call (VLLM_RELOAD_MODE)
    "reload.start_reload": ("vllm.model_executor.model_loader.reload", "start_reload"),
}


@dataclasses.dataclass(frozen=True)
class EngineApi:
    """How one of vLLM's own weight-transfer engines is named in vLLM, as ``probe``
    reads it: its module, its trainer init-info and update-info classes, other names
    worth a capability (``extra``: capability -> (module, dotted attribute)), and its
    0.26-style static trainer API: the capabilities that must all be present for the
    ``static`` path (``static``), the one of them that sends (present only where it
    takes (iterator, trainer_args): 0.27.1 keeps IPC's as a stub that raises), and how
    vLLM's trainer code calls it (``static_words``; None: that code has no static path,
    and ``no_factory_words`` says why it needs the factory)."""

    module: str
    init_info: str
    update_info: str
    extra: tuple[tuple[str, str, str], ...] = ()
    static: tuple[str, ...] = ()
    static_sender: str | None = None
    static_words: str | None = None
    no_factory_words: str | None = None

    def where(self) -> dict[str, tuple[str, str]]:
        return {self.init_info: (self.module, self.init_info),
                self.update_info: (self.module, self.update_info),
                **{name: (module, attr) for name, module, attr in self.extra}}

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EngineApi":
        return cls(**{**d, "extra": tuple(tuple(e) for e in d["extra"]),
                      "static": tuple(d["static"])})


Engines = dict  # engine name -> EngineApi: the engines vLLM itself implements


def _where(engines: Engines) -> dict[str, tuple[str, str]]:
    out = dict(_WHERE)
    for api in engines.values():
        out.update(api.where())
    return out


def vllm_version() -> str | None:
    """The vLLM version: the imported module's when vLLM is already imported, else the
    installed package's metadata (so that asking does not import vLLM)."""
    if "vllm" in sys.modules:
        version = getattr(sys.modules["vllm"], "__version__", None)
        if version:
            return version
    version, _ = installed_vllm()
    if version:
        return version
    try:
        import vllm
        return getattr(vllm, "__version__", None)
    except Exception:
        return None


def lookup(name: str, engines: Engines | None = None) -> Any:
    """The vLLM object behind capability ``name`` (``_WHERE``, or a name of one of
    ``engines``); raises if absent."""
    module, attr = _where(engines or {})[name]
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _takes_iterator_and_args(fn: Any) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(named) >= 2


def _field_names(cls: Any) -> list[str] | None:
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else None


def probe(engines: Engines, isolated: bool = False) -> dict[str, Any]:
    """Which trainer-side APIs the installed vLLM has, for ``engines`` (engine name ->
    ``EngineApi``: the engines vLLM implements, as the backends name them).

    Keys: one bool per name in ``_WHERE`` and in each engine's names;
    ``trainer_factory_backends`` (engines registered with the trainer factory);
    ``factory_takes_backend`` (the 0.26 ``trainer_init(backend, config, init_info)``
    form); per engine ``<engine>_update_info_fields``,
    ``<engine>_update_info_elides_metadata``, ``<engine>_update_info_names_sender`` and
    ``<engine>_path`` (what its sender will use); ``engine_modules`` (engine -> its
    vLLM module); ``errors`` (module -> import error); ``vllm_version``.
    ``isolated=True`` runs the probe in a child process, so the caller imports nothing
    of vLLM or torch.
    """
    if isolated:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        code = ("import json, sys, harness.vllm.api as v; engines = {k: v.EngineApi.from_json(d) "
                "for k, d in json.loads(sys.argv[1]).items()}; "
                "print('PROBE ' + json.dumps(v.probe(engines)))")
        arg = json.dumps({k: api.as_json() for k, api in engines.items()})
        proc = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"vLLM probe child failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        return json.loads(lines[-1][len("PROBE "):])
    # a fresh copy: callers may mutate it
    return json.loads(json.dumps(_probe_here(tuple(sorted(engines.items())))))


@functools.cache
def _probe_here(engine_items: tuple[tuple[str, EngineApi], ...]) -> dict[str, Any]:
    engines = dict(engine_items)
    senders = {api.static_sender for api in engines.values() if api.static_sender}
    caps: dict[str, Any] = {"vllm_version": None, "errors": {}}
    for name, (module, _) in _where(engines).items():
        try:
            obj = lookup(name, engines)
        except ImportError as e:  # the module itself is missing or its imports fail
            caps["errors"].setdefault(module, f"{type(e).__name__}: {e}")
            obj = None
        except AttributeError:    # the module is there, this API is not
            obj = None
        except Exception as e:    # a module that raises on import for any other reason
            caps["errors"].setdefault(module, f"{type(e).__name__}: {e}")
            obj = None
        caps[name] = obj is not None and (name not in senders or _takes_iterator_and_args(obj))

    caps["trainer_factory_backends"] = []
    caps["factory_takes_backend"] = False
    if caps["WeightTransferTrainerFactory"]:
        factory = lookup("WeightTransferTrainerFactory")
        caps["trainer_factory_backends"] = sorted(getattr(factory, "_registry", {}) or {})
        params = list(inspect.signature(factory.trainer_init).parameters)
        caps["factory_takes_backend"] = bool(params) and params[0] == "backend"
    caps["engine_modules"] = {engine: api.module for engine, api in engines.items()}
    for engine, api in engines.items():
        info = lookup(api.update_info, engines) if caps[api.update_info] else None
        caps[f"{engine}_update_info_fields"] = _field_names(info) if info else None
        caps[f"{engine}_update_info_elides_metadata"] = (
            update_info_elides_metadata(info) if info else None)
        caps[f"{engine}_update_info_names_sender"] = (
            update_info_names_sender(info) if info else None)
        caps[f"{engine}_path"] = _path(caps, engine, api)
    caps["weight_source_style"] = (source_style(lookup("WeightSource"))
                                   if caps["WeightSource"] else None)
    caps["vllm_version"] = vllm_version()  # after the imports: the version actually imported
    return caps


def _path(caps: dict[str, Any], engine: str, api: EngineApi) -> str:
    """``factory`` (0.27.1+ stateful trainer engine), ``static`` (0.26-style static
    sender, we drive the routes), ``raw`` (neither: the harness's own sender) or
    ``unimportable`` (vLLM's engine module fails to import; see ``errors``)."""
    if api.module in caps["errors"]:
        return "unimportable"
    if (caps[api.init_info] and engine in caps["trainer_factory_backends"]
            and not caps["factory_takes_backend"]):
        return "factory"
    if api.static and all(caps[s] for s in api.static):
        return "static"
    return "raw"


# --------------------------------------------------------------------------- trainer code


def trainer_code_path(engine: str, api: EngineApi | None, caps: dict[str, Any],
                      init_info: str) -> tuple[str | None, str]:
    """How the trainer code vLLM's examples teach pushes ``engine``'s weights on this
    release: ``(path, what)``, or ``(None, why not)``. Paths:

    * ``factory``: ``WeightTransferTrainerFactory.trainer_init(<Engine>TrainerInitInfo(
      rank=0, ...), client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))``,
      then ``send_weights()`` per update (0.27.1+ IPC, 0.32 NCCL, shm once registered);
    * ``factory-by-backend``: 0.26's factory, ``trainer_init(backend, config, init_info,
      client=, source=)``; it registers no engine of its own, so only shm takes it;
    * ``static``: 0.26 IPC, ``IPCWeightTransferEngine.trainer_send_weights(iter(source),
      {"send_mode": "http", "url": url, "packed": ...})`` between the client's
      ``start_weight_update`` and ``finish_weight_update``.

    ``api``: the engine's names where vLLM implements it (None: an engine a plugin
    registers); ``init_info``: the name of its trainer init-info class. Registration
    is read live (a plugin's engine registers itself in the trainer process), the rest
    from ``caps`` (``probe()``).
    """
    module = api.module if api is not None else None
    if module in caps.get("errors", {}):
        return None, (f"vLLM's {engine.upper()} engine module cannot be imported: "
                      f"{caps['errors'][module]}")
    for need in ("HTTPVLLMWeightSyncClient", "ModuleSource"):
        if not caps.get(need):
            return None, f"vLLM {caps.get('vllm_version')} has no {need}"
    registered: list[str] = []
    if caps.get("WeightTransferTrainerFactory"):
        registered = sorted(getattr(lookup("WeightTransferTrainerFactory"), "_registry", {})
                            or {})
    by_backend = caps.get("factory_takes_backend")
    if engine in registered:
        if api is not None and not caps.get(api.init_info):
            return None, (f"'{engine}' is registered with the trainer factory, but vLLM "
                          f"{caps.get('vllm_version')} has no {api.init_info}")
        if not by_backend:
            return "factory", (f"WeightTransferTrainerFactory.trainer_init("
                               f"{init_info}(rank=0, "
                               "...), client=HTTPVLLMWeightSyncClient, source=ModuleSource) + "
                               "send_weights()")
        return "factory-by-backend", (f"WeightTransferTrainerFactory.trainer_init('{engine}', "
                                      f"WeightTransferConfig, {init_info}(rank=0, ...), "
                                      "client=HTTPVLLMWeightSyncClient, source=ModuleSource) + "
                                      "send_weights()")
    if api is not None and api.static_words and caps.get(api.static_sender):
        return "static", api.static_words
    if api is not None and api.no_factory_words:
        return None, f"vLLM {caps.get('vllm_version')} {api.no_factory_words}"
    if not caps.get("WeightTransferTrainerFactory"):
        return None, f"vLLM {caps.get('vllm_version')} has no WeightTransferTrainerFactory"
    return None, (f"'{engine}' is not registered with vLLM {caps.get('vllm_version')}'s "
                  f"WeightTransferTrainerFactory (registered: {', '.join(registered) or 'none'})")


# Run by backend_importable in a child: import MODULE, report the outcome as one JSON line,
# naming the innermost frame inside vLLM when the import raises.
_IMPORT_CHILD = """
import importlib, json, os, traceback
try:
    importlib.import_module(MODULE)
    out = {"ok": True}
except BaseException as e:
    inside = [f for f in traceback.extract_tb(e.__traceback__)
              if os.sep + "vllm" + os.sep in f.filename]
    f = inside[-1] if inside else None
    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if f is not None:
        out.update(file=f.filename, line=f.lineno, func=f.name, code=f.line)
try:
    import vllm
    out["version"] = vllm.__version__
except BaseException:
    out["version"] = None
print("IMPORT " + json.dumps(out))
"""


def sender_path(engine: str, engines: Engines, error: type[Exception]
                ) -> tuple[dict[str, Any], str]:
    """(probe(engines), the path the ``engine`` sender will take); ``error`` names the
    exact import failure when vLLM's engine module for it cannot be imported."""
    caps = probe(engines)
    path = caps[f"{engine}_path"]
    if path == "unimportable":
        raise error(f"vLLM's {engine.upper()} engine module cannot be imported: "
                    f"{caps['errors'].get(engines[engine].module)}")
    return caps, path


def backend_importable(module: str, timeout: float = 120.0) -> tuple[bool, str]:
    """Can vLLM's engine module ``module`` be imported?

    Tried in a child process so the caller imports no CUDA library. On failure the
    reason is the exception plus where in vLLM it was raised, e.g.
    ``ModuleNotFoundError: No module named 'ray' (vLLM 0.26.0's ipc_engine.py
    raises it at module level: line 11, `import ray`)``.
    """
    code = _IMPORT_CHILD.replace("MODULE", repr(module))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"importing {module} did not finish within {timeout:.0f}s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("IMPORT ")]
    if not lines:
        return False, (f"the child importing {module} died (exit {proc.returncode}): "
                       f"{proc.stderr.strip()[-1500:]}")
    r = json.loads(lines[-1][len("IMPORT "):])
    if r["ok"]:
        return True, f"{module} imports (vLLM {r.get('version')})"
    where = ""
    if r.get("file"):
        what = "at module level" if r["func"] == "<module>" else f"in {r['func']}()"
        version = r.get("version") or vllm_version()
        where = (f" (vLLM {version}'s {Path(r['file']).name} raises it {what}: "
                 f"line {r['line']}, `{r['code']}`)")
    return False, r["error"] + where


# --------------------------------------------------------------------------- adapters

def source_style(weight_source_cls: type) -> str:
    """``"iter_full"`` (0.33: ``metadata`` a property, iteration ``iter_full()``) or
    ``"iter"`` (0.26-0.32: ``metadata()`` a method, iteration ``__iter__``), read from
    vLLM's ``WeightSource`` class itself."""
    static = inspect.getattr_static(weight_source_cls, "metadata", None)
    if isinstance(static, (property, functools.cached_property)) \
            or callable(getattr(weight_source_cls, "iter_full", None)):
        return "iter_full"
    return "iter"


def source_metadata(source: Any) -> list:
    """A ``WeightSource``'s metadata: ``source.metadata`` (0.33) or ``source.metadata()``."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def iterate_source(source: Any):
    """One pass over a ``WeightSource``: ``iter_full()`` where the class implements it
    (0.33), else ``iter(source)``."""
    implements = getattr(source, "implements_iter_full", None)
    if callable(implements) and implements():
        return source.iter_full()
    return iter(source)


def forget_sent_metadata(engine: Any) -> bool:
    """Make a vLLM 0.33 NCCL trainer engine send its update's names, dtypes and shapes
    again on the next round (it elides them when they did not change: ``_sent_meta``).
    True when the engine has that state; older engines always send them."""
    if hasattr(engine, "_sent_meta"):
        engine._sent_meta = None
        return True
    return False


def update_info_elides_metadata(update_info_cls: Any) -> bool:
    """Does this NCCL update-info dataclass accept empty names/dtypes/shapes (0.33:
    "reuse the previous update's metadata")? Read from its fields' defaults."""
    if not dataclasses.is_dataclass(update_info_cls):
        return False
    fields = {f.name: f for f in dataclasses.fields(update_info_cls)}
    need = ("names", "dtype_names", "shapes")
    return all(n in fields and (fields[n].default is not dataclasses.MISSING
                                or fields[n].default_factory is not dataclasses.MISSING)
               for n in need)


def update_info_names_sender(update_info_cls: Any) -> bool:
    """Does this NCCL update-info dataclass name its broadcaster (0.34's ``src``: several
    trainer ranks, e.g. pipeline stages, each broadcast their own parameters)?"""
    return dataclasses.is_dataclass(update_info_cls) and any(
        f.name == "src" for f in dataclasses.fields(update_info_cls))


class RecordingClient:
    """The harness's ``ServerClient`` as vLLM's trainer engines see it.

    It implements the four ``VLLMWeightSyncClient`` methods and adds two things:

    * payloads are made JSON-safe (``json_safe_update_info``), so IPC handles
      survive our verbatim HTTP client;
    * every call is recorded (route, count of ``update_weights``) and the first
      failure is kept and signalled through ``failed``. vLLM runs some of these
      calls on its own helper threads; when one fails while the trainer thread is
      blocked in an NCCL collective, nobody would read that exception. The senders
      watch ``failed`` to stop waiting and report the real cause.

    ``weight_version``, when given, rides every ``/finish_weight_update`` that names
    none itself: vLLM's trainer engines call ``finish_weight_update()`` bare, and this is
    how a sync through them publishes a version.

    Anything else (``url``, ``_call``, ``raw``, ...) is the wrapped client's.
    """

    def __init__(self, client: Any, weight_version: str | None = None):
        self._client = client
        self.weight_version = weight_version
        self._lock = threading.Lock()
        self.calls: list[str] = []
        self.update_calls = 0
        self.error: BaseException | None = None
        self.error_route: str | None = None
        self.failed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def reset(self) -> None:
        """Start a new round's record (one client serves a trainer's whole life)."""
        with self._lock:
            self.calls, self.update_calls = [], 0
            self.error = self.error_route = None
            self.failed.clear()

    def _do(self, route: str, fn, *args: Any) -> Any:
        with self._lock:
            self.calls.append(route)
        try:
            return fn(*args)
        except BaseException as e:
            with self._lock:
                if self.error is None:
                    self.error, self.error_route = e, route
            self.failed.set()
            raise

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._do("/init_weight_transfer_engine", self._client.init_weight_transfer_engine,
                 init_info)

    def start_weight_update(self) -> None:
        self._do("/start_weight_update", self._client.start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        payload = json_safe_update_info(update_info)
        with self._lock:
            self.update_calls += 1
        self._do("/update_weights", self._client.update_weights, payload)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        weight_version = weight_version if weight_version is not None else self.weight_version
        if weight_version is None:
            self._do("/finish_weight_update", self._client.finish_weight_update)
        else:
            self._do("/finish_weight_update", self._client.finish_weight_update, weight_version)
