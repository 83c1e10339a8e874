"""Where a loader's data stands, as a checkpoint records it: an epoch, the batches handed out of it, and the
global random generators' state as plain JSON.

Why these two: a loader's epoch draws from them and from nothing else of the process's state -- a dataset's
shuffle from numpy's global generator (as ``paddle.io.BatchSampler`` does), its workers' seeds from Python's,
and a user's generator from either. Restored as they were when the epoch opened, the epoch opens to the same
batches in the same order, whatever the process did before (a restarted one skipped the epochs before).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .._paddle import np


@dataclass(frozen=True)
class Position:
    """Where a process's data stood: in its ``epoch`` (0: the first), after ``batches`` batches; ``ended``:
    the epoch had been read to its end; ``random``: numpy's and Python's generators as the epoch opened (as
    they were at its end, once ended), or None where the loader did not say (only the count is restored)."""

    epoch: int
    batches: int
    ended: bool
    random: dict[str, Any] | None

    @classmethod
    def from_json(cls, data: Any, where: str) -> Position:
        """The position ``data`` (a checkpoint's JSON) describes; ``ValueError`` naming ``where`` if it is none."""
        try:
            position = cls(**data)
        except TypeError:
            position = None
        if position is None or not all(type(v) is int and v >= 0 for v in (position.epoch, position.batches)) \
                or type(position.ended) is not bool or not isinstance(position.random, (dict, type(None))):
            raise ValueError(f"{where}: {data!r} is not a data position (epoch, batches, ended, random)")
        return position


def random_state() -> dict[str, Any]:
    """numpy's and Python's global generators' state, as JSON values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "python": [version, list(internal), gauss_next]}


def set_random_state(state: dict[str, Any]) -> None:
    """Put back what ``random_state`` gave."""
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
