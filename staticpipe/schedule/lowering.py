"""Lowering: insert the SEND and RECV actions a compute schedule needs, from the plan's routes.

A RECV goes right before the compute action that reads the route, a SEND right after the one that
produces it. Sends never block in-process, so this order cannot deadlock for a schedule whose compute
order respects each micro-batch's path F0 < F1 < ... < B1 < B0.
"""
from __future__ import annotations

from typing import Iterable, Protocol

from .actions import COMPUTE_KINDS, Action, Kind, Schedule

_SECTION_OF = {Kind.F: "forward", Kind.B: "backward"}


class RouteLike(Protocol):  # plan.Route, without importing the plan
    index: int
    channel: str

    @property
    def src(self): ...

    @property
    def dst(self): ...


def lower(schedule: Schedule, routes: Iterable[RouteLike]) -> Schedule:
    routes = list(routes)
    lowered: Schedule = {}
    for stage, actions in schedule.items():
        out: list[Action] = []
        for a in actions:
            if a.kind not in COMPUTE_KINDS:
                out.append(a)
                continue
            section = _SECTION_OF[a.kind]
            out += [Action(Kind.RECV, stage, a.microbatch, r.index, r.src.stage, r.channel)
                    for r in routes if r.dst.stage == stage and r.dst.kind == section]
            out.append(a)
            out += [Action(Kind.SEND, stage, a.microbatch, r.index, r.dst.stage, r.channel)
                    for r in routes if r.src.stage == stage and r.src.kind == section]
        lowered[stage] = out
    return lowered
