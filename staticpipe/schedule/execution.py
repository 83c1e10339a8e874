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
    if a.kind is Kind.W:
        return Kind.B, a.stage, a.microbatch
    if a.kind is Kind.B and a.stage == num_stages - 1:
        return Kind.F, a.stage, a.microbatch
    if lowered:
        return None
    if a.kind is Kind.F and a.stage > 0:
        return Kind.F, a.stage - 1, a.microbatch
    if a.kind is Kind.B:
        return Kind.B, a.stage + 1, a.microbatch
    return None


def _awaited_send(recv: Action) -> str:
    return f"{recv.peer}SEND_{recv.channel}{recv.microbatch}>{recv.stage} on route {recv.route}"


def execute(schedule: Schedule, num_stages: int, duration: Callable[[Action], float],
            collectives: bool = False) -> list[Event]:
    """The (rank, action, start, end) of every action, each rank's in list order; ``ScheduleError`` on
    a deadlock, a message sent twice, received twice, received by the wrong stage, or never received."""
    lowered = any(a.kind in (Kind.SEND, Kind.RECV) for acts in schedule.values() for a in acts)
    ranks = sorted(schedule)
    ptr = dict.fromkeys(ranks, 0)
    clock = dict.fromkeys(ranks, 0.0)
    first_opt = {r: next((i for i, a in enumerate(acts) if a.kind is Kind.OPT), len(acts))
                 for r, acts in schedule.items()}
    done: dict[tuple, float] = {}  # compute action (its key) -> its end
    sent: dict[tuple, tuple[int, int, Action]] = {}  # (route, micro-batch) -> rank, step, SEND
    sent_at: dict[tuple, float] = {}  # (route, micro-batch) -> end of its SEND
    received: set[tuple] = set()
    reached: dict[int, float] = {}  # rank -> when it reached its first OPT
    events: list[Event] = []

    def ready_at(r: int, i: int, a: Action) -> float | None:
        if a.kind is Kind.RECV:
            key = (a.route, a.microbatch)
            if key in sent:
                _check_receive(r, i, a, sent[key], key in received)
            return sent_at.get(key)
        if a.kind is Kind.OPT and collectives:
            return max(reached.values()) if len(reached) == len(ranks) else None
        waits = [done.get(d) for d in _dependencies(a, num_stages, lowered)]
        return None if None in waits else max(waits, default=0.0)

    def reach(r: int) -> None:
        if ptr[r] == first_opt[r]:
            reached[r] = clock[r]

    for r in ranks:
        reach(r)
    while any(ptr[r] < len(schedule[r]) for r in ranks):
        progressed = False
        for r in ranks:
            acts = schedule[r]
            while ptr[r] < len(acts):
                i, a = ptr[r], acts[ptr[r]]
                ready = ready_at(r, i, a)
                if ready is None:
                    break
                start = max(clock[r], ready)
                clock[r] = end = start + duration(a)
                events.append((r, a, start, end))
                if a.kind is Kind.SEND:
                    key = (a.route, a.microbatch)
                    if key in sent:
                        q, j, first = sent[key]
                        raise fail(r, i, a, f"route {a.route}, micro-batch {a.microbatch} is sent twice "
                                            f"(also by rank {q}, step {j}, action {first})")
                    sent[key] = (r, i, a)
                    sent_at[key] = end
                elif a.kind is Kind.RECV:
                    received.add((a.route, a.microbatch))
                else:
                    done.update(dict.fromkeys((h.key for h in a.halves()), end))
                ptr[r] += 1
                reach(r)
                progressed = True
        if not progressed:
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
