"""Cases as test parameters: the case each test function runs on, which cases a run
leaves out and why (``harness_deselect``), and what each collected test needs of the
pool (``need``). The plugin's hooks call these; nothing here is a hook."""

from __future__ import annotations

import pytest

from harness import models
from harness.core import facts
from harness.core.facts import canonical_dtype
from harness.pytest import selection as _selection
from harness.run import plan as _plan
from harness.run import settings as _settings
from harness.run.cases import Case, build_cases, server_config_for, twin_config
from harness.trainer import user as trainer_plugin



def _marker_args(definition, name: str) -> tuple[str, ...] | None:
    m = definition.get_closest_marker(name)
    return tuple(m.args) if m and m.args else None


def _deselect(reason: str):
    return pytest.mark.harness_deselect(reason=reason)


def parametrize_cases(metafunc: pytest.Metafunc, s: _settings.Settings) -> None:
    """Parametrize a test that takes ``case`` with the cases the options and its markers
    select; a case this run cannot or must not run stays collected, marked to be
    deselected with the reason (or skipped, where this host's vLLM lacks what it needs)."""
    d = metafunc.definition
    models = _settings.narrow(_marker_args(d, "models"), s.vllm_model, "vllm_model" in s.explicit)
    dtypes = _settings.narrow(_marker_args(d, "dtypes"), s.vllm_dtype,
                              "vllm_dtype" in s.explicit, canonical_dtype)
    pinned_backends = _marker_args(d, "backends")
    backends = [b for b in s.vllm_backend if not pinned_backends or b in pinned_backends]
    layouts = _settings.narrow(_marker_args(d, "layouts"), s.vllm_layout,
                               "vllm_layout" in s.explicit)
    modes = _settings.narrow(_marker_args(d, "modes"), s.vllm_mode, "vllm_mode" in s.explicit)
    trainers = _settings.narrow(trainer_plugin.pin(_marker_args(d, "trainers"), s.vllm_trainer),
                                s.vllm_trainer, "vllm_trainer" in s.explicit)
    cases = build_cases(backends, layouts, dtypes, models, modes, trainers,
                        _marker_args(d, "features") or ())
    if not cases:
        why = []
        for name, pinned, chosen in (("model", _marker_args(d, "models"), s.vllm_model),
                                     ("dtype", _marker_args(d, "dtypes"), s.vllm_dtype),
                                     ("backend", pinned_backends, s.vllm_backend),
                                     ("layout", _marker_args(d, "layouts"), s.vllm_layout),
                                     ("mode", _marker_args(d, "modes"), s.vllm_mode),
                                     ("trainer", _marker_args(d, "trainers"), s.vllm_trainer)):
            if pinned:
                why.append(f"{name}s {', '.join(pinned)}")
        reason = (f"pinned to {'; '.join(why)}, none of them selected" if why
                  else "no case selected by the backend/layout options")
        metafunc.parametrize("case", [pytest.param(None, marks=_deselect(reason))])
        return
    gpus = s.gpus() if any(c.layout.gpus_needed for c in cases) else 0
    quick = s.depth() == "quick"
    twin = d.get_closest_marker("twin") is not None
    no_cpu_serving = _no_cpu_serving(s) if any(not c.layout.gpus_needed for c in cases) else ""
    params = []
    for c in cases:
        marks = [pytest.mark.gpu] if c.layout.gpus_needed else []
        shallow = quick and _beyond_quick(c, s, twin, pinned=_pins_model(d, c.model))
        if c.layout.gpus_needed > gpus:
            marks.append(_deselect(f"layout {c.layout.name} needs {c.layout.gpus_needed} "
                                   f"GPU(s), {gpus} available"))
        elif no_cpu_serving and not c.layout.gpus_needed:
            marks.append(_deselect(no_cpu_serving))
        elif shallow:
            marks.append(_deselect(f"beyond --harness-depth quick ({shallow}); "
                                   f"--harness-depth full runs it"))
        elif c.unsupported():  # said, not hidden: the reason is what this host's vLLM lacks
            marks.append(pytest.mark.skip(reason=c.unsupported()))
        params.append(pytest.param(c, id=c.id, marks=marks))
    metafunc.parametrize("case", params)


def _no_cpu_serving(s) -> str:
    """Why this host leaves the ``cpu`` layout out ('' if it does not): it has GPUs and
    its vLLM is built for them (``facts.cpu_build``), so every CPU server would fail to
    start and each of its tests end in an error, as a first run of plain ``pytest`` on a
    GPU machine did. A host without GPUs keeps the layout whatever its vLLM: left out
    there, a wrong install would pass on the unit tests alone. Named with --vllm-layout,
    it runs."""
    if "vllm_layout" in s.explicit or not s.gpus():
        return ""
    version, dist = facts.installed_vllm()
    if facts.cpu_build(version, dist) is not False:
        return ""
    return f"{_selection.BUILD_PREFIX} (vllm {version} here is built for GPUs)"


