"""A report names the run's files relative to where pytest ran, never the machine's
own paths: it can be committed as written."""

from harness.report import relative_paths


def test_paths_under_the_run_directory_are_written_relative_to_it():
    root = "/srv/ci/checkout"
    report = {"cwd": root, "command": f"cd {root} && {root}/.venv/bin/python -m pytest",
              "servers": [{"log": f"{root}/.harness-cache/logs/vllm-1.log"}],
              "other": "/srv/ci/checkout-2/x", "elsewhere": "/usr/lib/python3", "n": 3}
    got = relative_paths(report, root + "/")
    assert got["cwd"] == "."
    assert got["command"] == "cd . && ./.venv/bin/python -m pytest"
    assert got["servers"][0]["log"] == "./.harness-cache/logs/vllm-1.log"
    assert got["other"] == "/srv/ci/checkout-2/x"   # a sibling directory is not under it
    assert got["elsewhere"] == "/usr/lib/python3" and got["n"] == 3
