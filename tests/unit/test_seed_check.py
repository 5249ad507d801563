"""ci/seed_check.py: the one-line change to vLLM's example and the reading of what it prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("seed_check", ROOT / "ci" / "seed_check.py")
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)

PRINTED = """[server] Ready.
--------------------------------------------------
BEFORE weight sync (dummy weights):
--------------------------------------------------
Prompt: 'Hello, my name is'
Generated text: ' zq zq zq'
--------------------------------------------------
Prompt: "The capital's name"
Generated text: 'a\\nb'
--------------------------------------------------
[transfer] Initializing IPC weight transfer...
[sync] Weight transfer complete.
--------------------------------------------------
AFTER weight sync (real weights):
--------------------------------------------------
Prompt: 'Hello, my name is'
Generated text: ' the cat'
--------------------------------------------------
Prompt: "The capital's name"
Generated text: ' is Paris'
--------------------------------------------------
[server] Shutting down...
"""


def test_only_the_model_line_changes():
    script = 'import os\nMODEL_NAME = "facebook/opt-125m"\nSERVER_PORT = 8000\nprint(MODEL_NAME)\n'
    out = sc.patched(script, "/models/opt")
    assert out == "import os\nMODEL_NAME = '/models/opt'\nSERVER_PORT = 8000\nprint(MODEL_NAME)\n"
    with pytest.raises(SystemExit, match="no `MODEL_NAME = ...` line"):
        sc.patched("print(1)\n", "/m")


def test_the_completions_before_and_after_are_read_apart():
    before = sc.printed_completions(PRINTED, "BEFORE weight sync")
    after = sc.printed_completions(PRINTED, "AFTER weight sync")
    assert before == [("Hello, my name is", " zq zq zq"), ("The capital's name", "a\nb")]
    assert after == [("Hello, my name is", " the cat"), ("The capital's name", " is Paris")]
    assert sc.printed_completions("no such heading", "AFTER weight sync") == []


def test_a_missing_script_is_one_line(tmp_path, capsys):
    assert sc.main([str(tmp_path / "nope.py"), "--out", str(tmp_path / "o")]) == 2
    assert "no script at" in capsys.readouterr().err


def test_trailing_replacement_characters_are_what_vllm_holds_back_and_nothing_else():
    # vLLM holds back an incomplete UTF-8 sequence; a whole decode writes U+FFFD for it
    assert sc.same_text(" d/E\ufffd\ufffd\x14ive", " d/E\ufffd\ufffd\x14ive" + "\ufffd" * 25)
    assert sc.same_text("", "\ufffd" * 32)
    assert not sc.same_text(" d/E\x14ive", " d/E\ufffd\ufffd\x14ive")  # inside the text: a difference
    assert not sc.same_text("ick se se", "ick se so")
    checks = sc.judge(before=[("p", "zz")], after=[("p", "ab")], ref=["ab\ufffd"])
    assert checks["hf greedy after"]["ok"] and checks["gibberish before"]["ok"]
    checks = sc.judge(before=[("p", "ab")], after=[("p", "ac")], ref=["ab"])
    assert not checks["hf greedy after"]["ok"] and not checks["gibberish before"]["ok"]


def test_a_saved_verdict_is_judged_again_without_running_anything(tmp_path, capsys):
    import json
    (tmp_path / "verdict.json").write_text(json.dumps({
        "checks": {"script ran": {"ok": True}},
        "completions": [{"prompt": "p", "before": "", "after": "x", "hf": "x\ufffd"},
                        {"prompt": "q", "before": "zz", "after": "y", "hf": "y"}]}))
    assert sc.main(["unused.py", "--out", str(tmp_path), "--reread"]) == 0
    assert "PASSED" in capsys.readouterr().out