def _beyond_quick(c: Case, s, twin: bool, pinned: bool = False) -> str:
    """Why case ``c`` is left out at quick depth ('' if it is not): the default model runs
    in every dimension. Another architecture runs once: on GPUs in bfloat16 (what RL
    trains in) with its twin, on the layouts whose server is on GPU 0, where a test
    pinned to it runs in every case. A layout whose server is on another GPU (the GPU 1
    mirror checks that IPC handles are matched by device identity) runs only the default
    model's plain engine: no other architecture, mode, feature or twin, which GPU 0 runs.
    On a host without GPUs another architecture runs in float32, without a twin, and only
    where the test is pinned to it (the architecture sweep is a server start per model
    there). Graph mode (150-300 s a
    start on CPU) runs only on GPUs, and no twin of a tensor-parallel CPU layout (a 260 s
    start). ci/matrix.sh runs the rest, at full depth. What the user named is always run.
    Every test function still runs at quick depth (tests/unit/test_default_tier.py)."""
    if c.mode != facts.DEFAULT_MODE and not c.layout.gpus_needed and "vllm_mode" not in s.explicit:
        return f"{c.mode} mode on a host without GPUs"
    if (twin and c.layout.tensor_parallel_size > 1 and not c.layout.gpus_needed
            and "vllm_layout" not in s.explicit):
        return "a twin of a tensor-parallel layout on a host without GPUs"
    if (c.layout.server_gpus and c.layout.server_gpus[0] != 0
            and "vllm_layout" not in s.explicit
            and (c.model not in s.vllm_model or c.mode != facts.DEFAULT_MODE
                 or c.features or twin)):
        return (f"{c.layout.name} beyond the default model's plain engine (the mirror "
                f"checks device identity; GPU 0 runs the rest)")
    if c.model in s.vllm_model or "vllm_model" in s.explicit:
        return ""
    if c.layout.gpus_needed:
        if pinned:
            return ""
        if c.dtype == "float32" and "vllm_dtype" not in s.explicit:
            return f"{c.model} in float32 (on GPUs the sweep runs in bfloat16)"
        if c.layout.server_gpus[0] != 0 and "vllm_layout" not in s.explicit:
            return f"{c.model} on {c.layout.name} (the sweep runs where the server is on GPU 0)"
        return ""
    if c.dtype != "float32" and "vllm_dtype" not in s.explicit:
        return f"{c.model} in {c.dtype}"
    if twin:
        return f"{c.model} against its twin"
    if not c.layout.gpus_needed and not pinned:
        return f"{c.model} in the architecture sweep on a host without GPUs"
    return ""


def _pins_model(definition, model: str) -> bool:
    """The test is about this model (``@pytest.mark.models`` names it and few others),
    not a sweep over the zoo."""
    pinned = _marker_args(definition, "models")
    return bool(pinned) and model in pinned and len(pinned) <= 2


def case_of(item: pytest.Item) -> Case | None:
    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("case") if callspec else None
    return case if isinstance(case, Case) else None


def need(item: pytest.Item, s: _settings.Settings, paths: dict[str, str]
          ) -> _plan.ServerNeed | None:
    """What ``item`` needs of the pool (None: no case, or a model that cannot be built
    here, whose tests skip saying why). Builds nothing."""
    case = case_of(item)
    if case is None or item.get_closest_marker("skip") is not None:
        return None
    if "server_pool" not in getattr(item, "fixturenames", ()):
        return None  # takes the case, never a server (a test of the case itself)
    if case.model not in paths:
        paths[case.model] = "" if models.unavailable(case.model) else models.planned_path(case.model)
    if not paths[case.model]:
        return None
    cfg = server_config_for(case, paths[case.model], attention_backend=s.vllm_attention_backend,
                            api_key=s.vllm_api_key)
    twin = item.get_closest_marker("twin")
    return _plan.ServerNeed(item.nodeid, cfg,
                      twin_config(cfg, paths[case.model], mode=twin.kwargs.get("mode"))
                      if twin else None,
                      fresh=(item.get_closest_marker("fresh_server") is not None
                             or "synced" in getattr(item, "fixturenames", ())),
                      breaks=item.get_closest_marker("breaks_server") is not None,
                      sleeps=item.get_closest_marker("sleeps") is not None,
                      trainer=case.backend.id + ("" if case.trainer == facts.DEFAULT_TRAINER
                                                 else f"+{case.trainer}"))
