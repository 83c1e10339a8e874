"""``simulate``: the timeline a schedule would have if each action cost exactly what you say.

It answers what a schedule is worth before running it (bubble, step time, activations held) and,
fed the per-action times measured by the runtime, how far a real step is from the schedule's own bound.
Each rank runs its list in order, every action as early as its dependency allows (see ``execution``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Collection, Mapping, Sequence

from ..gc_paused import gc_paused
from .actions import Action, Kind, Schedule
from .execution import Event, execute
from .shared_cores import execute_shared

UNIT_COSTS = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0, Kind.OPT: 0.0, Kind.SEND: 0.0, Kind.RECV: 0.0}
BUSY_KINDS = (Kind.F, Kind.B, Kind.W, Kind.OPT, Kind.FB)  # compute; messages are not useful work

Costs = None | Mapping[str, float] | Callable[[Action], float]


@dataclass
class Simulation:
    events: list[Event]  # (rank, action, start, end), by start time
    total: float  # the end of the last action (every rank starts at 0)
    busy: dict[int, float]  # rank -> time spent in compute actions
    bubble: float  # 1 - sum(busy) / (ranks x total): the fraction of rank-time left idle
    peak_inflight: dict[int, int]  # stage -> most micro-batches between their F and their last backward
    # 1 - sum(busy) / (ranks x the longest rank span, from a rank's first start to its last end): the idle
    # time when steps follow each other with no barrier, each rank starting its next step as soon as it is
    # done -- the bubble the zero-bubble papers report (ZB-2P's 0), which leaves out the fill that
    # ``bubble`` counts once per step (a rank that starts late also ends late)
    span_bubble: float


def cost_function(costs: Costs) -> Callable[[Action], float]:
    """``costs`` as a function of the action: None is unit costs (F = B = W = 1, OPT and messages 0), a
    mapping overrides some kinds ({"F": 1, "B": 2}), a callable prices each action (measured times). An
    FB costs its F plus its B (run back to back) unless the mapping prices "FB" itself (overlapped)."""
    if callable(costs):
        return costs
    table = dict(UNIT_COSTS)
    for kind, seconds in (costs or {}).items():
        if kind not in Kind.__members__:
            raise ValueError(f"unknown action kind {kind!r} in costs; kinds: {', '.join(k.value for k in Kind)}")
        table[Kind(kind)] = float(seconds)
    table.setdefault(Kind.FB, table[Kind.F] + table[Kind.B])
    return lambda a: table[a.kind]


@gc_paused()
def simulate(schedule: Schedule, costs: Costs = None, num_stages: int | None = None, *, cores: float | None = None,
             sharing: Collection[int] | None = None, collectives: bool = False) -> Simulation:
    """Simulate a compute-only or lowered schedule. ``num_stages`` defaults to the highest stage + 1.

    Without W actions, B is the whole backward: price it so (e.g. {"B": 2}) to compare with a
    split-backward schedule at F = B = W = 1. ``ScheduleError`` if the schedule deadlocks.
    ``cores``: the ranks in ``sharing`` (default: all) share this many processors (``shared_cores``:
    CPU stage threads on one machine); None: every rank has its own. ``collectives``: no rank starts
    its first OPT before every rank has reached it (the runtime's step barrier).
    """
    stages = {a.stage for acts in schedule.values() for a in acts}
    num_stages = num_stages if num_stages is not None else max(stages, default=-1) + 1
    duration = cost_function(costs)
    events = execute(schedule, num_stages, duration, collectives)
    if cores is not None:
        events = execute_shared(schedule, num_stages, duration, cores,
                                set(schedule) if sharing is None else set(sharing), collectives)
    busy = dict.fromkeys(schedule, 0.0)
    spans: dict[int, list[float]] = {}  # rank -> [first start, last end]: a rank's events are in list order
    for rank, a, s, e in events:
        if a[0] in BUSY_KINDS:
            busy[rank] += e - s
        span = spans.get(rank)
        if span is None:
            spans[rank] = [s, e]
        else:
            span[1] = e
    events.sort(key=itemgetter(2, 0))  # by start time, then rank; a rank's list order is kept
    total = max((last for _, last in spans.values()), default=0.0)
    bubble = 1.0 - sum(busy.values()) / (len(schedule) * total) if total > 0 else 0.0
    span = max((last - first for first, last in spans.values()), default=0.0)
    span_bubble = 1.0 - sum(busy.values()) / (len(schedule) * span) if span > 0 else 0.0
    return Simulation(events, total, busy, bubble, peak_inflight(schedule), span_bubble)


def peak_inflight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most micro-batches whose F has run and whose last backward action (W if the
    backward is split, else B) has not: the activations the stage must hold at once. Counted along each
    rank's list as ``inflight_counts`` does; a count only grows at an F."""
    last, f = _last_backward(schedule), Kind.F
    peak: dict[int, int] = {}
    for acts in schedule.values():
        live: dict[int, set[int]] = {}
        for a in acts:
            for h in (a.halves() if a[0] is Kind.FB else (a,)):
                kind, stage, mb = h[:3]
                held = live.get(stage)
                if held is None:
                    held = live[stage] = set()
                    peak.setdefault(stage, 0)
                if kind is f:
                    held.add(mb)
                    if len(held) > peak[stage]:
                        peak[stage] = len(held)
                elif kind is last:
                    held.discard(mb)
    return dict(sorted(peak.items()))


def _last_backward(schedule: Schedule) -> Kind:
    """W if the schedule splits the backward (an FB's halves are an F and a B), else B."""
    return Kind.W if any(a[0] is Kind.W for acts in schedule.values() for a in acts) else Kind.B


def inflight_counts(schedule: Schedule) -> dict[int, list[dict[int, int]]]:
    """Per rank, after each of its actions, how many micro-batches each of its stages holds between F and
    the last backward action (what a rank holding several stages holds at once: ``memory_model.py``). A
    stage's actions all run on one rank in list order, so counting along the list is exact (an FB as its
    F, then its B)."""
    last = _last_backward(schedule)
    out: dict[int, list[dict[int, int]]] = {}
    for rank, acts in schedule.items():
        live: dict[int, set[int]] = {}
        seen = out.setdefault(rank, [])
        for a in (h for b in acts for h in b.halves()):
            held = live.setdefault(a.stage, set())
            if a.kind is Kind.F:
                held.add(a.microbatch)
            elif a.kind is last:
                held.discard(a.microbatch)
            seen.append({stage: len(mbs) for stage, mbs in live.items()})
    return out


PLANNED_KINDS = (Kind.F, Kind.B, Kind.W)  # what a cost-aware generator prices; it places OPT last anyway

StageCosts = Mapping[str, float | Sequence[float]] | Callable[[Action], float]


def stage_cost_function(costs: StageCosts, num_stages: int | None = None,
                        name: str = "costs") -> Callable[[Action], float]:
    """``costs`` for a generator to plan with, checked, as a function of the action.

    A mapping gives each of F, B, W one duration for every stage or a list of one per stage
    (``Timeline.stage_costs()``: measured stages differ, and that is what the plan must know); kinds
    left out cost 1. A callable is used as it is. Errors name ``name``, the kind and the value at
    fault; the lists' length is checked once ``num_stages`` is known. An FB costs its F plus its B.
    """
    if callable(costs):
        return costs
    if not isinstance(costs, Mapping):
        raise ValueError(f"{name} must be a mapping such as {{'F': 1, 'B': 1, 'W': 0.5}} or a function of the "
                         f"action, got {costs!r}")
    per_stage: dict[Kind, list[float]] = {}
    for kind, value in costs.items():
        if kind not in PLANNED_KINDS:
            raise ValueError(f"unknown action kind {kind!r} in {name}; kinds: "
                             f"{', '.join(k.value for k in PLANNED_KINDS)}")
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values or not all(map(_is_duration, values)):
            raise ValueError(f"{name}[{kind!r}] must be seconds >= 0, or a list of them (one per stage); got {value!r}")
        if isinstance(value, (list, tuple)):
            if num_stages is not None and len(values) != num_stages:
                raise ValueError(f"{name}[{kind!r}] has {len(values)} values for {num_stages} stages: {value!r}")
            per_stage[Kind(kind)] = [float(v) for v in values]
    same = cost_function({k: v for k, v in costs.items() if Kind(k) not in per_stage})

    def price(a: Action) -> float:
        if a.kind is Kind.FB:
            return sum(map(price, a.halves()))
        return per_stage[a.kind][a.stage] if a.kind in per_stage else same(a)
    return price


def _is_duration(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
