"""``ProcessSwitch``: a process-wide setting changed for the length of a ``with`` block, shared by nested
and concurrent holders.

Why: some of what makes plan building fast is process-wide (Python's cycle collector, a function of
Paddle's swapped for a faster one with the same results). Two threads may build plans at once, and a
pass may run inside another; a plain save/restore would let the first one out restore the setting
while the other still relies on it. Here the first holder in changes the setting, the last one out
restores what it was.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator


class ProcessSwitch:
    """``turn_on()`` returns what ``turn_off(saved)`` needs to restore the setting as it was."""

    def __init__(self, turn_on: Callable[[], Any], turn_off: Callable[[Any], None]):
        self._turn_on, self._turn_off = turn_on, turn_off
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: Any = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The setting on for the ``with`` block (or the decorated function)."""
        with self._lock:
            if self._holders == 0:
                self._saved = self._turn_on()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    self._turn_off(self._saved)
                    self._saved = None
