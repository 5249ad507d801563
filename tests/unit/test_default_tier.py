"""The default CPU tier keeps every test function: ``python -m pytest`` on a host
without GPUs (README line 2, ``.ci/run``) collects each function that
``tests/default_tier.txt`` lists at least once. Sweeps over architectures, dtypes and
twins may move to ``--harness-depth full``; a function may not drop out of CI."""

from __future__ import annotations

from pathlib import Path

from child_pytest import H200_HOST

ROOT = Path(__file__).resolve().parents[2]
LISTED = ROOT / "tests" / "default_tier.txt"


def listed() -> list[str]:
    return [line.strip() for line in LISTED.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def functions(nodeids: list[str]) -> set[str]:
    return {n.split("[", 1)[0] for n in nodeids}


def collected_functions(child_pytest) -> set[str]:
    """``file::function`` of every test outside tests/unit that the default selection
    collects, on a host without GPUs whatever this one has."""
    r = child_pytest.cpu_default()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return functions([n for n in r.nodeids() if not n.startswith("tests/unit/")])


def test_every_listed_function_is_in_the_default_tier(child_pytest):
    got = collected_functions(child_pytest)
    missing = [f for f in listed() if f not in got]
    assert not missing, (f"{len(missing)} test function(s) of the default tier are no longer "
                         f"collected on a host without GPUs: {missing[:10]}")


def test_the_list_names_no_function_twice():
    names = listed()
    assert len(names) == len(set(names)) and len(names) >= 123, len(names)


def gpu_selection(child_pytest, *depth: str) -> list[str]:
    """What ``-k "ipc and not smollm2"`` collects for one H200 (the GPU CI selection,
    planned for that host) at ``--harness-depth`` ``depth``, or at the default without."""
    r = child_pytest("--harness-plan", "--harness-plan-host", H200_HOST,
                     "-k", "ipc and not smollm2", *depth)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.nodeids()


def test_quick_depth_on_a_gpu_keeps_every_test_function_of_full_depth(child_pytest):
    """On GPUs quick depth (the default) trims the architecture sweep's cases, never a test
    function: every function the GPU CI selection runs at full depth it runs at quick."""
    full, quick = gpu_selection(child_pytest, "--harness-depth", "full"), gpu_selection(child_pytest)
    assert len(quick) < len(full), "the default depth trims no case: not quick"
    missing = sorted(functions(full) - functions(quick))
    assert not missing, f"{len(missing)} function(s) only at full depth on a GPU: {missing[:10]}"
    assert len(functions(quick)) >= 120, len(functions(quick))


def test_ci_selects_every_test_the_unit_command_leaves_out():
    """The README's unit-test command leaves out the ``slow_unit`` tests (they run whole
    processes; tests/unit/conftest.py): CI's ``pytest`` runs them, with the whole suite,
    because it selects by no mark, keyword or path, and the configuration adds none."""
    calls = [ln.split("-m pytest", 1)[1].split() for ln in
             (ROOT / ".ci" / "run").read_text().splitlines()
             if "-m pytest" in ln and not ln.lstrip().startswith("#")]
    assert len(calls) == 1, calls
    addopts = next((ln for ln in (ROOT / "pytest.ini").read_text().splitlines()
                    if ln.startswith("addopts")), "").split("=", 1)[-1].split()
    narrowing = [w for w in calls[0] + addopts
                 if w.startswith(("-m", "-k", "--ignore", "--deselect", "tests"))]
    assert not narrowing, f".ci/run's pytest leaves tests out: {narrowing}"
