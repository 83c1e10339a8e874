"""Running a schedule on paper when ranks share processors: CPU "devices" are threads on one machine.

Why a second engine: ``execution`` gives every rank a processor of its own, which is what a GPU per
stage is. Without CUDA every ``gpu:k`` stage is a worker thread on this machine's cores, and four
stage threads on two cores do not each run at full speed: while ``n`` of the sharing ranks have work
and there are ``c`` cores, each runs at ``min(1, c / n)`` of its speed (processor sharing, which is
what the operating system's scheduler approximates). A rank's actions still run in list order, each
when its dependency is met, with the dependency rules of ``execution`` (a RECV waits for its SEND; with
``collectives`` no rank starts its first OPT before every rank has reached it). The schedule must
already have passed ``execution.execute`` (the simulator runs it first), so deadlocks and malformed
messages are reported there, by the engine that explains them.
"""
from __future__ import annotations

from typing import Callable, Collection

from .actions import Action, Kind, Schedule
from .execution import Event, _dependencies, first_opt_step, is_lowered

EPS = 1e-12


def execute_shared(schedule: Schedule, num_stages: int, duration: Callable[[Action], float], cores: float,
                   sharing: Collection[int], collectives: bool = False) -> list[Event]:
    """The (rank, action, start, end) of every action when the ranks in ``sharing`` share ``cores``
    processors and the others have one each."""
    if not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores!r}")
    lowered = is_lowered(schedule)
    ranks = sorted(schedule)
    ptr = dict.fromkeys(ranks, 0)
    first_opt = {r: first_opt_step(acts) for r, acts in schedule.items()}
    left: dict[int, float] = {}  # rank -> work left of the action it is running
    started: dict[int, float] = {}
    done: set[tuple] = set()  # compute actions (their keys) that have ended
    sent: set[tuple] = set()
    events: list[Event] = []
    now = 0.0

    def ready(r: int, a: Action) -> bool:
        if a.kind is Kind.RECV:
            return (a.route, a.microbatch) in sent
        if a.kind is Kind.OPT and collectives and ptr[r] == first_opt[r]:
            return all(ptr[q] >= first_opt[q] for q in ranks)
        return all(d in done for d in _dependencies(a, num_stages, lowered))

    def finish(r: int) -> None:
        a = schedule[r][ptr[r]]
        events.append((r, a, started.pop(r), now))
        del left[r]
        if a.kind is Kind.SEND:
            sent.add((a.route, a.microbatch))
        elif a.kind is not Kind.RECV:
            done.update(h.key for h in a.halves())
        ptr[r] += 1

    while True:
        moved = True
        while moved:  # start every action that can start now; those costing nothing end at once
            moved = False
            for r in ranks:
                if r not in left and ptr[r] < len(schedule[r]) and ready(r, schedule[r][ptr[r]]):
                    left[r], started[r], moved = duration(schedule[r][ptr[r]]), now, True
                    if left[r] <= EPS:
                        finish(r)
        if not left:
            break  # every rank is done (``execute`` has already ruled out a deadlock)
        busy = sum(1 for r in left if r in sharing)
        rate = {r: min(1.0, cores / busy) if r in sharing else 1.0 for r in left}
        step = min(left[r] / rate[r] for r in left)
        now += step
        for r in sorted(left):
            left[r] -= rate[r] * step
            if left[r] <= EPS * max(1.0, now):
                finish(r)
    return events
