"""ZB-H1 / ZB-2P orders built micro-batch by micro-batch, with idle-time budgets.

The heuristic is Qi et al.'s (Zero Bubble pipeline parallelism); this is our statement of it. One
stage per rank (stage s on rank s). Actions are appended to each rank's order and timed as they are
appended: an action starts at the later of its rank's clock and its input's arrival (the producing
action's end plus the link's latency). Every input is appended before its user (the rules below keep
that true), so every time used is one already computed. The rules:

R1 (warm-up) Micro-batch 0 runs F on every stage. The gradient of micro-batch 0 then travels back:
   it reaches stage s when stage s+1 has ended its B (the last stage runs its B right after its F).
   Until then stage s has nothing else to do, so it takes extra F's: as many as fit in memory and in
   that window (timed back to back from its clock) -- ending inside it (``strict``) or merely starting
   inside it. A stage cannot run a forward its predecessor has not sent, and staying one forward
   behind its predecessor lets each extra F arrive while the previous one runs, so the extras are
   capped at the predecessor's minus one (at the predecessor's when that one has sent all ``m``).
   Then B for micro-batch 0, last stage first.
R2 (steady state) Each later round i runs one F on every stage that takes one, first stage first, then
   B for micro-batch i on every stage, last stage first. A stage takes its F unless it, or a later
   stage still owing forwards, holds back (``hold``): a stage two or more forwards ahead of the next
   one holds back unless the F fills time it would otherwise spend waiting for the next stage's
   gradient (expected after that stage's next F and B and the link) -- the F, with the W's it needs to
   free memory, ends before the gradient can arrive, or the wait is beyond the stage's idle budget. A
   stage that has run all its forwards holds no one back.
R3 (W's fill waits) Before an F or B whose input is still in flight, the rank runs owed W's that end
   before the input arrives (free work), and one more if it would still wait and the wait is beyond
   its idle budget (with ``greedy``: in any case). Stage 0 feeds nothing with its B's: once it has
   run all its forwards it runs every W it owes before each B, which keeps the rank busy and so ends
   it no later. A rank that needs memory for an F first runs owed W's (F holds one activation until
   its W frees it).
R4 (drain) The W's still owed run last, oldest first.

Idle budget: the step lasts as long as its slowest rank, so a rank that waits no longer than the most
idle time any rank has already taken (minus its own) costs nothing and keeps its W for a later gap.

Rounds keep inputs ahead of users: B's of a round go last stage first, F's first stage first, every
stage has at least as many forwards as the next one (R1's cap; R2's hold needs a lead of two), and the
last stage, which never holds, takes one F per round, so round i's B's find their F's. The three
switches give the variants of ``H_VARIANTS``; one that cannot keep the memory limit is dropped. The
caller simulates every candidate and keeps the shortest.
"""
from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Callable, Iterable, NamedTuple

from .actions import OPT, Action, B, F, Schedule, W

Duration = Callable[[Action], float]


class HVariant(NamedTuple):
    strict: bool  # R1: an extra warm-up F must end (not just start) before the gradient is back
    hold: bool  # R2: a stage far ahead of the next holds its F back unless it fills a wait
    greedy: bool  # R3: a W runs in any wait, not only in one beyond the idle budget


H_VARIANTS = tuple(HVariant(s, h, g) for s in (True, False) for h in (True, False) for g in (True, False))
H_QUICK = HVariant(strict=True, hold=True, greedy=False)  # the one planned where the whole portfolio is too slow


class NoFit(Exception):
    """The variant cannot keep the memory limit."""


def h_search(num_stages: int, m: int, duration: Duration, f_lag: list[float], b_lag: list[float],
             max_mem: int, variants: Iterable[HVariant] = H_VARIANTS) -> list[Schedule]:
    """One order per variant that keeps ``max_mem`` activations per stage (F holds one until its W);
    ``f_lag[s]`` / ``b_lag[s]``: latency of the F input into stage s / of the B input from stage s+1."""
    found = []
    for variant in variants:
        try:
            found.append(_Rounds(num_stages, m, duration, f_lag, b_lag, max_mem, variant).build())
        except NoFit:
            pass
    return found


