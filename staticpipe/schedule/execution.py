"""Running a schedule on paper: the one dry run that both ``validate`` and ``simulate`` rely on.

Every rank works through its list in order, starting each action as soon as the previous one on the
rank has ended and its dependency is met:

- a RECV waits for the SEND of the same route and micro-batch (SENDs never block, as in the runtime);
- in a compute-only schedule (no SEND/RECV yet), F on stage s waits for F on s - 1, B on s for B on
  s + 1, and the last stage's B for its own F -- the messages lowering would add;
- W waits for the B of its stage and micro-batch;
- an FB (a paired F and B) waits for what each of its halves waits for, and counts as both once done;
- with ``collectives``, OPTs are a barrier: no rank starts one until every rank has reached its first
  OPT, because the optimize sections then hold all-reduces every rank must join.

Start times follow from these rules alone, not from the order ranks are visited, so the same pass
gives the simulator's timeline and the validator's deadlock check: when no rank can move before all
are done, the ranks wait on each other forever.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from itertools import chain
from operator import itemgetter
from typing import Callable, Iterable, NamedTuple

from .actions import Action, Kind, Schedule
from .latency import Latency, stage_lags

Event = tuple[int, Action, float, float]  # (rank, action, start, end)
BUSY_KINDS = (Kind.F, Kind.B, Kind.W, Kind.OPT, Kind.FB)  # compute; messages are not useful work


class ScheduleError(ValueError):
    """A schedule that cannot run; ``rank``, ``step`` and ``action`` locate it where one action is at fault."""

    def __init__(self, message: str, rank: int | None = None, step: int | None = None,
                 action: Action | None = None):
        super().__init__(message)
        self.rank, self.step, self.action = rank, step, action


def fail(rank: int, step: int, action: Action, problem: str) -> ScheduleError:
    return ScheduleError(f"rank {rank}, step {step}, action {action}: {problem}", rank, step, action)


def _dependencies(a: Action, num_stages: int, lowered: bool) -> list[tuple]:
    """The actions ``a`` waits for, other than the previous one on its rank (RECV and OPT aside), as their
    ``Action.key``s."""
    return [d for h in a.halves() if (d := _dependency(h, num_stages, lowered)) is not None]


def _dependency(a: Action, num_stages: int, lowered: bool) -> tuple | None:
    kind, stage, mb = a[:3]
    if kind is Kind.W:
        return Kind.B, stage, mb
    if kind is Kind.B and stage == num_stages - 1:
        return Kind.F, stage, mb
    if lowered:
        return None
    if kind is Kind.F and stage > 0:
        return Kind.F, stage - 1, mb
    if kind is Kind.B:
        return Kind.B, stage + 1, mb
    return None


def is_lowered(schedule: Schedule) -> bool:
    """Whether the schedule has its SEND/RECV actions (then F and B wait for messages, not actions)."""
    return _has_messages(map(_kinds, schedule.values()))


def _has_messages(kinds: Iterable[list[Kind]]) -> bool:
    return any(Kind.SEND in k or Kind.RECV in k for k in kinds)


def _kinds(actions: list[Action]) -> list[Kind]:
    return list(map(itemgetter(0), actions))  # a C-level pass: schedules at scale hold 10^5-10^6 actions


def first_opt_step(actions: list[Action]) -> int:
    """The step of the rank's first OPT, or the length of its list."""
    return _first_opt(_kinds(actions))


def _first_opt(kinds: list[Kind]) -> int:
    return kinds.index(Kind.OPT) if Kind.OPT in kinds else len(kinds)


def _awaited_send(recv: Action) -> str:
    return f"{recv.peer}SEND_{recv.channel}{recv.microbatch}>{recv.stage} on route {recv.route}"


Columns = tuple[list, ...]
_FIELDS = tuple(itemgetter(k) for k in (0, 1, 2, 6, 7))


def columns_of(actions: list[Action]) -> Columns:
    """The fields of a rank's actions that the walk reads -- kinds, stages, micro-batches, and an FB's B
    half's stage and micro-batch -- a list each, each made by a pass in C.

    Why: at scale a schedule's actions lie all over memory, and going to each one is a cache miss. A
    caller that has just gone over a rank's actions makes these while they are in cache; the walk
    then reads lists, and goes to an action only to price it with a function or to report it."""
    return tuple(list(map(field, actions)) for field in _FIELDS)


