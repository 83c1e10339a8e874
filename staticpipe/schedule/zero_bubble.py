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
(``owed``: ZB-V's cheap first chunk could otherwise fill the cap and deadlock). A message latency
(``latency``: seconds in flight per link) delays each input's arrival by its link's latency. As in the
paper's heuristic scheduler, a W that would still be running when an F or B input arrives delays that
F or B and everything downstream of it, so the planner also tries a second policy -- a W only where it
ends before the next awaited input.

No single rule set is best for every cost ratio and latency, so with costs or a latency the planner
keeps a portfolio and returns the candidate whose simulated step (under those costs and that latency)
is shortest, ties going to the earlier one: the unit-cost schedule, the two timed list-scheduler
policies, and the searches after the Zero Bubble authors' schedulers -- ``zb_h_search`` for one stage
per rank (micro-batch rounds with idle-time budgets, 8 variants), ``zb_v_search`` for the V (warm-up
filled up to the memory limit, chunks alternating in the steady state, reruns with approved idle
budgets while the worst idle time drops), and for ZB-V that search again with its costs nudged
(``NUDGES``). Every candidate keeps the family's memory limit, so the result is never slower than any
of them under the costs and latency it was planned for: never slower than the unit-cost schedule, and
never slower than the authors' own orders for the same costs, memory limit and latency (which the
searches reproduce). That holds up to ``FULL`` (stage, micro-batch) pairs and ``FULL_RANKS`` ranks;
larger plans keep a cheaper portfolio, to stay within a second or two. For two stages at the costs
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
from .execution import ScheduleError, timeline
from .latency import Latency, stage_lags
from .simulate import Costs, cost_function
from .zb_h_search import H_QUICK, H_VARIANTS, h_search
from .zb_v_search import V_VARIANTS, v_search

Duration = Callable[[Action], float]


def zb_v_layout(num_ranks: int) -> list[int]:
    """Rank of each of the ``2 p`` stages: 0, 1, ..., p-1, p-1, ..., 1, 0."""
    return list(range(num_ranks)) + list(reversed(range(num_ranks)))


def zb_h1(num_ranks: int, num_microbatches: int, costs: Costs = None, latency: Latency | None = None) -> Schedule:
    return greedy_split_backward(list(range(num_ranks)), num_microbatches, costs, latency=latency)


def zb_v(num_ranks: int, num_microbatches: int, costs: Costs = None, latency: Latency | None = None) -> Schedule:
    return greedy_split_backward(zb_v_layout(num_ranks), num_microbatches, costs, latency=latency)


def zb_2p(num_ranks: int, num_microbatches: int, costs: Costs = None, latency: Latency | None = None) -> Schedule:
    return greedy_split_backward(list(range(num_ranks)), num_microbatches, costs, memory=2, latency=latency)


# Up to ``FULL`` (stage, micro-batch) pairs (every configuration up to 16 ranks x 64 micro-batches) the
# portfolio holds every candidate: the unit plan, the list scheduler's two timed policies, and every
# variant and pass of the searches. Beyond, it stays within a second or so at 64 ranks x 512
# micro-batches: ZB-H1/2P keep the unit plan and one variant of the search (``H_QUICK``: measured at 24-64
# ranks, 128-200 micro-batches, the best of all eight but once, by 0.06 %); ZB-V keeps its search's first pass
# alone (the unit plan if it finds no order), as the unit plan and its simulation would take a second
# there and it was 0.5-25 % slower than that pass under every cost and latency measured at 32-64 ranks.
# The list scheduler's time grows with the square of the ranks (each moment asks every rank):
# beyond ``FULL_RANKS`` ranks, the cheaper portfolio too; up to it ZB-H1/2P's cheaper portfolio also
# keeps the list scheduler's two policies (planned without the latency), so that it is never slower
# than the plans before the portfolio.
FULL, FULL_RANKS = 2048, 32


