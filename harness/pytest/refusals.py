"""Runs refused before they start, one usage error each (exit 4): a selection of only
GPU cases on a host that cannot run them, a model directory no server could serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.core import facts
from harness.pytest import selection as _selection
from harness.run import settings as _settings


def refuses(config: pytest.Config, s: _settings.Settings) -> bool:
    """Does a selection of GPU cases none of which can run here end this run before it
    starts? Not when it only collects or plans, or when --harness-allow-no-gpu is set."""
    return not (s.harness_allow_no_gpu or s.harness_plan or config.option.collectonly)


def refuse_gpu_only_selection(config: pytest.Config, s: _settings.Settings) -> None:
    """Before collection (10-25 s of imports): a selection that the options and -k
    certainly confine to GPU cases this host cannot run (``--vllm-backend ipc-packed``,
    ``-k ipc`` on a host without GPUs) is one usage error, exit 4, before any test runs.
    Selections this cannot judge are refused at the end of collection instead."""
    if not refuses(config, s):
        return
    from harness.run import layouts
    from harness.transfer import VARIANTS

    if not any(VARIANTS[b].needs_gpu for b in s.vllm_backend) and not any(
            layouts.LAYOUTS[n].gpus_needed for n in s.vllm_layout):
        return  # nothing selected needs a GPU: no probe
    keyword = getattr(config.option, "keyword", "") or ""
    marks = getattr(config.option, "markexpr", "") or ""
    if not (keyword.strip() or marks.strip() or {"vllm_backend", "vllm_layout"} & s.explicit):
        return  # nothing narrowed: the CPU cases are in it, so no probe (and none in a
        # project that does not use the harness)
    gpus = s.gpus()
    tails = [f"{facts.short_dtype(d)}-{Path(m).name}" for d in s.vllm_dtype for m in s.vllm_model]

    def ids(names, here: bool) -> list[str]:
        return [f"{b}-{n}-{t}" for b in s.vllm_backend for n in names for t in tails
                if layouts.runs_on(VARIANTS[b], layouts.LAYOUTS[n])
                and (layouts.LAYOUTS[n].gpus_needed <= gpus) == here]
    named = _selection.names_only_gpu_cases(
        keyword, marks, ids(s.vllm_layout, False), ids(layouts.LAYOUTS, True),
        _selection.case_vocabulary(VARIANTS, {v.engine for v in VARIANTS.values()},
                                   layouts.LAYOUTS))
    if not named:
        return
    who = " ".join([f"{o.flag} {','.join(getattr(s, o.name))}" for o in _settings.OPTIONS
                    if o.name in ("vllm_backend", "vllm_layout") and o.name in s.explicit]
                   + ([_selection.asked(config)] if _selection.asked(config) else []))
    need = sorted({(layouts.LAYOUTS[n].gpus_needed, n) for n in s.vllm_layout
                   if any(f"-{n}-" in i for i in named)})
    raise pytest.UsageError(
        f"{who or 'the selection'} selects only GPU cases (on "
        + ", ".join(f"{n}, {k} GPU{'s' if k > 1 else ''}" for k, n in need)
        + f") and this host has {gpus} GPU(s): nothing was run; the cases that run here "
        "are shm's, and --harness-allow-no-gpu runs the rest of the selection")


def refuse_unservable_models(config: pytest.Config, s: _settings.Settings) -> None:
    """A model directory of the user's that no server could serve or the checks use
    (no tokenizer, too few positions, a head size a CPU server refuses) is one line per
    problem, exit 4, before any server starts (``harness.models.requirements``)."""
    from harness import models
    from harness.models import requirements
    from harness.run import layouts

    paths = [v for kind, v in (models.classify_model(m) for m in s.vllm_model) if kind == "path"]
    if not paths or s.harness_plan or config.option.collectonly:
        return
    cpu = any(not layouts.LAYOUTS[n].server_gpus for n in s.vllm_layout) and (
        "vllm_layout" in s.explicit or s.gpus() == 0)
    said = [f"--vllm-model: {p}" for path in paths
            for p in requirements.problems(path, cpu_server=cpu)]
    if said:
        raise pytest.UsageError("\n".join(said))