class _Rounds:
    """One variant's order, built round by round; per stage: what it has run and when it is free."""

    def __init__(self, n, m, duration, f_lag, b_lag, max_mem, variant: HVariant):
        self.n, self.m, self.duration, self.max_mem, self.variant = n, m, duration, max_mem, variant
        self.lag = {F: f_lag, B: b_lag}
        self.done = {F: [0] * n, B: [0] * n}  # F's and B's run per stage
        self.ends = {F: [[None] * m for _ in range(n)], B: [[None] * m for _ in range(n)]}
        self.free_at = [0.0] * n  # when the rank is done with what it has been given
        self.live = [0] * n  # activations held (F run, W not yet)
        self.idle = [0.0] * n  # time the rank has waited since its first F
        self.most_idle = 0.0  # max(self.idle)
        self.orders: list[list[Action]] = [[] for _ in range(n)]
        self.owed: list[deque[tuple[Action, float]]] = [deque() for _ in range(n)]  # W's owed, priced

    # -- costs and timing
    def cost(self, kind, s, mb) -> float:
        return self.duration(kind(s, mb))

    def arrival(self, kind, s, mb) -> float:
        """When the input of F or B for micro-batch mb reaches stage s (0.0: it has none)."""
        src = s - 1 if kind is F else s + 1
        if not 0 <= src < self.n:
            return 0.0
        end = self.ends[kind][src][mb]
        assert end is not None, "an input is appended before its user"
        return end + self.lag[kind][s]

    def over_budget(self, s, wait) -> bool:
        return wait > self.most_idle - self.idle[s]

    def run(self, s, kind, ready):
        """Append stage s's next F or B (its input arrives at ``ready``) and time it; a B leaves a W owed."""
        done = self.done[kind]
        mb = done[s]
        assert kind is F or self.done[F][s] > mb, "B after its F"
        action = kind(s, mb)
        free = self.free_at[s]
        start = ready if ready > free else free
        if start > free and self.done[F][s]:  # waiting for the pipeline to fill is no rank's idle time
            self.idle[s] += start - free
            self.most_idle = max(self.most_idle, self.idle[s])
        self.free_at[s] = self.ends[kind][s][mb] = start + self.duration(action)
        done[s] = mb + 1
        self.orders[s].append(action)
        if kind is F:
            self.live[s] += 1
        else:
            w = W(s, mb)
            self.owed[s].append((w, self.duration(w)))

    def run_w(self, s):
        """Append stage s's oldest owed W (its input, the B, ran on this rank: it never waits)."""
        action, cost = self.owed[s].popleft()
        self.free_at[s] += cost
        self.live[s] -= 1
        self.orders[s].append(action)

    # -- W's (R3)
    def fill_wait(self, s, ready):
        """R3: W's in the time stage s would wait for an input arriving at ``ready``."""
        owed = self.owed[s]
        while owed and self.free_at[s] + owed[0][1] <= ready:
            self.run_w(s)
        wait = ready - self.free_at[s]
        if owed and wait > 0 and (self.variant.greedy or self.over_budget(s, wait)):
            self.run_w(s)

    def w_to_free(self, s) -> int:
        """How many W's stage s must run before its next F fits in memory (may exceed what it owes)."""
        return max(self.live[s] + 1 - self.max_mem, 0)

    # -- R1
    def warmup_extras(self) -> list[int]:
        """Extra F's per stage in the window before micro-batch 0's gradient is back (R1)."""
        n, strict = self.n, self.variant.strict
        extras = [0] * n
        back = self.ends[F][n - 1][0] + self.cost(B, n - 1, 0)  # the last stage's B for micro-batch 0
        for s in range(n - 2, -1, -1):
            arrive = back + self.lag[B][s]
            t = self.free_at[s]
            room = min(self.max_mem - self.live[s], self.m - self.done[F][s])
            while extras[s] < room:
                d = self.cost(F, s, self.done[F][s] + extras[s])
                if (t + d > arrive) if strict else (t >= arrive):
                    break
                t += d
                extras[s] += 1
            back = max(t, arrive) + self.cost(B, s, 0)
        for s in range(1, n):  # never ahead of the predecessor; one behind while it still has forwards
            sent = extras[s - 1]
            cap = sent if self.done[F][s - 1] + sent == self.m else sent - 1
            extras[s] = max(0, min(extras[s], cap))
        return extras

    # -- R2
    def holds_f(self, s) -> bool:
        """R2's ``hold``: stage s, two or more forwards ahead of stage s+1, keeps its F back."""
        if s == self.n - 1 or self.done[F][s] < self.done[F][s + 1] + 2:
            return False
        nxt = s + 1
        grad_back = (self.free_at[nxt] + self.cost(F, nxt, self.done[F][nxt])
                     + self.cost(B, nxt, self.done[B][nxt]) + self.lag[B][s])
        wait = grad_back - self.free_at[s]
        if wait <= 0:  # the gradient is (about to be) there: run the B, not another F
            return True
        w_first = sum(cost for _, cost in islice(self.owed[s], self.w_to_free(s)))
        if self.cost(F, s, self.done[F][s]) + w_first <= wait:
            return False
        return not self.over_budget(s, wait)

    def takers(self) -> list[bool]:
        """Which stages run an F this round: those with forwards left, unless they or a later stage
        with forwards left hold back (a later stage idle for it would otherwise run ahead of it)."""
        takes = [False] * self.n
        blocked = False
        for s in range(self.n - 1, -1, -1):
            if self.done[F][s] < self.m:
                blocked = blocked or (self.variant.hold and self.holds_f(s))
                takes[s] = not blocked
        return takes

    def place_f(self, s):
        need = self.w_to_free(s)
        if need > len(self.owed[s]):
            raise NoFit
        for _ in range(need):
            self.run_w(s)
        ready = self.arrival(F, s, self.done[F][s])
        if s > 0:
            self.fill_wait(s, ready)
        self.run(s, F, ready)

    def place_b(self, s):
        ready = self.arrival(B, s, self.done[B][s])
        if s == 0 and self.done[F][0] == self.m:
            while self.owed[0]:
                self.run_w(0)
        elif s < self.n - 1:
            self.fill_wait(s, ready)
        self.run(s, B, ready)

    def build(self) -> Schedule:
        n = self.n
        for s in range(n):
            self.place_f(s)
        for s, extra in enumerate(self.warmup_extras()):
            for _ in range(extra):
                self.place_f(s)
        for s in range(n - 1, -1, -1):
            self.place_b(s)
        for _ in range(1, self.m):
            for s, take in enumerate(self.takers()):
                if take:
                    self.place_f(s)
            for s in range(n - 1, -1, -1):
                self.place_b(s)
        for s in range(n):
            while self.owed[s]:
                self.run_w(s)
        return {s: order + [OPT(s)] for s, order in enumerate(self.orders)}
