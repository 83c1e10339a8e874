"""Schedules as data: per-rank action lists, their generators, lowering, validation and simulation.

Pure Python on purpose (no Paddle): a schedule can be generated, checked, simulated and drawn anywhere,
and the runtime only ever executes the lowered lists.
"""
from __future__ import annotations

from .actions import (Action, Kind, Schedule, format_schedule, parse_action, parse_schedule, schedule_from_json,
                      schedule_to_json)
from .dualpipe import dualpipe_v
from .execution import ScheduleError
from .gpipe import f_then_b
from .interleaved import interleaved
from .lowering import lower
from .one_f_one_b import eager_one_f_one_b, one_f_one_b
from .registry import (ALIASES, KINDS, ScheduleKind, canonical_name, check_chunks, check_microbatches, get_kind,
                       make_schedule)
from .simulate import Simulation, simulate
from .v_shape import v_half, v_min
from .validate import validate
from .zero_bubble import zb_2p, zb_h1, zb_v

__all__ = ["Action", "Kind", "Schedule", "ScheduleKind", "ScheduleError", "Simulation", "KINDS", "ALIASES",
           "canonical_name", "get_kind", "make_schedule", "check_microbatches", "check_chunks", "lower",
           "validate", "simulate", "format_schedule", "parse_action", "parse_schedule", "schedule_to_json",
           "schedule_from_json", "f_then_b", "one_f_one_b", "interleaved", "zb_h1", "zb_v", "v_min", "v_half",
           "zb_2p", "eager_one_f_one_b", "dualpipe_v"]