class Timeline(NamedTuple):
    """The walk's times, and what ``simulate`` adds up, taken as the walk goes: there each action's
    times are at hand, where a pass after it would fetch them from all over memory at scale."""
    times: dict[int, tuple[list[float], list[float]]]  # rank -> the starts and the ends of its actions
    busy: dict[int, float]  # rank -> its time in BUSY_KINDS, added up in list order
    # (rank, first step, step after the last) of each visit that ran actions, in the walk's order: where
    # the ranks first appear, and the order events with a NaN start are sorted from
    visits: list[tuple[int, int, int]]
    nan_start: bool  # whether an action starts at NaN (which leaves events sorted by start to that order)


def timeline(schedule: Schedule, num_stages: int, duration: Callable[[Action], float] | dict[Kind, float] | None,
             collectives: bool = False, columns: dict[int, Columns] | None = None,
             latency: Latency | None = None) -> Timeline:
    """The dry run: every action's start and end (``times``: per rank, in list order); ``ScheduleError``
    on a deadlock, a message sent twice, received twice, received by the wrong stage, or never received.
    ``duration`` prices an action; it may be a table of what each kind costs, looked up
    without a call per action, or None: nothing is timed (``validate``'s dry run, which only needs the
    errors; ``times`` is then None). ``columns``: each rank's ``columns_of``, made here if not given.
    ``latency`` (``latency.py``): a message between two ranks arrives that long after it left -- an F or B
    waits for its input's end plus its link's latency (``f_lag``/``b_lag`` per stage), a RECV for its SEND's
    start plus it (and never before the SEND's end) -- occupying no rank; None: messages are free.

    Ranks are visited in turns, in rank order, each running as far as it can. A blocked rank is not
    looked at again until what it waits for is done: then in this turn if its place comes later, else
    in the next -- exactly where visiting every rank every turn would find it ready, without the
    visits that find it still blocked (thousands of turns at 64 ranks). Which message error comes
    first depends on this order (and, with NaN costs, which arrival at the OPT barrier counts as the
    latest), so it is kept.

    The loop runs once per action of schedules with hundreds of thousands, so it is written out, not
    factored, and ``_dependency``'s rule is inline. What an action waits for is an F or a B:
    ``ends[kind]`` holds, per stage, a table micro-batch -> its end once done, or -> the ranks waiting
    for it until then. A table per stage, not one keyed by (kind, stage, micro-batch): a key tuple
    made, hashed and kept per action, and lookups all over a table of them all, were half the walk's
    time at scale (it no longer fits a cache). W and OPT are what no action waits for: not kept. An FB
    looks up its F half's dependency first, into ``floor``: its B half's end counts only above it (the
    later of the two). ``arrive`` gives a RECV's or a barrier OPT's start, also into ``floor``."""
    timed, by_kind = duration is not None, duration if isinstance(duration, dict) else None
    if columns is None:
        columns = {r: columns_of(acts) for r, acts in schedule.items()}
    lowered = _has_messages(c[0] for c in columns.values())
    # stage -> rank, a pass over every action: only with a latency (without, every lag is 0.0)
    rank_of = {s: r for r, c in columns.items() for s in chain(c[1], (x for x in c[3] if x is not None))
               } if latency is not None else {}
    f_lag, b_lag = stage_lags(rank_of, num_stages, None if lowered else latency)
    ranks = sorted(schedule)
    first_opt = {r: _first_opt(columns[r][0]) for r in ranks}
    times = {r: ([0.0] * len(schedule[r]), [0.0] * len(schedule[r])) for r in ranks} if timed else None
    # rank -> [actions, their columns, their starts and ends, their number, the next step, its clock,
    # the step at which it reaches its OPT, its busy time]
    state = {r: [schedule[r], *columns[r], *(times[r] if timed else ((), ())), len(schedule[r]), 0, 0.0,
                 first_opt[r] - 1, 0.0] for r in ranks}
    f, b, w, fb, opt, send, recv = Kind.F, Kind.B, Kind.W, Kind.FB, Kind.OPT, Kind.SEND, Kind.RECV
    ends: dict[Kind, defaultdict] = {f: defaultdict(dict), b: defaultdict(dict)}  # kind -> stage -> table
    done_f, done_b = ends[f], ends[b]
    sent: dict[tuple, tuple[int, int, Action]] = {}  # (route, micro-batch) -> rank, step, SEND
    sent_at: dict[tuple, float] = {}  # (route, micro-batch) -> end of its SEND
    received: set[tuple] = set()
    reached: dict[int, float] = {r: 0.0 for r in ranks if first_opt[r] == 0}  # rank -> when it reached its first OPT
    waiting: dict[tuple, list[int]] = {}  # a message or the barrier -> the ranks waiting for it
    visits: list[tuple[int, int, int]] = []
    visited, last = visits.append, num_stages - 1
    this_turn = [r for r in ranks if schedule[r]]  # a heap, but in order already
    next_turn: list[int] = []
    heappop, heappush, later = heapq.heappop, heapq.heappush, next_turn.append

    def wake(waiters: list[int], r: int) -> None:
        for q in waiters:
            if q > r:
                heappush(this_turn, q)
            else:
                later(q)

    def arrive(r: int, i: int, a: Action) -> float | None:
        """When a RECV or an OPT at the barrier may start; None (and ``r`` waiting) if not yet. The only
        start that can be NaN (any other is at least 0.0 or an end above it): noted."""
        nonlocal nan_start
        if a[0] is opt:
            if len(reached) < len(ranks):
                waiting.setdefault((opt,), []).append(r)
                return None
            ready = max(reached.values())
        else:
            key = (a[3], a[2])
            if key in sent:
                _check_receive(r, i, a, sent[key], key in received)
            ready = sent_at.get(key)
            if ready is None:
                waiting.setdefault((send, key), []).append(r)
                return None
            received.add(key)
        nan_start = nan_start or ready != ready
        return ready

    def leave(r: int, i: int, a: Action, t: float, start: float) -> None:
        """A SEND that started at ``start`` ends at ``t``: the RECV may start at the later of ``t`` and the
        start plus the link's latency."""
        key = (a[3], a[2])
        if key in sent:
            q, j, first_send = sent[key]
            raise fail(r, i, a, f"route {a.route}, micro-batch {a.microbatch} is sent twice "
                                f"(also by rank {q}, step {j}, action {first_send})")
        sent[key] = (r, i, a)
        if latency is not None and a.peer in rank_of:
            t = max(t, start + latency(r, rank_of[a.peer]))
        sent_at[key] = t
        wake(waiting.pop((send, key), ()), r)

    def finish(tab: dict, mb: int, t: float, r: int) -> None:
        """Record that the action of ``tab``'s stage and micro-batch ``mb`` ended at ``t``."""
        x = tab.setdefault(mb, t)
        if x is not t:  # ranks were waiting (or, unchecked, it ran before)
            tab[mb] = t
            if type(x) is list:
                wake(x, r)

    floor, idle, nan_start = 0.0, False, False  # idle: the action is not in BUSY_KINDS
    while this_turn:
        while this_turn:
            r = heappop(this_turn)
            st = state[r]
            acts, kinds, stages, mbs, b_stages, b_mbs, begun, ended, n, i0, t, reach, spent = st
            for i in range(i0, n):
                kind, s, mb = kinds[i], stages[i], mbs[i]
                if kind is f:
                    dep, own, lag = None if lowered or s == 0 else done_f[s - 1], done_f, f_lag[s]
                elif kind is b:
                    dep, own = done_f[s] if s == last else None if lowered else done_b[s + 1], done_b
                    lag = b_lag[s]  # 0.0 on the last stage: its B waits for its own F
                elif kind is w:
                    dep, own, lag = done_b[s], None, 0.0
                elif kind is fb:  # its F half's dependency into floor, then its B half's as any other
                    s2, mb2 = b_stages[i], b_mbs[i]
                    before = None if lowered or not s > 0 else done_f[s - 1]
                    dep, own = done_f[s2] if s2 == last else None if lowered else done_b[s2 + 1], None
                    lag = b_lag[s2]
                    if before is not None:
                        floor = before.get(mb)
                        if floor is None or type(floor) is list:
                            if floor is None:
                                before[mb] = [r]
                            else:
                                floor.append(r)
                            floor = 0.0
                            break
                        floor += f_lag[s]
                        if not floor > 0.0:
                            floor = 0.0
                    mb, mb2 = mb2, mb  # the lookup below is the B half's
                elif kind is opt or kind is send or kind is recv:
                    dep = own = None
                    lag = 0.0
                    if kind is recv or (kind is opt and collectives):
                        floor = arrive(r, i, acts[i])
                        if floor is None:
                            floor = 0.0
                            break
                    idle = kind is not opt
                else:  # a kind not of Kind waits as a B would, and counts as the F or B it may equal
                    dep, own, lag = None if lowered else done_b[s + 1], ends.get(kind), 0.0
                    idle = kind not in BUSY_KINDS
                if dep is None:
                    ready = floor
                else:
                    ready = dep.get(mb)
                    if type(ready) is not float and (ready is None or type(ready) is list):  # not done yet
                        if ready is None:
                            dep[mb] = [r]
                        else:
                            ready.append(r)
                        floor, idle = 0.0, False
                        break
                    if lag:
                        ready += lag
                    if not ready > floor:
                        ready = floor
                if timed:
                    begun[i] = start = t if t > ready else ready
                    ended[i] = t = start + (duration(acts[i]) if by_kind is None else by_kind[kind])
                    if idle:
                        idle = False
                    else:
                        spent = spent + (t - start)
                if own is not None:  # as ``finish``
                    tab = own[s]
                    x = tab.setdefault(mb, t)
                    if x is not t:
                        tab[mb] = t
                        if type(x) is list:
                            for q in x:
                                if q > r:
                                    heappush(this_turn, q)
                                else:
                                    later(q)
                elif kind is fb:
                    finish(done_f[s], mb2, t, r)
                    finish(done_b[s2], mb, t, r)
                    floor = 0.0
                elif kind is send:
                    leave(r, i, acts[i], t, begun[i] if timed else t)
                else:
                    floor = 0.0
                if i == reach:
                    reached[r] = t
                    if len(reached) == len(ranks):
                        wake(waiting.pop((opt,), ()), r)
            else:
                i = n
            st[9], st[10], st[12] = i, t, spent
            if timed and i > i0:
                visited((r, i0, i))
        this_turn = sorted(set(next_turn))
        next_turn.clear()
    ptr = {r: state[r][9] for r in ranks}
    if any(ptr[r] < len(schedule[r]) for r in ranks):
        def is_done(key: tuple) -> bool:
            end = ends[key[0]].get(key[1], {}).get(key[2])
            return end is not None and type(end) is not list
        raise _deadlock(schedule, ranks, ptr, first_opt, is_done, num_stages, lowered, collectives)
    for key, (r, i, a) in sorted(sent.items(), key=lambda kv: kv[1][:2]):
        if key not in received:
            raise fail(r, i, a, f"route {a.route}, micro-batch {a.microbatch} is never received")
    return Timeline(times, {r: state[r][12] for r in schedule}, visits, nan_start)


