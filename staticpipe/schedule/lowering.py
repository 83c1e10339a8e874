"""Lowering: insert the SEND and RECV actions a compute schedule needs, from the plan's routes.

A RECV goes right before the compute action (F or B) of the route's destination section, a SEND right
after the one of its source section; W and OPT move no cut variables. Routes are matched on the
action's own stage, not the rank it runs on, so several stages per rank lower the same way (a route
between two stages of one rank becomes a SEND and a RECV on that rank). Sends never block, so this
cannot deadlock for a schedule whose compute order respects each micro-batch's path
F0 < F1 < ... < B1 < B0; ``validate`` checks that with a dry run. An FB (a paired F and B) gets the
RECVs of both halves before it and the SENDs of both after it, as DualPipe posts them around its
overlapped pair: a device can then overlap the pair's messages with each other.
"""
from __future__ import annotations

from typing import Iterable, Protocol

from ..gc_paused import gc_paused
from .actions import COMPUTE_KINDS, Action, Kind, Schedule

_SECTION_OF = {Kind.F: "forward", Kind.B: "backward"}


class SectionLike(Protocol):  # plan.SectionRef, without importing the plan
    stage: int
    kind: str


class RouteLike(Protocol):  # plan.Route
    index: int

    @property
    def channel(self) -> str: ...

    @property
    def src(self) -> SectionLike: ...

    @property
    def dst(self) -> SectionLike: ...


@gc_paused()
def lower(schedule: Schedule, routes: Iterable[RouteLike]) -> Schedule:
    """``schedule`` (rank -> compute actions) with the SEND/RECV actions of ``routes`` added."""
    routes = list(routes)
    for r in routes:
        if {r.src.kind, r.dst.kind} - set(_SECTION_OF.values()):
            raise ValueError(f"route {r.index} ({r.src} -> {r.dst}): schedules move cut variables only between "
                             "forward and backward sections")
    lowered: Schedule = {}
    for rank, actions in schedule.items():
        out: list[Action] = []
        for a in actions:
            halves = [h for h in a.halves() if h.kind in COMPUTE_KINDS]
            out += [Action(Kind.RECV, h.stage, h.microbatch, r.index, r.src.stage, r.channel)
                    for h in halves for r in routes if r.dst.stage == h.stage and r.dst.kind == _SECTION_OF[h.kind]]
            out.append(a)
            out += [Action(Kind.SEND, h.stage, h.microbatch, r.index, r.dst.stage, r.channel)
                    for h in halves for r in routes if r.src.stage == h.stage and r.src.kind == _SECTION_OF[h.kind]]
        lowered[rank] = out
    return lowered
