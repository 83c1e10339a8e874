"""``simulate``: the timeline a schedule would have if each action cost exactly what you say.

It answers what a schedule is worth before running it (bubble, step time, activations held) and,
fed the per-action times measured by the runtime, how far a real step is from the schedule's own bound.
Each rank runs its list in order, every action as early as its dependency allows (see ``execution``).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import accumulate, chain, compress, repeat
from operator import attrgetter, is_, itemgetter, ne
from typing import Callable, Collection, Iterable, Mapping, Sequence

from ..gc_paused import gc_paused
from .actions import Action, Kind, Schedule
from .execution import BUSY_KINDS, Columns, Event, Timeline, columns_of, timeline
from .latency import Comm, is_seconds, link_latency
from .shared_cores import execute_shared

UNIT_COSTS = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0, Kind.OPT: 0.0, Kind.SEND: 0.0, Kind.RECV: 0.0}

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
    table = _cost_table(costs)
    return lambda a: table[a.kind]


def _cost_table(costs: None | Mapping[str, float]) -> dict[Kind, float]:
    """What each kind costs, for ``cost_function`` of anything but a callable."""
    table = dict(UNIT_COSTS)
    for kind, seconds in (costs or {}).items():
        if kind not in Kind.__members__:
            raise ValueError(f"unknown action kind {kind!r} in costs; kinds: {', '.join(k.value for k in Kind)}")
        table[Kind(kind)] = float(seconds)
    table.setdefault(Kind.FB, table[Kind.F] + table[Kind.B])
    return table


@gc_paused()
def simulate(schedule: Schedule, costs: Costs = None, num_stages: int | None = None, *, cores: float | None = None,
             sharing: Collection[int] | None = None, collectives: bool = False, comm: Comm = None) -> Simulation:
    """Simulate a compute-only or lowered schedule. ``num_stages`` defaults to the highest stage + 1.

    Without W actions, B is the whole backward: price it so (e.g. {"B": 2}) to compare with a
    split-backward schedule at F = B = W = 1. ``ScheduleError`` if the schedule deadlocks.
    ``cores``: the ranks in ``sharing`` (default: all) share this many processors (``shared_cores``:
    CPU stage threads on one machine); None: every rank has its own. ``collectives``: no rank starts
    its first OPT before every rank has reached it (the runtime's step barrier). ``comm``: the latency of a
    message between two ranks (``latency.link_latency``: seconds, per link, or a function of the two
    ranks), time in flight that occupies no rank; None or 0: messages are free.
    """
    latency = link_latency(comm)
    stages: set[int] = set()
    columns: dict[int, Columns] = {}
    for r, acts in schedule.items():
        stages.update(map(attrgetter("stage"), acts))
        columns[r] = columns_of(acts)  # for the walk and the peaks, while the rank's actions are in cache
    num_stages = num_stages if num_stages is not None else max(stages, default=-1) + 1
    table = None if callable(costs) else _cost_table(costs)
    walked = timeline(schedule, num_stages, costs if table is None else table, collectives, columns, latency)
    if cores is None:
        busy = walked.busy
        spans, events = _walked(schedule, walked)
    else:
        produced = execute_shared(schedule, num_stages, cost_function(costs), cores,
                                  set(schedule) if sharing is None else set(sharing), collectives, latency)
        busy, spans = _rank_times(schedule, produced)
        starts = list(map(itemgetter(2), produced))
        events = _by_start(sorted(produced, key=itemgetter(0)), lambda: produced, any(map(ne, starts, starts)))
    total = max((last for _, last in spans.values()), default=0.0)
    bubble = 1.0 - sum(busy.values()) / (len(schedule) * total) if total > 0 else 0.0
    span = max((last - first for first, last in spans.values()), default=0.0)
    span_bubble = 1.0 - sum(busy.values()) / (len(schedule) * span) if span > 0 else 0.0
    return Simulation(events, total, busy, bubble, _peaks(list(columns.values())), span_bubble)


def _rank_times(schedule: Schedule, events: list[Event]) -> tuple[dict[int, float], dict[int, tuple[float, float]]]:
    """Per rank, the time in ``BUSY_KINDS`` (added up in list order) and (first start, last end), the
    latter in the order ranks first appear in ``events`` (what ``max`` keeps of equal ends depends on it)."""
    busy = dict.fromkeys(schedule, 0.0)
    spans: dict[int, tuple[float, float]] = {}
    for rank, a, s, e in events:
        if a[0] in BUSY_KINDS:
            busy[rank] += e - s
        spans[rank] = (spans[rank][0] if rank in spans else s, e)
    return busy, spans


def _walked(schedule: Schedule, walked: Timeline) -> tuple[dict[int, tuple[float, float]], list[Event]]:
    """``_rank_times``'s spans, and the events by start, from a ``timeline``: the events are made at the
    end, a rank at a time (in C), rather than one at a time in the walk."""
    times, visits, ranks = walked.times, walked.visits, sorted(schedule)
    spans = {r: (times[r][0][0], times[r][1][-1]) for r in dict.fromkeys(map(itemgetter(0), visits))}
    by_rank = list(chain.from_iterable(zip(repeat(r), schedule[r], *times[r]) for r in ranks))

    def produced() -> list[Event]:  # as the walk made them, visit after visit
        at = dict(zip(ranks, accumulate((len(schedule[r]) for r in ranks), initial=0)))
        return [by_rank[k] for r, i, j in visits for k in range(at[r] + i, at[r] + j)]
    return spans, _by_start(by_rank, produced, walked.nan_start)


def _by_start(by_rank: list[Event], produced: Callable[[], list[Event]], nan_start: bool) -> list[Event]:
    """The events by start time, then rank, each rank's in list order. ``by_rank`` has them in rank order,
    each rank's in list order: sorting it (stably) by start alone gives that order, in a quarter of the
    time of a sort by both (tuple keys). Unless a start is NaN, which orders nothing: then the events as
    they were ``produced`` are sorted by both, as they always were."""
    if nan_start:
        events = produced()
        events.sort(key=itemgetter(2, 0))
        return events
    by_rank.sort(key=itemgetter(2))
    return by_rank


def peak_inflight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most micro-batches whose F has run and whose last backward action (W if the
    backward is split, else B) has not: the activations the stage must hold at once. Counted along each
    rank's list as ``inflight_counts`` does; a count only grows at an F."""
    return _peaks(list(map(columns_of, schedule.values())))


def _peaks(columns: list[Columns]) -> dict[int, int]:
    """``peak_inflight`` of the ranks' ``columns_of``."""
    last, f, fb = _last_backward(kinds for kinds, *_ in columns), Kind.F, Kind.FB
    peak: dict[int, int] = {}
    for kinds, stages, mbs, b_stages, b_mbs in columns:
        live: defaultdict[int, set[int]] = defaultdict(set)  # stage -> micro-batches held
        top: defaultdict[int, int] = defaultdict(int)  # stage -> most held at once, on this rank
        for kind, s, mb, s2, mb2 in zip(kinds, stages, mbs, b_stages, b_mbs):
            if kind is f or kind is fb:  # an FB: its F half, then its B half
                held = live[s]
                held.add(mb)
                if len(held) > top[s]:
                    top[s] = len(held)
                if kind is fb and last is Kind.B:
                    live[s2].discard(mb2)
            elif kind is last:
                live[s].discard(mb)
        for stage in dict.fromkeys(chain(stages, compress(b_stages, map(is_, kinds, repeat(fb))))):
            peak[stage] = max(peak.get(stage, 0), top.get(stage, 0))
    try:
        return dict(sorted(peak.items()))
    except TypeError:  # stages that do not compare: fail as counting along the lists did, meeting them in order
        met = (h for kinds, stages, _, b_stages, _ in columns for k, s, s2 in zip(kinds, stages, b_stages)
               for h in ((s, s2) if k is fb else (s,)))
        return dict(sorted((stage, peak[stage]) for stage in dict.fromkeys(met)))


def _last_backward(kinds: Iterable[list[Kind]]) -> Kind:
    """W if the schedule (each rank's kinds) splits the backward (an FB's halves are an F and a B), else B."""
    return Kind.W if any(any(map(is_, k, repeat(Kind.W))) for k in kinds) else Kind.B


def inflight_counts(schedule: Schedule) -> dict[int, list[dict[int, int]]]:
    """Per rank, after each of its actions, how many micro-batches each of its stages holds between F and
    the last backward action (what a rank holding several stages holds at once: ``memory_model.py``). A
    stage's actions all run on one rank in list order, so counting along the list is exact (an FB as its
    F, then its B)."""
    last = _last_backward(list(map(itemgetter(0), acts)) for acts in schedule.values())
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
        if not values or not all(map(is_seconds, values)):
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

