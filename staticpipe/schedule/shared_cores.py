"""Running a schedule on paper when ranks share processors: CPU "devices" are threads on one machine.

Why a second engine: ``execution`` gives every rank a processor of its own, which is what a GPU per
stage is. Without CUDA every ``gpu:k`` stage is a worker thread on this machine's cores, and four
stage threads on two cores do not each run at full speed: while ``n`` of the sharing ranks have work
and there are ``c`` cores, each runs at ``min(1, c / n)`` of its speed (processor sharing, which is
what the operating system's scheduler approximates). A rank's actions still run in list order, each
when its dependency is met, with the dependency rules of ``execution`` (a RECV waits for its SEND; with
``collectives`` no rank starts its first OPT before every rank has reached it). The schedule must
already have passed ``execution.timeline`` (the simulator runs it first), so deadlocks and malformed
messages are reported there, by the engine that explains them.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, Collection

from .actions import Action, Kind, Schedule
from .execution import Event, _dependencies, first_opt_step, is_lowered
from .latency import Latency, stage_lags

EPS = 1e-12


def execute_shared(schedule: Schedule, num_stages: int, duration: Callable[[Action], float], cores: float,
                   sharing: Collection[int], collectives: bool = False, latency: Latency | None = None) -> list[Event]:
    """The (rank, action, start, end) of every action when the ranks in ``sharing`` share ``cores``
    processors and the others have one each.

    At each moment the ranks are visited in order and every rank whose next action is ready starts it,
    again until none starts (an action costing nothing ends at once and may ready another). A rank is
    visited only when what it waits for may have changed (its own action ended, the action or message it
    waits for is done, the optimizer barrier opened), in the order a visit of every rank would take, so
    the events are those of visiting all of them: at 64 ranks most are waiting, and visiting each at every
    event made a large schedule cost seconds. With a ``latency``, what crosses ranks is done for the
    receiver only once it has arrived: an ``arrivals`` heap of (time, what), the moments it holds being
    moments as action ends are."""
    if not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores!r}")
    import numpy as np  # here: the schedule package loads without numpy

    lowered = is_lowered(schedule)
    ranks = sorted(schedule)
    slot = {r: i for i, r in enumerate(ranks)}
    ptr = dict.fromkeys(ranks, 0)
    first_opt = {r: first_opt_step(acts) for r, acts in schedule.items()}
    # the work left of the action each rank runs (inf: none), and each rank's speed: one array op per
    # moment instead of a pass of Python over the ranks; elementwise the same float operations
    left = np.full(len(ranks), np.inf)
    rate = np.ones(len(ranks))
    shares = np.array([r in sharing for r in ranks], bool)
    running: set[int] = set()
    busy = 0  # running ranks that share the cores
    started: dict[int, float] = {}
    done: set = set()  # compute actions (their keys) that have ended, and messages sent (route, micro-batch)
    waiting: dict = {}  # what a rank waits for (a key, a message, or BARRIER) -> the ranks waiting for it
    at_barrier = sum(1 for r in ranks if ptr[r] >= first_opt[r])
    events: list[Event] = []
    now = 0.0
    # a pass over every action, so only with a latency: the stage -> rank map and each stage's input lags
    rank_of = {a.stage: r for r, acts in schedule.items() for a in acts for a in a.halves()} if latency else {}
    f_lag, b_lag = stage_lags(rank_of, num_stages, None if lowered else latency)
    arrivals: list[tuple[float, tuple]] = []  # (when, what) of messages in flight

    def blocker(r: int, a: Action):
        """What the rank's next action ``a`` still waits for; None when it can start."""
        if a.kind is Kind.RECV:
            return None if (a.route, a.microbatch) in done else (a.route, a.microbatch)
        if a.kind is Kind.OPT and collectives and ptr[r] == first_opt[r]:
            return None if at_barrier == len(ranks) else BARRIER
        waits = (ARRIVED + d if latency is not None and rank_of.get(d[1]) != r else d
                 for d in _dependencies(a, num_stages, lowered))
        return next((d for d in waits if d not in done), None)

    def send(what: tuple, at: float, later: list[int], now_visit: list[int], current: int) -> None:
        """``what`` is done for its receivers at ``at``: now, or once it arrives."""
        if at <= now:
            done.add(what)
            wake(what, later, now_visit, current)
        else:
            heapq.heappush(arrivals, (at, what))

    def wake(what, later: list[int], now_visit: list[int], current: int) -> None:
        for q in waiting.pop(what, ()):
            heapq.heappush(now_visit if q > current else later, q)

    def finish(r: int, later: list[int], now_visit: list[int]) -> None:
        """End rank ``r``'s action; ranks it wakes after ``r`` are visited in this round, the others and ``r`` next."""
        nonlocal at_barrier, busy
        a = schedule[r][ptr[r]]
        events.append((r, a, started.pop(r), now))
        running.discard(r)
        left[slot[r]] = np.inf
        busy -= r in sharing
        if a.kind is Kind.SEND:
            peer = latency(r, rank_of[a.peer]) if latency is not None and a.peer in rank_of else 0.0
            send((a.route, a.microbatch), max(now, events[-1][2] + peer), later, now_visit, r)
        elif a.kind is not Kind.RECV:
            for h in a.halves():
                done.add(h.key)
                wake(h.key, later, now_visit, r)
                if latency is not None and not lowered and h.kind in (Kind.F, Kind.B):  # as the stage it feeds reads it
                    lag = (f_lag[h.stage + 1] if h.stage + 1 < num_stages else 0.0) if h.kind is Kind.F else (
                        b_lag[h.stage - 1] if h.stage > 0 else 0.0)
                    send(ARRIVED + h.key, now + lag, later, now_visit, r)
        was = ptr[r] >= first_opt[r]
        ptr[r] += 1
        if not was and ptr[r] >= first_opt[r]:
            at_barrier += 1
            if at_barrier == len(ranks):
                wake(BARRIER, later, now_visit, r)
        heapq.heappush(later, r)  # its next action: visited in the next round, as a full visit would

    visit = list(ranks)  # a heap of the ranks to visit this round
    while True:
        while visit:  # rounds of visits at this moment, each in rank order
            later: list[int] = []
            while visit:
                r = heapq.heappop(visit)
                if visit and visit[0] == r:
                    continue  # queued twice
                if r in running or ptr[r] >= len(schedule[r]):
                    continue
                a = schedule[r][ptr[r]]
                what = blocker(r, a)
                if what is not None:
                    waiting.setdefault(what, []).append(r)
                    continue
                work, started[r] = duration(a), now
                if not work >= 0:  # NaN would never end
                    raise ValueError(f"action {a} of rank {r} costs {work!r}: a cost is seconds >= 0")
                running.add(r)
                busy += r in sharing
                left[slot[r]] = work
                if work <= EPS:
                    finish(r, later, visit)
            visit = later
        if not running and not arrivals:
            break  # every rank is done (``timeline`` has already ruled out a deadlock)
        if busy:
            rate[shares] = min(1.0, cores / busy)
        step = float((left / rate).min()) if running else math.inf
        if arrivals and arrivals[0][0] - now < step:
            step = arrivals[0][0] - now
        now += step
        left -= rate * step
        for i in np.flatnonzero(left <= EPS * max(1.0, now)).tolist():  # in rank order
            finish(ranks[i], visit, visit)
        while arrivals and arrivals[0][0] <= now:
            what = heapq.heappop(arrivals)[1]
            done.add(what)
            wake(what, visit, visit, -1)
    return events


BARRIER = "the first OPT of every rank"
ARRIVED = ("arrived",)  # + an action's key: its output has reached the rank that reads it
