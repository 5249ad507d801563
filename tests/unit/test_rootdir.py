"""An option value that is an existing path outside the project (``--vllm-model
/data/mymodel``, ``--harness-report /abs/report.json``, ``--vllm-log-dir /abs/logs``,
with a space, not ``=``) must not move pytest's rootdir: pytest picks the rootdir from
the path-like arguments before the plugin's options are known, and took such a value
for a test path, dropping the project's ini file (no timeout, no strict markers)."""

from __future__ import annotations

import pytest

INI = "[pytest]\naddopts = -p no:cacheprovider --strict-markers\nmarkers =\n    mine: a marker\n"


@pytest.fixture
def project(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makefile(".ini", pytest=INI)
    # registered in the ini: fine; not registered: an error under the ini's --strict-markers
    pytester.makepyfile(test_one="import pytest\n\n@pytest.mark.mine\ndef test_x():\n    pass\n",
                        test_two="import pytest\n\n@pytest.mark.bogus\ndef test_y():\n    pass\n")
    elsewhere = pytester.path.parent / f"{pytester.path.name}-elsewhere"
    (elsewhere / "logs").mkdir(parents=True)
    (elsewhere / "old.json").write_text("{}")
    return pytester, elsewhere


@pytest.mark.parametrize("option,value,form", [("--vllm-log-dir", "logs", "space"),
                                               ("--harness-report", "old.json", "space"),
                                               ("--harness-report", "old.json", "equals")])
def test_an_option_value_outside_the_project_keeps_the_rootdir(project, form, option, value):
    pytester, elsewhere = project
    path = str(elsewhere / value)
    args = [option, path] if form == "space" else [f"{option}={path}"]
    r = pytester.runpytest_subprocess(*args, "--co")
    out = r.stdout.str()
    assert f"rootdir: {pytester.path}" in out, out
    assert "configfile: pytest.ini" in out, out
    assert "'bogus' not found in `markers` configuration option" in out, out
    assert "<Function test_x>" in out and r.ret == pytest.ExitCode.INTERRUPTED, out


def test_an_explicit_rootdir_is_left_alone(project):
    pytester, elsewhere = project
    r = pytester.runpytest_subprocess("--rootdir", str(elsewhere), "--co",
                                      "--vllm-log-dir", str(elsewhere / "logs"))
    assert f"rootdir: {elsewhere}" in r.stdout.str()
