"""Schedules as data: functions that return per-stage action lists, and their registry."""
from __future__ import annotations

from typing import Callable

from .actions import Action, Kind, Schedule, format_schedule
from .gpipe import f_then_b
from .lowering import lower
from .one_f_one_b import one_f_one_b

SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "F-then-B": f_then_b,
    "FThenB": f_then_b,
    "GPipe": f_then_b,
    "1F1B": one_f_one_b,
}


def canonical_name(name: str) -> str:
    """The registered spelling of ``name``; ``ValueError`` listing the known schedules otherwise."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    return "F-then-B" if SCHEDULES[name] is f_then_b else name


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The compute action lists of schedule ``name`` for ``num_stages`` x ``num_microbatches``."""
    check_microbatches(num_microbatches)
    return SCHEDULES[canonical_name(name)](num_stages, num_microbatches)


def check_microbatches(num_microbatches: object) -> int:
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    return num_microbatches


__all__ = ["Action", "Kind", "Schedule", "SCHEDULES", "canonical_name", "make_schedule", "lower",
           "format_schedule", "f_then_b", "one_f_one_b", "check_microbatches"]
