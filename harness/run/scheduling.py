"""The controller's side of a run side by side (``harness.run.parallel``): the
partition gw0 writes for it (test id -> bin), and ``Scheduling``, the scheduler
pytest-xdist asks for work: the tests without a server to whichever worker asks,
a module at a time, then each worker its own bin in plan order, all at once."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

from harness.run.parallel import DIR_ENV

PARTITION_WAIT_S = 180.0


def write_partition(bins: list[int | None], ids: Sequence[str]) -> None:
    """gw0's partition, for the controller: test id -> bin (null: no server)."""
    d = Path(os.environ[DIR_ENV])
    tmp = d / "partition.json.tmp"
    tmp.write_text(json.dumps(dict(zip(ids, bins))))
    tmp.replace(d / "partition.json")


class Scheduling:
    """The controller's scheduler (pytest-xdist's protocol): tests without a server to
    whichever worker asks, a few at a time; then each worker's own bin at once."""

    CHUNK = 4

    def __init__(self, config):
        self.config = config
        self.numnodes = len(config.getoption("tx"))
        self.collection: list[str] | None = None
        self.node2collection: dict = {}
        self.node2pending: dict = {}
        self.free: list[list[int]] = []   # the tests without a server, by module
        self.bin_tests: dict[int, list[int]] = {}
        self.orphans: list[int] = []
        self.collection_is_completed = False
        self._scheduled = False

    # -- protocol
    @property
    def nodes(self):
        return list(self.node2pending)

    @property
    def tests_finished(self) -> bool:
        if not self.collection_is_completed or not self._scheduled:
            return False
        if self.free or self.orphans or any(self.bin_tests.values()):
            return False
        return all(len(p) < 2 for p in self.node2pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.free or self.orphans or any(self.bin_tests.values())
                    or any(self.node2pending.values()))

    def add_node(self, node) -> None:
        self.node2pending[node] = []

    def add_node_collection(self, node, collection) -> None:
        collection = list(collection)
        if self.collection is None:
            self.collection = collection
        elif collection != self.collection:
            from xdist.report import report_collection_diff

            raise RuntimeError(report_collection_diff(self.collection, collection,
                                                      "gw0", node.gateway.id))
        self.node2collection[node] = collection
        if len(self.node2collection) >= self.numnodes:
            self.collection_is_completed = True

    def mark_test_complete(self, node, item_index, duration: float = 0) -> None:
        self.node2pending[node].remove(item_index)
        self._feed(node)

    def mark_test_pending(self, item: str) -> None:
        self.orphans.append(self.collection.index(item))
        for node in self.nodes:
            self._feed(node)

    def remove_pending_tests_from_node(self, node, indices) -> None:
        for i in indices:
            self.node2pending[node].remove(i)
        self.orphans += list(indices)

    def remove_node(self, node):
        pending = self.node2pending.pop(node)
        self.orphans += self.bin_tests.pop(self._bin(node), [])
        if not pending:
            return None
        crash = self.collection[pending.pop(0)]
        self.orphans += pending
        for other in self.nodes:
            self._feed(other)
        return crash

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self._scheduled:  # a worker that replaces a dead one: the orphans are its
            for node in self.nodes:
                self._feed(node)
            return
        bins = read_partition(self.collection)
        modules: dict[str, list[int]] = {}
        for i, b in enumerate(bins):
            if b is None or b >= self.numnodes:
                modules.setdefault(self.collection[i].split("::", 1)[0], []).append(i)
            else:
                self.bin_tests.setdefault(b, []).append(i)
        # a module's tests go to one worker together: its module-scoped fixtures (a
        # session killed once, then inspected by several tests) are made once
        self.free = list(modules.values())
        self._scheduled = True
        for node in self.nodes:
            self._feed(node)

    # -- this scheduler's own
    def _bin(self, node) -> int:
        return int(str(node.gateway.id).lstrip("gw"))

    def _feed(self, node) -> None:
        if node not in self.node2pending or getattr(node, "shutting_down", False):
            return
        pending = self.node2pending[node]
        if len(pending) >= 2:
            return
        send: list[int] = []
        if self.free:  # whole modules, at least CHUNK tests when there are that many
            while self.free and len(send) < self.CHUNK:
                send += self.free.pop(0)
        elif self.bin_tests.get(self._bin(node)):
            send = self.bin_tests.pop(self._bin(node))
        elif self.orphans:
            send, self.orphans = self.orphans[:self.CHUNK], self.orphans[self.CHUNK:]
        if send:
            pending.extend(send)
            node.send_runtest_some(send)
        # Nothing more for this worker: say so now, as xdist's own schedulers do. A worker
        # runs a test only once it knows the next one (pytest's nextitem), so without
        # this each worker's last test waited for every other worker's: in a GPU run all
        # eight last tests began together at 582 s, their servers kept alive until then.
        if not (self.free or self.orphans or self.bin_tests.get(self._bin(node))):
            node.shutdown()


def read_partition(collection: Sequence[str], wait: float = PARTITION_WAIT_S) -> list[int | None]:
    """The bins gw0 wrote, in the collection's order (waits for the file: gw0 writes it
    as its collection ends, the controller may ask first)."""
    path = Path(os.environ[DIR_ENV]) / "partition.json"
    deadline = time.monotonic() + wait
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"weight-sync-harness: worker gw0 wrote no partition to {path} "
                               f"within {wait:.0f}s; run without -n to see why")
        time.sleep(0.1)
    bins = json.loads(path.read_text())
    missing = [nid for nid in collection if nid not in bins]
    if missing:
        raise RuntimeError(f"weight-sync-harness: gw0's partition lacks {len(missing)} of the "
                           f"collected tests, e.g. {missing[0]}")
    return [bins[nid] for nid in collection]
