"""ZB-V orders found by playing the V out in time, rank by rank (the rules after Qi et al.'s ZB-V).

Why: ZB-V's bubbles sit in the warm-up (before a rank's first backward) and wherever a rank waits
for a neighbour; the W's (weight gradients), which need nothing from other ranks, are what can fill
the waits. A fixed pattern cannot know how long a wait is under uneven costs and message latencies;
playing the order out with the real durations can. Every action is timed the moment it is placed:
it starts at the later of its rank's clock and its input's end plus the link's latency, the eager
timing ``simulate`` gives it, so the makespan the search reports is the simulated one.

The V puts stages ``r`` and ``2p-1-r`` on rank ``r``. On a rank, a micro-batch takes four steps in
turn: the first chunk's F (its input from rank r-1), the second chunk's F (from rank r+1, or the
rank's own first-chunk F on the last rank), the second chunk's B (from rank r-1, or its own F on
rank 0) and the first chunk's B (from rank r+1, or its own second-chunk B on the last rank).

The rules, in the order the plan is built:

1. warm-up. Every rank runs one first-chunk F. Then, from the last rank down, rank ``r`` runs its
   first second-chunk F, which comes back from rank r+1; until then it takes first-chunk F's
   (each bringing the ranks before it up to it, as they supply its input) while one started at its
   clock ends before that return, since an idle rank there is pure bubble. Memory bounds them: rank r's first
   backward reaches it r hops after rank 0's, and on each hop it still takes a forward of each chunk
   (two activations), besides its own first second-chunk F and one spare forward: it keeps a reserve
   of ``2 + 2r`` of the ``max_mem`` activations (1F1B's ``2p`` chunk activations).
2. top-up. The steady state needs every rank one round behind the rank before it: as many forwards
   as it, and more of the second chunk (which flows from the last rank down). The ranks take
   forwards of the two chunks alternately, in rounds; rank r takes every round rank r-1 took and
   then more until it has caught up (never beyond ``max_mem``).
3. steady state, one round per backward. Each rank runs one B, then one F. Of the B's, the first
   chunk's goes ahead when it is due and its input was already placed (or no second-chunk B is
   left); else the second chunk's. Of the F's, the second chunk's goes ahead when its input was
   placed, then the first chunk's (at once when no second-chunk F is open; else only once its input
   was placed); else the rank takes no F this round. Before a step that waits for another rank, the
   rank runs the W's that end before the input arrives (free: it would idle), and one more when the
   wait would exceed its idle budget: the worst idle time of any rank so far, less its own -- a wait
   no worse than some rank already has costs nothing, as that rank bounds the step anyway. Before an
   F it runs W's until the activation fits in ``max_mem``.
4. the W's left.

Why it is retried: a pass learns each rank's idle time; the next pass gives each rank an idle budget
of at least the worst of them minus its own, so the ranks that idled little wait instead of taking a
W early, which usually lowers the worst idle time. Passes go on while it drops. Two switches (the
extra W allowed before second-chunk B's, before F's) give four variants; every pass of every variant
is a candidate for the caller, which keeps the shortest.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable

from .actions import OPT, Action, B, F, Schedule, W

Duration = Callable[[Action], float]

V_VARIANTS = ((True, True), (True, False), (False, True), (False, False))  # (extra W before B2, before F)

# a micro-batch's steps on a rank, in the order it takes them
FIRST_F, SECOND_F, SECOND_B, FIRST_B = range(4)
_FORWARD = (True, True, False, False)
_SECOND_CHUNK = (False, True, True, False)
_FROM_BELOW = (True, False, True, False)  # its input comes from rank r-1 (else from rank r+1)


class _NoOrder(Exception):
    """The rules reach a state they do not cover (e.g. very few micro-batches): no order from this pass."""


def v_search(num_ranks: int, m: int, duration: Duration, f_lag: list[float], b_lag: list[float],
             max_mem: int, max_passes: int = 8, variants=V_VARIANTS) -> list[tuple[float, Schedule]]:
    """Candidates (makespan, schedule) of every pass of every variant (see ``V_VARIANTS``); ``f_lag`` and
    ``b_lag`` per stage as ``latency.stage_lags`` gives them; ``max_mem`` chunk activations per rank."""
    found = []
    for extra_b, extra_f in variants:
        idle_seen, lowest = None, math.inf
        for _ in range(max_passes):
            play = _Play(num_ranks, m, duration, (f_lag, b_lag), max_mem, extra_b, extra_f, idle_seen)
            try:
                play.run()
            except _NoOrder:
                break
            found.append((play.makespan(), play.schedule()))
            if play.worst >= lowest:
                break
            lowest, idle_seen = play.worst, list(play.idle)
    return found


class _Play:
    """One pass: per step and rank the ends of the micro-batches placed; per rank its clock, the
    activations it holds, its idle time, the W's it owes and its order."""

    def __init__(self, p, m, duration, lags, max_mem, extra_b, extra_f, idle_seen):
        self.p, self.m, self.duration, self.lags, self.max_mem = p, m, duration, lags, max_mem
        self.extra_w = (extra_f, extra_f, extra_b, True)  # per step: one W beyond the wait allowed
        self.ends = [[[] for _ in range(p)] for _ in range(4)]
        self.clock, self.held, self.idle = [0.0] * p, [0] * p, [0.0] * p
        self.worst = 0.0  # the largest idle time so far
        self.owed = [deque() for _ in range(p)]  # W's whose B has run, oldest first
        self.order: list[list[Action]] = [[] for _ in range(p)]
        idle_seen = idle_seen or [0.0] * p
        self.slack = [max(idle_seen) - t for t in idle_seen]
        self.feeds = [[self.feeder(step, r) for r in range(p)] for step in range(4)]

    # -- state ---------------------------------------------------------------------------------------
    def count(self, step, r):
        return len(self.ends[step][r])

    def stage(self, step, r):
        return 2 * self.p - 1 - r if _SECOND_CHUNK[step] else r

    def feeder(self, step, r):
        """The ends of the rank that feeds rank r's ``step`` and its link's latency; None: the rank itself."""
        src = r - 1 if _FROM_BELOW[step] else r + 1
        if not 0 <= src < self.p:
            return None, 0.0
        return self.ends[step][src], self.lags[not _FORWARD[step]][self.stage(step, r)]

    def arrival(self, step, r):
        """When the input of rank r's next ``step`` arrives: -inf if it comes from the rank itself,
        None if the rank producing it has not placed it yet."""
        produced, lag = self.feeds[step][r]
        if produced is None:
            return -math.inf
        mb = len(self.ends[step][r])
        return produced[mb] + lag if mb < len(produced) else None

    # -- placing -------------------------------------------------------------------------------------
    def place(self, step, r):
        mb = self.count(step, r)
        if mb >= self.m or (step and self.count(step - 1, r) <= mb):
            raise _NoOrder
        if _FORWARD[step] and self.held[r] >= self.max_mem:
            raise _NoOrder
        ready = self.arrival(step, r)
        if ready is None:
            raise _NoOrder
        a = (F if _FORWARD[step] else B)(self.stage(step, r), mb)
        start = max(self.clock[r], ready)
        if self.order[r]:  # idle time counts from the rank's first action on
            self.idle[r] += start - self.clock[r]
            self.worst = max(self.worst, self.idle[r])
        self.clock[r] = start + _checked(self.duration(a), a)
        self.ends[step][r].append(self.clock[r])
        self.order[r].append(a)
        if _FORWARD[step]:
            self.held[r] += 1
        else:
            self.owed[r].append(W(a.stage, mb))

    def place_w(self, r):
        w = self.owed[r].popleft()
        self.clock[r] += _checked(self.duration(w), w)
        self.held[r] -= 1
        self.order[r].append(w)

    def fill_wait(self, step, r):
        """The W's rank r runs before ``step`` while it waits for another rank's input."""
        ready, owed = self.arrival(step, r), self.owed[r]
        if ready is None or ready == -math.inf:
            return
        while owed and self.clock[r] + self.duration(owed[0]) <= ready:
            self.place_w(r)
        budget = max(self.worst, self.slack[r]) - self.idle[r]
        if owed and self.extra_w[step] and ready - self.clock[r] > budget:
            self.place_w(r)

    # -- the phases ----------------------------------------------------------------------------------
    def run(self):
        self.warm_up()
        self.top_up()
        for _ in range(2 * self.m):
            self.steady_round()
        for r in range(self.p):
            while self.owed[r]:
                self.place_w(r)

    def warm_up(self):
        self.pull_first(self.p - 1)
        for r in reversed(range(self.p)):
            while self.room_for_first(r):
                self.pull_first(r)
            self.place(SECOND_F, r)

    def pull_first(self, r):
        """One more first-chunk F on rank r, after those on the ranks before it that it waits for."""
        low = r
        while low and self.count(FIRST_F, low - 1) <= self.count(FIRST_F, r):
            low -= 1
        for s in range(low, r + 1):
            self.place(FIRST_F, s)

    def room_for_first(self, r):
        """Whether rank r takes another first-chunk F before its first second-chunk F (rule 1): one
        started now ends before the second chunk comes back, and it leaves the reserve free."""
        if r == self.p - 1:  # its second chunk follows its first at once
            return False
        n = self.count(FIRST_F, r)
        return (n < min(self.m, self.max_mem - 1 - 2 * r)
                and self.clock[r] + self.duration(F(r, n)) <= self.arrival(SECOND_F, r))

    def top_up(self):
        rounds, counts = [0] * self.p, (self.count(FIRST_F, 0), self.count(SECOND_F, 0))
        for r in range(1, self.p):
            rounds[r], counts = self.catch_up(r, rounds[r - 1], counts)
        for k in range(max(rounds)):
            step = (FIRST_F, SECOND_F)[k % 2]
            for r in reversed(range(self.p)):  # second-chunk inputs come from rank r+1
                if rounds[r] > k and self.count(step, r) < self.m and self.held[r] < self.max_mem:
                    self.place(step, r)

    def catch_up(self, r, least, before):
        """The rounds of the top-up rank r takes (at least ``least``, those of rank r-1), given rank
        r-1's forwards ``before`` = (first, second chunk) after them; and rank r's after them."""
        have, rounds, stalled = [self.count(FIRST_F, r), self.count(SECOND_F, r)], 0, 0
        while rounds < least or not (sum(have) >= sum(before) and (have[1] > before[1] or before[1] >= self.m)):
            chunk = rounds % 2
            if have[chunk] < self.m and sum(have) < self.max_mem:
                have[chunk], stalled = have[chunk] + 1, 0
            else:
                stalled += 1
            rounds += 1
            if stalled == 2 and rounds >= least:  # memory full: it cannot catch up
                break
        return rounds, tuple(have)

    def steady_round(self):
        p = self.p
        backward = [self.pick_backward(r) for r in range(p)]
        for step in (FIRST_B, SECOND_B):
            for r in (range(p) if _FROM_BELOW[step] else reversed(range(p))):  # as the inputs flow
                if backward[r] == step:
                    self.fill_wait(step, r)
                    self.place(step, r)
        for r in range(p):  # first-chunk inputs come from rank r-1
            step = self.pick_forward(r)
            if step is None:
                continue
            while self.held[r] >= self.max_mem:
                if not self.owed[r]:
                    raise _NoOrder
                self.place_w(r)
            self.fill_wait(step, r)
            self.place(step, r)

    def pick_backward(self, r):
        """Rank r's B this round (rule 3), from what was placed before the round."""
        due = self.count(FIRST_B, r) < self.count(SECOND_B, r)
        if due and (self.arrival(FIRST_B, r) is not None or self.count(SECOND_B, r) >= self.m):
            return FIRST_B
        return SECOND_B

    def pick_forward(self, r):
        """Rank r's F this round (rule 3), or None."""
        first, second = self.count(FIRST_F, r), self.count(SECOND_F, r)
        if second >= self.m:
            return None
        if second < first and self.arrival(SECOND_F, r) is not None:
            return SECOND_F
        if first < self.m and (second >= first or self.arrival(FIRST_F, r) is not None):
            return FIRST_F
        return None

    # -- results -------------------------------------------------------------------------------------
    def makespan(self):
        last = 2 * self.p - 1
        return max(self.clock[r] + self.duration(OPT(r)) + self.duration(OPT(last - r)) for r in range(self.p))

    def schedule(self) -> Schedule:
        last = 2 * self.p - 1
        return {r: acts + [OPT(r), OPT(last - r)] for r, acts in enumerate(self.order)}


def _checked(seconds: float, a: Action) -> float:
    if seconds < 0:
        raise ValueError(f"costs give action {a} a negative duration ({seconds})")
    return seconds