def greedy_split_backward(stage_ranks: list[int], num_microbatches: int, costs: Costs = None,
                          memory: int = 1, latency: Latency | None = None) -> Schedule:
    """The list scheduler above for a placement ``stage_ranks`` (stage -> rank) with the same number
    of stages on every rank. ``costs`` (as for ``simulate``: None for unit costs, {"F": 1, "W": 0.5},
    or a function of the action, e.g. per stage) are the durations it plans with, ``latency`` the
    message latency (``latency.Latency``; None: free). ``memory``: the activations allowed, in
    multiples of 1F1B's (rules 1a and 1b). With costs or a latency it keeps the shortest of a portfolio
    of candidate orders (see the module's docstring), each timed under both."""
    m, num_stages = num_microbatches, len(stage_ranks)

    def unit() -> Schedule:
        return _ListScheduler(stage_ranks, m, cost_function(None), memory=memory).run()
    if costs is None and latency is None:  # the rules' unit plan: fast, and what every default plan has been
        return unit()
    duration = cost_function(costs)
    f_lag, b_lag = stage_lags(stage_ranks, num_stages, latency)
    cap = memory * num_stages  # rule 1b: (stage, micro-batch) pairs per rank (ZB-V: 2p chunk activations)
    few_ranks = len(set(stage_ranks)) <= FULL_RANKS
    full = m * num_stages <= FULL and few_ranks  # the whole portfolio
    h_layout, v_layout = stage_ranks == list(range(num_stages)), stage_ranks == zb_v_layout(num_stages // 2)
    if v_layout and not full:
        found = v_search(num_stages // 2, m, duration, f_lag, b_lag, cap, max_passes=1, variants=V_VARIANTS[:1])
        return found[0][1] if found else unit()

    seen: set[tuple] = set()

    def new(schedule: Schedule) -> bool:
        """Whether ``schedule`` is an order not seen yet (searches' passes and variants often agree)."""
        key = tuple(map(tuple, schedule.values()))
        return key not in seen and not seen.add(key)

    def timed(schedule: Schedule) -> tuple[float, Schedule]:
        if not new(schedule):  # time each order once
            return math.inf, schedule
        try:  # ``simulate``'s total, from its walk alone (no events, no peaks: a third of the time)
            ends = timeline(schedule, num_stages, duration, latency=latency).times.values()
            return max((e[-1] for _, e in ends if e), default=0.0), schedule
        except ScheduleError:  # a search's order whose rules guessed an input's time and deadlock: dropped
            return math.inf, schedule

    def listed(lags: tuple[list[float], list[float]]) -> list[tuple[float, Schedule]]:
        return [timed(_ListScheduler(stage_ranks, m, duration, timed=True, w_fits_gaps=fits, memory=memory,
                                     lags=lags).run()) for fits in (False, True)]

    planned = [timed(unit())]  # first: on a tie the unit plan, then the list-scheduled ones, is kept
    # with a latency, also every candidate planned as if messages were free: a rule that waits for a late
    # input can do worse than one that does not know it is late (measured: ZB-V, p = m = 4, comm 200)
    free_lags = ([0.0] * num_stages,) * 2
    if h_layout and few_ranks and not full:  # the list scheduler planned as before latencies: cheap here
        planned += listed(free_lags)
    planned_as = [(free_lags, False)] if latency is not None and full else []  # (lags, the true ones)
    for lags, true in planned_as + [((f_lag, b_lag), True)]:
        if full:
            planned += listed(lags)
        if h_layout:
            variants = H_VARIANTS if full else (H_QUICK,)
            planned += map(timed, h_search(num_stages, m, duration, *lags, cap, variants))
        elif v_layout:
            found = v_search(num_stages // 2, m, duration, *lags, cap, max_passes=8 if true else 2)
            if true:  # planned under the true costs and latency, the search timed it as ``simulate`` does
                planned += [(t, order) for t, order in found if new(order)]
            else:
                planned += map(timed, (order for _, order in found))
    if v_layout and full:
        for nudge in dict.fromkeys(n[:3] + (n[3] if latency else 1,) for n in NUDGES):
            if nudge == (1, 1, 1, 1):  # the search above, again
                continue
            lag = nudge[3]
            found = v_search(num_stages // 2, m, _nudged(duration, nudge), [x * lag for x in f_lag],
                             [x * lag for x in b_lag], cap, max_passes=2)
            planned += map(timed, (s for _, s in found))
    return min(planned, key=lambda c: c[0])[1]


# ZB-V's search planned again with its costs nudged, (F, B, W, latency) factors: its rules compare
# times against thresholds (a W fits the wait, the wait exceeds the idle budget), so a slightly
# mis-stated cost flips a few decisions, and the simulation under the true costs judges the outcome.
# Measured on the comparison grid (p <= 16, m <= 64): with these five, ZB-V's plans are shorter than
# the authors' ZB-V in 28 of 114 configurations without a latency and 54 of 57 with one (by up to 4 %);
# without them, in 24 and 16.
NUDGES = ((1, 1, 1, 2), (1, 1, 1.5, 1), (1, 1, 0.75, 1), (1, 1, 0.75, 0), (1.2, 1, 1, 1))


def _nudged(duration: Duration, nudge: tuple[float, ...]) -> Duration:
    factor = {Kind.F: nudge[0], Kind.B: nudge[1], Kind.W: nudge[2]}
    return lambda a: duration(a) * factor.get(a.kind, 1.0)


class _ListScheduler:
    """One playing-out of the rules: what each stage has started, and when each started action ends.

    Why the queues: at 64 ranks and 1024 micro-batches a rank holds dozens of micro-batches and is asked
    for its next action hundreds of thousands of times. Each stage keeps its B's whose input has started
    in ``pending`` (by when the input ends) and those whose input has ended in ``arrived`` (by micro-batch),
    and its W's in a heap, so a choice costs a few heap operations instead of a scan of all it holds."""

    def __init__(self, stage_ranks: list[int], num_microbatches: int, duration: Duration, timed: bool = False,
                 w_fits_gaps: bool = False, memory: int = 1,
                 lags: tuple[list[float], list[float]] | None = None):
        self.stage_ranks, self.m, self.duration = stage_ranks, num_microbatches, duration
        self.timed = timed  # real durations: keep the memory slots later chunks need (see ``owed``)
        self.w_fits_gaps = w_fits_gaps  # a W only where it ends before the next awaited F/B input
        self.num_stages = len(stage_ranks)
        # per stage, the latency of its F's and of its B's input (0 without a latency or on one rank)
        self.f_lag, self.b_lag = lags or ([0.0] * self.num_stages, [0.0] * self.num_stages)
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
        # when something ends or a message arrives: the only times a waiting rank's choice can change
        self.moments: list[float] = [0.0]

    def run(self) -> Schedule:
        """Every rank's actions in the order it starts them, each stage's OPT last."""
        schedule: Schedule = {r: [] for r in self.stages_of}
        free = dict.fromkeys(schedule, 0.0)
        moments = self.moments
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
                ready = self.end.get((Kind.F, s - 1, mb), math.inf) + self.f_lag[s] if s > 0 else 0.0
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
        lag = self.f_lag[s + 1] if kind is Kind.F and s + 1 < self.num_stages else (
            self.b_lag[s - 1] if kind is Kind.B and s > 0 else 0.0)
        if lag:
            heapq.heappush(self.moments, end + lag)
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
                heapq.heappush(self.pending[s - 1], (end + self.b_lag[s - 1], mb))
        else:
            heapq.heappop(self.before_w[s])
            self.held[self.stage_ranks[s]] -= 1
        return end
