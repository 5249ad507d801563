"""What a server's weights are, as the pool records them: a ``State`` and, once
synced, the directory they came from (``ServerWeights``). A test that needs
never-synced weights, or a given model's, reads it before it uses a server."""

from __future__ import annotations

import dataclasses
import enum


class State(enum.Enum):
    DUMMY = "dummy weights (never synced)"
    RESET = "dummy-equivalent weights pushed back (reset)"
    SYNCED = "synced"
    CORRUPTED = "deliberately corrupted update"
    INCOMPLETE = "sync did not complete"


@dataclasses.dataclass(frozen=True)
class ServerWeights:
    """What a server's weights are: ``weights`` (a directory) in ``state``."""

    state: State = State.DUMMY
    weights: str | None = None

    def holds(self, weights: str) -> bool:
        return self.state is State.SYNCED and self.weights == weights

    @property
    def fresh(self) -> bool:
        """Never synced, or reset to dummy-equivalent weights since."""
        return self.state in (State.DUMMY, State.RESET)
