"""Which loaders feed which program: ``Executor.train_from_dataset(program)`` with no dataset finds its
loader here, as Paddle's executor finds the reader ops that a non-iterable loader adds to the program.

Weak both ways: a loader the user dropped disappears, and a loader does not keep its program alive. Except
a started non-iterable loader, held until ``reset()``: in Paddle its running reader thread keeps it alive, so
a script may start a loader it keeps no name for and still train from it.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Sequence

from .._paddle import framework

_LOADERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # creation number -> loader
_NUMBERS = itertools.count()
_STARTED: dict[int, Any] = {}  # id -> a started non-iterable loader, held until reset


def program_of(feed_list: Sequence[Any]) -> framework.Program:
    """The one program that ``feed_list``'s variables belong to."""
    programs: dict[int, list[str]] = {}
    for var in feed_list:
        programs.setdefault(id(var.block.program), []).append(var.name)
    if len(programs) > 1:
        groups = "; ".join(str(names) for names in programs.values())
        raise ValueError(f"feed_list variables belong to {len(programs)} different programs ({groups}): "
                         "a loader feeds one program; build all its paddle.static.data variables under one "
                         "program_guard")
    return feed_list[0].block.program


def register(loader: Any) -> None:
    _LOADERS[next(_NUMBERS)] = loader


def hold(loader: Any, started: bool) -> None:
    """Keep ``loader`` alive while ``started``."""
    if started:
        _STARTED[id(loader)] = loader
    else:
        _STARTED.pop(id(loader), None)


def loaders_of(program: framework.Program) -> list:
    """The live loaders whose feed variables belong to ``program``, in creation order."""
    return [loader for loader in list(_LOADERS.values()) if loader.program is program]
