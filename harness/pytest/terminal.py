"""Lines on the terminal while tests run: from any thread, whatever the verbosity, and
outside the capture of the test that is running."""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

import pytest


_TERMINAL = threading.Lock()
TERMINAL_FD = pytest.StashKey[int]()


def keep_terminal(config: pytest.Config) -> None:
    """Keep a descriptor of the terminal, taken while pytest's capture is off (between
    tests): during a test, pytest captures file descriptor 1, and a line written there
    would land in that test's captured output, shown only if it fails."""
    if TERMINAL_FD in config.stash:
        return
    try:
        config.stash[TERMINAL_FD] = os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real stdout: the reporter's writes
        pass


def terminal_line(config: pytest.Config) -> Callable[[str], None]:
    """A line on the terminal from any thread (server starts run in threads), whatever
    the verbosity and whatever test is running: a run that starts servers is silent for
    minutes otherwise."""
    def write(line: str) -> None:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is None:
            return
        fd = config.stash.get(TERMINAL_FD, None)
        with _TERMINAL:
            if fd is None:
                tr.write_line(f"weight-sync-harness: {line}")
                tr.flush()  # a CI log (a pipe, a file) shows it now, not at the next test
                return
            tr.flush()
            tw = getattr(tr, "_tw", None)
            # a new line unless the reporter's line is empty, or is where our last one ended
            mark = (id(tw), getattr(tw, "width_of_current_line", 0))
            lead = "\n" if mark[1] and mark != last[0] else ""
            try:
                os.write(fd, f"{lead}weight-sync-harness: {line}\n".encode())
            except OSError:
                pass
            last[0] = mark
    last: list = [None]
    return write


def release_terminal(config: pytest.Config) -> None:
    """The descriptor ``keep_terminal`` took, closed at the session's end."""
    fd = config.stash.get(TERMINAL_FD, None)
    if fd is not None:
        os.close(fd)
        del config.stash[TERMINAL_FD]