def _check_receive(r: int, i: int, recv: Action, sender: tuple[int, int, Action], again: bool) -> None:
    q, j, send = sender
    if again:
        raise fail(r, i, recv, f"route {recv.route}, micro-batch {recv.microbatch} is received twice")
    if (send.stage, send.peer, send.channel) != (recv.peer, recv.stage, recv.channel):
        raise fail(r, i, recv, f"route {recv.route}, micro-batch {recv.microbatch} was sent as {send} "
                               f"(rank {q}, step {j})")


def _deadlock(schedule: Schedule, ranks: list[int], ptr: dict[int, int], first_opt: dict[int, int],
              is_done: Callable[[tuple], bool], num_stages: int, lowered: bool, collectives: bool) -> ScheduleError:
    blocked = [(r, ptr[r], schedule[r][ptr[r]]) for r in ranks if ptr[r] < len(schedule[r])]
    waits = []
    for r, i, a in blocked:
        if a.kind is Kind.RECV:
            what = _awaited_send(a)
        elif a.kind is Kind.OPT and collectives:
            behind = [q for q in ranks if ptr[q] < first_opt[q]]
            what = f"the OPT barrier (rank{'s' * (len(behind) > 1)} {', '.join(map(str, behind))} not there)"
        else:
            what = " and ".join(str(Action(*d)) for d in _dependencies(a, num_stages, lowered) if not is_done(d))
        waits.append(f"rank {r} at step {i} ({a}) waits for {what}")
    r, i, a = blocked[0]
    return ScheduleError("deadlock: " + "; ".join(waits), r, i, a)
