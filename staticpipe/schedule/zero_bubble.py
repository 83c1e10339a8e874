"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): ZB-H1, ZB-2P and ZB-V.

Splitting the backward into B (activation gradients, which the previous stage waits for) and W
(weight gradients, which nobody waits for) lets a rank defer its W's into the idle time 1F1B has
while the pipeline fills and drains. All three schedules come from one deterministic list scheduler that
plays the step out in time: whenever a rank is free it runs, in priority,

1. the next F of one of its stages (the later stage first), if its input is there and
   a. the stage holds fewer than ``S - s`` micro-batches between F and B (1F1B's warm-up rule), and
   b. the rank holds fewer than ``p x chunks`` (stage, micro-batch) pairs between F and W -- 1F1B's
      peak, the first stage's ``p`` micro-batches of a whole rank's layers, since W needs the
      activations too;
2. else a ready B (the later stage first, then the lowest micro-batch);
3. else a pending W (the lowest micro-batch, then the later stage);
4. else it waits until the next action anywhere ends. Each stage's OPT comes after everything.

An input is there once the action producing it has ended (messages cost nothing here). Without costs
every action takes one time step (F = B = W = 1) and the ranks move in lock-step.

Why F before B: with B first a rank answers each returning gradient at once and starves the ranks
after it of forwards; with F first the W's fill exactly the fill-and-drain gaps. Measured at unit
costs, ZB-H1 takes ``3m + p - 1`` steps for every ``m >= p`` (p <= 8), the paper's ZB-H1: a third of
1F1B's idle time (B + W priced 2) at 1F1B's peak memory. Why 1b: without it the W's wait until the
forwards run out and a rank holds all ``m`` micro-batches, like F-then-B.

With measured costs (``costs``: per-action seconds, e.g. ``Timeline.stage_costs()``) the same rules
are played out at the real durations, so each rank's order follows when its inputs really arrive: a
light stage runs ahead to its memory cap and fills the wait with W's, a cheap W slots into a short
gap; rule 1b then also keeps a slot for every later-chunk F the rank's micro-batches still need
(``owed``: ZB-V's cheap first chunk could otherwise fill the cap and deadlock). As in the paper's
heuristic scheduler, a W that would still be running when an F or B input arrives delays that F or B
and everything downstream of it, so the planner also tries a second policy -- a W only where it ends
before the next awaited input -- and keeps whichever of the two, or the unit-cost schedule, the
simulator finds shortest under the costs (ties: the unit-cost one): a cost-aware schedule is never
slower than the unit-cost one under the costs it was planned for. For two stages at the costs
measured here the unit-cost ZB-H1 order is already the best, and the planner keeps it.

ZB-H1 places stage s on rank s. ZB-V gives rank r the stages r and 2p-1-r: a micro-batch goes down
the ranks and back up, so the last stage, whose B starts every backward, shares rank 0 with the
first; with each chunk half a stage it idles about ``(p - 1) / 2`` steps, a sixth of 1F1B's.

ZB-2P (the paper's ZB-H2 memory budget, ``memory=2``) is ZB-H1 allowed twice 1F1B's activations:
rule 1a lets stage s run up to ``2 (S - s) - 1`` micro-batches ahead of its B's (Paddle's Eager1F1B
warm-up: enough forwards that the stage's first B can start the moment its gradient arrives) and 1b
caps a rank at ``2 p x chunks``. With p more micro-batches in flight the W's no longer have to fill
the fill-and-drain gaps on a rank's critical path: from about ``m >= 2p`` no rank idles between its
first and its last action at unit costs (``Simulation.span_bubble`` 0, the paper's zero bubble); the
step still takes ``3m + p - 1`` units, as the last rank starts ``p - 1`` units late. With measured
costs it plans like ZB-H1 does (above), under its own memory rules.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable

from .actions import OPT, Action, B, F, Kind, Schedule, W
from .simulate import Costs, cost_function, simulate

Duration = Callable[[Action], float]


def zb_v_layout(num_ranks: int) -> list[int]:
    """Rank of each of the ``2 p`` stages: 0, 1, ..., p-1, p-1, ..., 1, 0."""
    return list(range(num_ranks)) + list(reversed(range(num_ranks)))


def zb_h1(num_ranks: int, num_microbatches: int, costs: Costs = None) -> Schedule:
    return greedy_split_backward(list(range(num_ranks)), num_microbatches, costs)


def zb_v(num_ranks: int, num_microbatches: int, costs: Costs = None) -> Schedule:
    return greedy_split_backward(zb_v_layout(num_ranks), num_microbatches, costs)


def zb_2p(num_ranks: int, num_microbatches: int, costs: Costs = None) -> Schedule:
    return greedy_split_backward(list(range(num_ranks)), num_microbatches, costs, memory=2)


def greedy_split_backward(stage_ranks: list[int], num_microbatches: int, costs: Costs = None,
                          memory: int = 1) -> Schedule:
    """The list scheduler above for a placement ``stage_ranks`` (stage -> rank) with the same number
    of stages on every rank. ``costs`` (as for ``simulate``: None for unit costs, {"F": 1, "W": 0.5},
    or a function of the action, e.g. per stage) are the durations it plans with. ``memory``: the
    activations allowed, in multiples of 1F1B's (rules 1a and 1b)."""
    unit = _ListScheduler(stage_ranks, num_microbatches, cost_function(None), memory=memory).run()
    if costs is None:
        return unit
    duration = cost_function(costs)
    planned = [unit] + [_ListScheduler(stage_ranks, num_microbatches, duration, timed=True, w_fits_gaps=fits,
                                       memory=memory).run() for fits in (False, True)]
    return min(planned, key=lambda s: simulate(s, duration, len(stage_ranks)).total)  # ties: the unit one


class _ListScheduler:
    """One playing-out of the rules: what each stage has started, and when each started action ends.

    Why the queues: at 64 ranks and 1024 micro-batches a rank holds dozens of micro-batches and is asked
    for its next action hundreds of thousands of times. Each stage keeps its B's whose input has started
    in ``pending`` (by when the input ends) and those whose input has ended in ``arrived`` (by micro-batch),
    and its W's in a heap, so a choice costs a few heap operations instead of a scan of all it holds."""

    def __init__(self, stage_ranks: list[int], num_microbatches: int, duration: Duration, timed: bool = False,
                 w_fits_gaps: bool = False, memory: int = 1):
        self.stage_ranks, self.m, self.duration = stage_ranks, num_microbatches, duration
        self.timed = timed  # real durations: keep the memory slots later chunks need (see ``owed``)
        self.w_fits_gaps = w_fits_gaps  # a W only where it ends before the next awaited F/B input
        self.num_stages = len(stage_ranks)
        self.stages_of = {r: sorted((s for s, q in enumerate(stage_ranks) if q == r), reverse=True)
                          for r in sorted(set(stage_ranks))}
        # rule 1b: p ranks x S/p chunks, 1F1B's first-stage peak in (stage, mb) pairs, times ``memory``
        self.cap = memory * self.num_stages
        self.ahead = [memory * (self.num_stages - s) - (memory - 1) for s in range(self.num_stages)]  # rule 1a
        self.end: dict[tuple, float] = {}  # each started action's key -> its end
        self.next_f = [0] * self.num_stages
        self.before_b = [0] * self.num_stages  # micro-batches whose F started and B not
        self.held = dict.fromkeys(self.stages_of, 0)  # per rank: (stage, mb) pairs whose F started and W not
        self.pending: list[list[tuple[float, int]]] = [[] for _ in stage_ranks]  # (input's end, mb) of B's
        self.arrived: list[list[int]] = [[] for _ in stage_ranks]  # mbs of B's whose input has ended
        self.before_w: list[list[int]] = [[] for _ in stage_ranks]  # mbs whose B started and W not (a heap)

    def run(self) -> Schedule:
        """Every rank's actions in the order it starts them, each stage's OPT last."""
        schedule: Schedule = {r: [] for r in self.stages_of}
        free = dict.fromkeys(schedule, 0.0)
        moments = [0.0]  # when something ends: the only times a waiting rank's choice can change
        while len(self.end) < 3 * self.m * self.num_stages:
            if not moments:
                raise RuntimeError(f"greedy scheduler stuck for stage placement {self.stage_ranks}, m={self.m}")
            now = heapq.heappop(moments)
            instant = False  # whether an action of no duration started: it may let another start now
            for r in schedule:
                if free[r] <= now and (a := self.pick(r, now)) is not None:
                    schedule[r].append(a)
                    free[r] = self.start(a, now)
                    heapq.heappush(moments, free[r])
                    instant = instant or free[r] == now
            while not instant and moments and moments[0] == now:  # another pass at ``now`` would start nothing
                heapq.heappop(moments)
        for r, stages in self.stages_of.items():
            schedule[r] += [OPT(s) for s in sorted(stages)]
        return schedule

    def pick(self, r: int, now: float) -> Action | None:
        """Rank ``r``'s next action at time ``now`` by the rules above, or None to wait: its F's within the
        memory caps, then its B's (the later stage first, then the lowest micro-batch), then its W's."""
        arrival = math.inf  # when the first F/B that is waiting only for its input can start
        stages, held = self.stages_of[r], self.held[r]
        for s in stages:
            mb = self.next_f[s]
            if mb < self.m and self.before_b[s] < self.ahead[s] and held + self.owed(r, s) < self.cap:
                ready = self.end.get((Kind.F, s - 1, mb), math.inf) if s > 0 else 0.0
                if ready <= now:
                    return F(s, mb)
                arrival = min(arrival, ready)
        for s in stages:
            pending, arrived = self.pending[s], self.arrived[s]
            while pending and pending[0][0] <= now:
                heapq.heappush(arrived, heapq.heappop(pending)[1])
            if arrived:
                return B(s, arrived[0])
            if pending:
                arrival = min(arrival, pending[0][0])
        waiting = [(self.before_w[s][0], -s) for s in stages if self.before_w[s]]
        if not waiting:
            return None
        mb, s = min(waiting)
        w = W(-s, mb)
        return w if not self.w_fits_gaps or now + self.duration(w) <= arrival else None

    def owed(self, r: int, s: int) -> int:
        """Slots rank ``r`` must keep for the later-chunk F's of the micro-batches already on it, once
        stage ``s`` has started its next F. Why: at real durations a cheap first chunk can fill the whole
        cap with its forwards before any returns on the later chunk, and then no micro-batch on the rank
        can reach its backward (a deadlock). In lock-step at unit costs the later chunk's inputs always
        come in time, and today's unit schedules use those slots, so they are kept only when ``timed``."""
        if not self.timed:
            return 0
        first = min(self.stages_of[r])
        started = {t: self.next_f[t] + (t == s) for t in self.stages_of[r]}
        return sum(started[first] - n for n in started.values())

    def start(self, a: Action, now: float) -> float:
        """Start ``a`` at ``now``; returns when it ends."""
        seconds = self.duration(a)
        if seconds < 0:
            raise ValueError(f"costs give action {a} a negative duration ({seconds})")
        kind, s, mb = key = a[:3]
        self.end[key] = end = now + seconds
        if kind is Kind.F:
            self.next_f[s] += 1
            self.before_b[s] += 1
            self.held[self.stage_ranks[s]] += 1
            if s == self.num_stages - 1:  # the last stage's B needs only this F, on the same rank
                heapq.heappush(self.pending[s], (0.0, mb))
        elif kind is Kind.B:
            self.before_b[s] -= 1
            heapq.heappop(self.arrived[s])  # ``pick`` chose the lowest that has arrived
            heapq.heappush(self.before_w[s], mb)
            if s > 0:
                heapq.heappush(self.pending[s - 1], (end, mb))
        else:
            heapq.heappop(self.before_w[s])
            self.held[self.stage_ranks[s]] -= 1
        return end
