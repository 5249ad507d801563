"""Capabilities a run did not exercise, and why: so that a green CPU run is not read as
saying something about MoE, LoRA or a second sync of the hybrid.

A capability is exercised when at least one of its tests came to a verdict of its own:
passed or failed. A test that came out known (a strict xfail: an upstream known issue
absorbed it), was skipped, or was left out by the harness (``--harness-depth``, the
GPUs here) says nothing about it. For each capability none of whose tests did, the run
says why, from what its tests did: "known issue X", "skipped: <reason>", "deselected:
<reason>", or that no test of it was selected. The end-of-run summary prints the list
(``harness.pytest.summary``), the JSON report keeps it (``uncovered_capabilities``).
Pure functions of node ids and outcomes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Iterable

# A status per node id: "passed" | "failed" | "known" | "skipped"; why (the known
# issue's id, the skip reason).
Verdicts = dict[str, tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class Capability:
    name: str
    tests: tuple[str, ...]           # node-id globs ("[[]" is a literal "[")
    not_tests: tuple[str, ...] = ()  # globs that do not count

    def covers(self, nodeid: str) -> bool:
        return (any(fnmatch.fnmatchcase(nodeid, g) for g in self.tests)
                and not any(fnmatch.fnmatchcase(nodeid, g) for g in self.not_tests))


CAPABILITIES: tuple[Capability, ...] = (
    Capability("MoE models (qwen3-moe): a sync and parity", ("*[[]*-qwen3-moe*",)),
    Capability("MoE routing replay (R3) and batch-invariant kernels",
               ("tests/test_moe_routing.py::*[[]*",)),  # on a server: its cases
    Capability("hybrid (Mamba2) repeated syncs",
               ("tests/test_hybrid.py::test_hybrid_repeated_syncs_last_one_wins*",
                "tests/test_parity.py::test_a_then_b_then_a_again[[]*-nemotron-h*")),
    Capability("a second sync with other weights beyond llama (A -> B -> A)",
               ("tests/test_parity.py::test_a_then_b_then_a_again[[]*",
                "tests/test_hybrid.py::test_hybrid_repeated_syncs_last_one_wins*",
                "tests/test_sync.py::test_tied_lm_head_workaround_restores_parity*"),
               ("*-llama]", "*-llama-[!t]*")),  # llama in any mode, not llama-tied
    Capability("LoRA adapters", ("tests/test_lora.py::*",)),
    Capability("data parallel (several engines)", ("tests/test_data_parallel.py::*",)),
    Capability("tensor parallel", ("tests/test_tensor_parallel.py::*", "*[[]*-*tp2-*")),
    Capability("sleep mode", ("tests/test_sleep.py::*",)),
    Capability("online fp8 quantization", ("tests/test_fp8.py::*",)),
    Capability("graph mode (torch.compile, CUDA graphs)", ("*[[]*-graphs*",)),
    Capability("NCCL weight transfer", ("*[[]nccl-*",)),
    Capability("CUDA IPC weight transfer", ("*[[]ipc-*",)),
    Capability("vLLM's weight digests (/weight_checker)", ("tests/test_checksums.py::*",)),
)


def verdict_of(outcome: str, known_issue: str | None, reason: str | None) -> tuple[str, str]:
    """A report's test (its outcome, known issue, skip or xfail reason) as a verdict."""
    if outcome == "xfailed":
        return "known", known_issue or (reason or "an xfail")
    if outcome in ("passed", "failed", "error", "xpassed"):
        return ("passed" if outcome == "passed" else "failed"), ""
    return "skipped", reason or ""


def uncovered(verdicts: Verdicts, deselected: Iterable[tuple[str, str]] = (),
              capabilities: Iterable[Capability] = CAPABILITIES) -> list[dict]:
    """Each capability none of whose tests came to a verdict, with why: ``verdicts`` of
    the tests that ran or were skipped, ``deselected`` (reason, node id) of those the
    harness left out."""
    deselected = list(deselected)
    out = []
    for cap in capabilities:
        mine = {n: v for n, v in verdicts.items() if cap.covers(n)}
        if any(status in ("passed", "failed") for status, _ in mine.values()):
            continue
        whys: dict[str, int] = {}
        for status, why in mine.values():
            named = re.search(r"known issue ([\w.-]+[\w])", why)
            key = (f"known issue {why}" if status == "known"
                   else f"skipped: upstream known issue {named.group(1)}" if named
                   else f"skipped: {_first(why)}" if why else "skipped")
            whys[key] = whys.get(key, 0) + 1
        for reason, nodeid in deselected:
            if cap.covers(nodeid):
                key = f"deselected: {_first(reason)}"
                whys[key] = whys.get(key, 0) + 1
        if not whys:
            whys = {"no test of it was selected": 0}
        out.append({"capability": cap.name,
                    "why": [f"{w} ({n} test{'s' * (n != 1)})" if n else w
                            for w, n in sorted(whys.items(), key=_order)]})
    return out


def _order(item: tuple[str, int]) -> tuple[int, int]:
    """Known issues and skips first (they say what is wrong), then the deselections
    (what this run or host left out), the most tests first within each."""
    why, n = item
    kind = 0 if why.startswith(("known issue", "skipped")) else 1
    return kind, -n


def _first(reason: str, limit: int = 160) -> str:
    line = " ".join(reason.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def lines(rows: list[dict], limit: int = 3) -> list[str]:
    """The summary's lines: one per capability, its first reasons."""
    out = []
    for r in rows:
        shown = r["why"][:limit] + ([f"and {len(r['why']) - limit} other reasons"]
                                    if len(r["why"]) > limit else [])
        out.append(f"  {r['capability']}: " + "; ".join(shown))
    return out
