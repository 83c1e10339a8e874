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
from operator import itemgetter
from typing import Callable

from .actions import Action, Kind, Schedule

Event = tuple[int, Action, float, float]  # (rank, action, start, end)


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
    return any(Kind.SEND in kinds or Kind.RECV in kinds for kinds in map(_kinds, schedule.values()))


def _kinds(actions: list[Action]) -> list[Kind]:
    return list(map(itemgetter(0), actions))  # a C-level pass: schedules at scale hold 10^5-10^6 actions


def first_opt_step(actions: list[Action]) -> int:
    """The step of the rank's first OPT, or the length of its list."""
    kinds = _kinds(actions)
    return kinds.index(Kind.OPT) if Kind.OPT in kinds else len(kinds)


def _awaited_send(recv: Action) -> str:
    return f"{recv.peer}SEND_{recv.channel}{recv.microbatch}>{recv.stage} on route {recv.route}"


def execute(schedule: Schedule, num_stages: int, duration: Callable[[Action], float],
            collectives: bool = False) -> list[Event]:
    """The (rank, action, start, end) of every action, each rank's in list order; ``ScheduleError`` on
    a deadlock, a message sent twice, received twice, received by the wrong stage, or never received.

    Ranks are visited in turns, in rank order, each running as far as it can. A blocked rank is not
    looked at again until what it waits for is done: then in this turn if its place comes later, else
    in the next -- exactly where visiting every rank every turn would find it ready, without the
    visits that find it still blocked (thousands of turns at 64 ranks). What an action waits for is
    ``_dependency``'s rule, spelled out inline: this loop runs once per action of schedules with
    hundreds of thousands."""
    lowered = is_lowered(schedule)
    ranks = sorted(schedule)
    ptr = dict.fromkeys(ranks, 0)
    clock = dict.fromkeys(ranks, 0.0)
    first_opt = {r: first_opt_step(acts) for r, acts in schedule.items()}
    done: dict[tuple, float] = {}  # compute action (its key) -> its end
    sent: dict[tuple, tuple[int, int, Action]] = {}  # (route, micro-batch) -> rank, step, SEND
    sent_at: dict[tuple, float] = {}  # (route, micro-batch) -> end of its SEND
    received: set[tuple] = set()
    reached: dict[int, float] = {r: 0.0 for r in ranks if first_opt[r] == 0}  # rank -> when it reached its first OPT
    waiting: dict[tuple, list[int]] = {}  # what a blocked rank waits for -> the ranks waiting for it
    events: list[Event] = []
    append, done_get, last = events.append, done.get, num_stages - 1
    f, b, w, fb, opt, send, recv = Kind.F, Kind.B, Kind.W, Kind.FB, Kind.OPT, Kind.SEND, Kind.RECV
    this_turn = [r for r in ranks if schedule[r]]  # a heap, but in order already
    next_turn: list[int] = []

    def wake(what: tuple, r: int) -> None:
        for q in waiting.pop(what, ()):
            if q > r:
                heapq.heappush(this_turn, q)
            else:
                next_turn.append(q)

    while this_turn:
        while this_turn:
            r = heapq.heappop(this_turn)
            acts, i, t = schedule[r], ptr[r], clock[r]
            n = len(acts)
            while i < n:
                a = acts[i]
                kind = a[0]
                if kind is recv:
                    key = (a[3], a[2])
                    if key in sent:
                        _check_receive(r, i, a, sent[key], key in received)
                    ready = sent_at.get(key)
                    if ready is None:
                        waiting.setdefault((send, key), []).append(r)
                        break
                    received.add(key)
                elif kind is opt and collectives:
                    if len(reached) < len(ranks):
                        waiting.setdefault((opt,), []).append(r)
                        break
                    ready = max(reached.values())
                else:
                    if kind is fb:
                        deps = _dependencies(a, num_stages, lowered)
                    elif kind is w:
                        deps = ((b, a[1], a[2]),)
                    elif kind is b and a[1] == last:
                        deps = ((f, a[1], a[2]),)
                    elif lowered or kind is opt or (kind is f and a[1] == 0):
                        deps = ()
                    else:
                        deps = ((f, a[1] - 1, a[2]),) if kind is f else ((b, a[1] + 1, a[2]),)
                    ready, blocked = 0.0, None
                    for d in deps:
                        end = done_get(d)
                        if end is None:
                            blocked = d
                            break
                        if end > ready:
                            ready = end
                    if blocked is not None:
                        waiting.setdefault(blocked, []).append(r)
                        break
                start = t if t > ready else ready
                t = start + duration(a)
                append((r, a, start, t))
                if kind is send:
                    key = (a[3], a[2])
                    if key in sent:
                        q, j, first = sent[key]
                        raise fail(r, i, a, f"route {a.route}, micro-batch {a.microbatch} is sent twice "
                                            f"(also by rank {q}, step {j}, action {first})")
                    sent[key] = (r, i, a)
                    sent_at[key] = t
                    wake((send, key), r)
                elif kind is fb:
                    for k in (h[:3] for h in a.halves()):
                        done[k] = t
                        if k in waiting:
                            wake(k, r)
                elif kind is not recv:
                    k = a[:3]
                    done[k] = t
                    if k in waiting:
                        wake(k, r)
                i += 1
                if i == first_opt[r]:
                    reached[r] = t
                    if len(reached) == len(ranks):
                        wake((opt,), r)
            ptr[r], clock[r] = i, t
        this_turn, next_turn = sorted(set(next_turn)), []
    if any(ptr[r] < len(schedule[r]) for r in ranks):
        raise _deadlock(schedule, ranks, ptr, first_opt, done, num_stages, lowered, collectives)
    for key, (r, i, a) in sorted(sent.items(), key=lambda kv: kv[1][:2]):
        if key not in received:
            raise fail(r, i, a, f"route {a.route}, micro-batch {a.microbatch} is never received")
    return events


def _check_receive(r: int, i: int, recv: Action, sender: tuple[int, int, Action], again: bool) -> None:
    q, j, send = sender
    if again:
        raise fail(r, i, recv, f"route {recv.route}, micro-batch {recv.microbatch} is received twice")
    if (send.stage, send.peer, send.channel) != (recv.peer, recv.stage, recv.channel):
        raise fail(r, i, recv, f"route {recv.route}, micro-batch {recv.microbatch} was sent as {send} "
                               f"(rank {q}, step {j})")


def _deadlock(schedule: Schedule, ranks: list[int], ptr: dict[int, int], first_opt: dict[int, int],
              done: dict[tuple, float], num_stages: int, lowered: bool, collectives: bool) -> ScheduleError:
    blocked = [(r, ptr[r], schedule[r][ptr[r]]) for r in ranks if ptr[r] < len(schedule[r])]
    waits = []
    for r, i, a in blocked:
        if a.kind is Kind.RECV:
            what = _awaited_send(a)
        elif a.kind is Kind.OPT and collectives:
            behind = [q for q in ranks if ptr[q] < first_opt[q]]
            what = f"the OPT barrier (rank{'s' * (len(behind) > 1)} {', '.join(map(str, behind))} not there)"
        else:
            what = " and ".join(str(Action(*d)) for d in _dependencies(a, num_stages, lowered) if d not in done)
        waits.append(f"rank {r} at step {i} ({a}) waits for {what}")
    r, i, a = blocked[0]
    return ScheduleError("deadlock: " + "; ".join(waits), r, i, a)
