"""The child pytest runs the unit tests share (tests/unit/child_pytest.py): one run per
arguments and environment, made once, and never another's result for a run that
differs in either."""

from __future__ import annotations

import child_pytest as C


def test_a_run_is_known_by_its_arguments_and_its_whole_environment(monkeypatch):
    monkeypatch.setenv("HARNESS_VLLM_MODEL", "opt")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    env = C.child_env()
    assert not any(k.startswith(("HARNESS_VLLM", "PYTEST_")) for k in env)
    assert env["HARNESS_REPORT_PROBES"] == "0" and C.child_env(C.NO_GPU)["CUDA_VISIBLE_DEVICES"] == ""
    same = C.key(("-k", "ipc"), env)
    assert C.key(("-k", "ipc"), dict(env)) == same
    assert C.key(("-k", "nccl"), env) != same
    assert C.key(("-k", "ipc", "tests/test_sleep.py"), env) != same
    assert C.key(("-k", "ipc"), {**env, "CUDA_VISIBLE_DEVICES": ""}) != same
    assert C.key(("-k", "ipc"), {**env, "PATH": env.get("PATH", "") + ":/x"}) != same


def test_the_same_run_is_made_once_and_a_different_one_again(tmp_path, monkeypatch):
    made = []

    def make(self, base, args, env):
        made.append(args)
        return C.Run(0, f"run {len(made)}", "", [(f"tests/t.py::{a}", False) for a in args],
                     None, None)

    monkeypatch.setattr(C.ChildRuns, "_make", make)
    runs, again = C.ChildRuns(tmp_path), C.ChildRuns(tmp_path)  # two workers of one run
    assert runs("a").stdout == again("a").stdout == "run 1"
    assert runs("b").stdout == "run 2" and runs("a", env={"X": "1"}).stdout == "run 3"
    assert made == [("a",), ("b",), ("a",)]
    assert runs("b").nodeids() == ["tests/t.py::b"]
