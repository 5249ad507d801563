"""vLLM's own weight digests as a second oracle, beside the logits.

``POST /weight_checker {"action": "checksum"}`` (vLLM 0.32+) answers one SHA-256 per
weight tensor of every worker, keyed ``dp{i}:pp{j}:pcp{k}:tp{r}:<parameter name>``
(``gpu_worker.py`` ``Worker.compute_weight_checksums``, which the CPU worker inherits;
``model_loader/weight_checksum.py`` hashes each ``named_parameters()`` tensor's bytes).
A server whose weights were pushed by a sync must hold, on every rank, the bytes a
server that loaded the same checkpoint from disk holds: its disk-loaded twin.

What it sees that logits miss: any tensor the prompts barely exercise (an embedding
row no prompt uses), any rank of a tensor-parallel server. What it misses: state that
is not a parameter (on CPU, the prepacked GEMM copy a tied lm_head computes with:
known issue cpu-tied-lm-head-stale-after-reload passes the checksums and fails the
logits). Neither oracle replaces the other.

Pure functions of the two digest maps; no HTTP here (``ServerClient.weight_checksums``).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

ROUTE = "/weight_checker"
_KEY = re.compile(r"^dp(?P<dp>\d+):pp(?P<pp>\d+):pcp(?P<pcp>\d+):tp(?P<tp>\d+):(?P<name>.+)$")


@dataclasses.dataclass(frozen=True)
class Key:
    """One digest's key, split: the worker's coordinates and the parameter name."""

    rank: str   # "dp0:pp0:pcp0:tp1"
    tp: int
    name: str

    @classmethod
    def parse(cls, key: str) -> "Key":
        m = _KEY.match(key)
        if not m:  # an unknown layout of keys: the whole key names the tensor
            return cls(rank="?", tp=-1, name=key)
        return cls(rank=f"dp{m['dp']}:pp{m['pp']}:pcp{m['pcp']}:tp{m['tp']}", tp=int(m["tp"]),
                   name=m["name"])


@dataclasses.dataclass
class ChecksumDiff:
    """How two digest maps differ. ``mismatches`` are keys of both with other digests;
    ``only_got`` / ``only_want`` keys one side lacks."""

    compared: int
    mismatches: list[str]
    only_got: list[str]
    only_want: list[str]

    @property
    def match(self) -> bool:
        return not (self.mismatches or self.only_got or self.only_want)

    def keys(self) -> list[str]:
        return sorted(self.mismatches + self.only_got + self.only_want)

    def by_rank(self) -> dict[str, list[str]]:
        """Rank -> the parameter names that differ there."""
        out: dict[str, list[str]] = defaultdict(list)
        for k in self.keys():
            key = Key.parse(k)
            out[key.rank].append(key.name)
        return dict(sorted(out.items()))

    def describe(self, limit: int = 12) -> str:
        if self.match:
            return f"all {self.compared} digests match"
        lines = [f"{len(self.mismatches)} of {self.compared} digests differ"
                 + (f", {len(self.only_got)} only on the synced server" if self.only_got else "")
                 + (f", {len(self.only_want)} only on the baseline" if self.only_want else "")]
        for rank, names in self.by_rank().items():
            shown = ", ".join(names[:limit]) + (f", ... ({len(names)} in all)"
                                                if len(names) > limit else "")
            lines.append(f"  {rank}: {shown}")
        return "\n".join(lines)


def ranks(digests: dict[str, str]) -> list[str]:
    """The worker coordinates the digests come from (``dp0:pp0:pcp0:tp0``, ...)."""
    return sorted({Key.parse(k).rank for k in digests})


def diff(got: dict[str, str], want: dict[str, str]) -> ChecksumDiff:
    both = got.keys() & want.keys()
    return ChecksumDiff(compared=len(both),
                        mismatches=sorted(k for k in both if got[k] != want[k]),
                        only_got=sorted(got.keys() - want.keys()),
                        only_want=sorted(want.keys() - got.keys()))


def assert_match(got: dict[str, str], want: dict[str, str], *, what: str,
                 context: str = "") -> ChecksumDiff:
    """Raise ``AssertionError`` naming every differing (rank, tensor) unless ``got``
    equals ``want`` key for key. ``what`` says which two servers, and the vLLM version."""
    if not got or not want:
        raise AssertionError(f"{what}: POST {ROUTE} checksum answered no digest "
                             f"(synced {len(got)}, baseline {len(want)})"
                             + ("\n" + context if context else ""))
    d = diff(got, want)
    if not d.match:
        raise AssertionError(f"{what}: POST {ROUTE} {{'action': 'checksum'}}: {d.describe()}"
                             + ("\n" + context if context else ""))
    return d
