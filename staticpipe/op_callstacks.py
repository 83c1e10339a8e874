"""Paddle's per-op call-stack record (legacy IR), made without asking the file system about every frame.

whose ``stat`` calls cost a fifth of Paddle's minimize.
``op_callstack`` attribute, shown in its error messages) through ``traceback.extract_stack()``. That
function ends with ``linecache.checkcache`` on each source file of the stack -- a ``stat`` system call
per file per op -- to notice a file edited on disk since its lines were cached. An optimizer's
``minimize`` of a 96-layer GPT creates about 10,000 ops (its accumulators' initialisers, the clipping
and the updates) with stacks some 25 frames deep: a fifth of Paddle's minimize was spent there.

``fast_callstacks()`` hands Paddle's framework module a ``traceback`` whose ``extract_stack()`` walks
the frames itself and checks each source file against ``linecache`` once per hold rather than once per
op: the same (file, line, function, source line) entries in the same order, so the recorded attribute is
unchanged (the tests compare it, a file edited before the hold too). Only a source file edited during
the ``with`` block could show its earlier text. A Paddle whose framework module takes no ``traceback``
is left alone.
"""
from __future__ import annotations

import linecache
import sys
import traceback
from typing import Any

from ._paddle import framework
from .process_switch import ProcessSwitch


class _Traceback:
    """Python's ``traceback`` module with an ``extract_stack()`` for the no-argument call Paddle makes that
    checks each source file once (``checked``: the files seen since the hold began)."""

    def __init__(self) -> None:
        self.checked: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(traceback, name)

    def extract_stack(self, f: Any = None, limit: int | None = None) -> Any:
        if f is not None or limit is not None or getattr(sys, "tracebacklimit", None) is not None:
            return traceback.extract_stack(f or sys._getframe(1), limit)
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            code, lineno = frame.f_code, frame.f_lineno
            filename = code.co_filename
            if filename not in self.checked:  # as Python's: a file edited since its lines were cached is read again
                self.checked.add(filename)
                linecache.checkcache(filename)
            if filename not in linecache.cache:
                linecache.lazycache(filename, frame.f_globals)  # sources only a loader knows (zip imports)
            line = None if lineno is None else linecache.getline(filename, lineno).strip()
            frames.append((filename, lineno, code.co_name, line))
            frame = frame.f_back
        frames.reverse()
        return frames


def _swap_in() -> Any:
    saved = getattr(framework, "traceback", None)
    if saved is traceback:
        framework.traceback = _Traceback()
    return saved


def _swap_out(saved: Any) -> None:
    if saved is traceback:
        framework.traceback = saved


fast_callstacks = ProcessSwitch(_swap_in, _swap_out).held
"""Paddle's op call stacks recorded without a ``stat`` per source file while a ``with fast_callstacks():``
block runs (process-wide; an op created on another thread meanwhile gets the same record as ever)."""
