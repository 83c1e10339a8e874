"""V-Min and V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).

The paper builds a schedule by repeating one *building block*: the times at which each rank runs the F
and the B of one micro-batch, the block repeated every ``PERIOD`` = 6 time units (per micro-batch a rank
runs six unit actions: F, B and W of each of its two chunks). Its point: a rank's peak activation memory
is decided by the block's *lifespan* -- how long a chunk's activations stay between its F and its W --
divided by the period, not by how the pipeline fills. On ZB-V's placement (rank r holds the chunks
r and 2p-1-r, so a micro-batch goes down the ranks and back up), the block of rank i at offsets

    V-Min:   F chunk 0 at i,    F chunk 1 at 2p-1-i,  B chunk 1 at 2p+d+i,     B chunk 0 at 4p+d-1-i
    V-Half:  F chunk 0 at 2i,   F chunk 1 at 3p-2-i,  B chunk 1 at 3p+d-1+2i,  B chunk 0 at 6p+d-2-i

runs every F and B one unit after its input (V-Min) or two units after it (V-Half, which gives the
W's room). The lifespans of a rank's two chunks add up to about 4p (V-Min) or 6p (V-Half), so it holds
about 4p / 6 or p chunk activations: a third or a half of 1F1B's p micro-batches of a whole stage (2p
chunks). The published peaks, in micro-batches of a whole rank (two chunks), are (p + 4) // 3 and
(p + 2) // 2. ``d`` shifts the B's until every rank's four offsets fall in different slots of the period
(V-Min: 2 when 3 divides p, V-Half: 3 when p is even, else 0): two actions of a rank cannot share a slot.

The two slots of each period the block leaves free take the W's, in the order of their B's. While the
pipeline fills and drains the repeated block leaves more slots free, so every action then moves to the
earliest free slot after its inputs where the rank's peak does not grow (the paper's "squeeze"):
once with the W's placed, once more without them (W's again filling free slots), then the W's are
placed for good. The slot order is each rank's action order; the runtime and the simulator run the
actions as early as their inputs allow. Idle time per rank then comes to about 2/3 (V-Min) and at
most 1/2 (V-Half) of 1F1B's (the paper's bubble rates), at unit costs. The schedules are valid for any
number of micro-batches; the building block's peak is reached once there are about p or more.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import math
from typing import Callable

from .actions import OPT, Action, B, F, Kind, Schedule, W
from .zero_bubble import zb_v_layout

PERIOD = 6
Offsets = Callable[[int, int, int], tuple[int, int, int, int]]  # (ranks, rank, d) -> F0, F1, B1, B0 offsets
Slots = dict[Action, int]  # one rank's actions -> the time slot each runs in


def _v_min(p: int, i: int, d: int) -> tuple[int, int, int, int]:
    return i, 2 * p - 1 - i, 2 * p + d + i, 4 * p + d - 1 - i


def _v_half(p: int, i: int, d: int) -> tuple[int, int, int, int]:
    return 2 * i, 3 * p - 2 - i, 3 * p + d - 1 + 2 * i, 6 * p + d - 2 - i


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    return v_shape(num_ranks, num_microbatches, _v_min)


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    return v_shape(num_ranks, num_microbatches, _v_half)


def v_shape(num_ranks: int, num_microbatches: int, offsets: Offsets) -> Schedule:
    """The building block ``offsets`` repeated ``num_microbatches`` times on ``num_ranks`` ranks in a V."""
    p, layout = num_ranks, zb_v_layout(num_ranks)
    d = next(d for d in itertools.count()
             if all(len({o % PERIOD for o in offsets(p, i, d)}) == 4 for i in range(p)))
    slots: dict[int, Slots] = {}
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        slots[r] = {a: o + PERIOD * mb for mb in range(num_microbatches)
                    for o, a in zip(offsets(p, r, d), (F(first, mb), F(second, mb), B(second, mb), B(first, mb)))}
        slots[r] = with_weights(slots[r])
    _squeeze(slots, layout)
    slots = {r: {a: t for a, t in s.items() if a.kind is not Kind.W} for r, s in slots.items()}
    _squeeze(slots, layout, drain_only=True)
    placed = {r: with_weights(s) for r, s in slots.items()}
    return {r: sorted(s, key=s.get) + [OPT(r), OPT(2 * p - 1 - r)] for r, s in placed.items()}


def with_weights(slots: Slots) -> Slots:
    """``slots`` with every B's W in the first free slot after it, the W's in the order of their B's."""
    if any(a[0] is Kind.W for a in slots):
        return slots
    taken = {t: a for a, t in slots.items()}
    out, pending, t, end = dict(slots), collections.deque(), 0, max(taken, default=-1)
    while t <= end or pending:
        a = taken.get(t)
        if a is None:
            if pending:
                out[pending.popleft()] = t
        elif a[0] is Kind.B:
            pending.append(W(a[1], a[2]))
        t += 1
    return out


def _ready(kind: Kind, stage: int, mb: int, at: dict[tuple, int], num_stages: int) -> int:
    """The first slot the action may take: after its input, and after the same kind of action of the
    previous micro-batch on its stage (micro-batches keep their order, so the W's stay in the order of
    their B's); inputs not in ``at`` (W's taken out) do not count. ``at`` is keyed by ``Action.key``."""
    if kind is Kind.F:
        ready = at.get((kind, stage - 1, mb), -1) + 1 if stage > 0 else 0
    elif kind is Kind.B:
        ready = at.get((Kind.B, stage + 1, mb) if stage < num_stages - 1 else (Kind.F, stage, mb), -1) + 1
    else:
        ready = at.get((Kind.B, stage, mb), -1) + 1
    if mb > 0:
        before = at.get((kind, stage, mb - 1), -1) + 1
        return before if before > ready else ready
    return ready


def _squeeze(slots: dict[int, Slots], layout: list[int], drain_only: bool = False) -> None:
    """Move each action, in time order, to the earliest free slot of its rank after its inputs' slots
    where the rank's peak memory stays within what it was. In time order, an action's inputs have
    already moved. ``drain_only``: only the actions after the rank's last F, and the W's not placed.

    Why two ways to check the peak: with the W's placed (the first pass) only an F moving up can raise
    it, holding one more activation over the slots it skips, so counts of live activations per slot
    answer at once (``_Packed``). Without them a move shifts the W's, and the peak is counted again
    from the moved slot on (``_Drain``); that pass is kept to the drain because elsewhere its free slots
    are the W's own, which no move may take without raising the peak: only in the drain does taking the
    W's out let a B move up."""
    at = {a[:3]: t for s in slots.values() for a, t in s.items()}  # keyed by Action.key: cheaper to look up
    movers = {r: (_Drain if drain_only else _Packed)(s) for r, s in slots.items()}
    movable = sorted((t, r, a) for r, s in slots.items() for a, t in s.items() if t > movers[r].start)
    num_stages = len(layout)
    for was, r, a in movable:  # in time order (a rank has one action per slot); inputs have moved
        key = a[:3]
        ready = _ready(*key, at, num_stages)
        if ready < was and (t := movers[r].move(a, ready, was)) is not None:
            slots[r][a] = at[key] = t


class _Packed:
    """One rank's slots with its W's placed: an F moving up from ``was`` to ``t`` holds one more
    activation over the slots in between, a W moving up one fewer, a B none; the peak is kept by
    refusing an F wherever that would raise it. The counts are an array, the free slots a sorted list:
    a move is a few C-level operations, whatever the distance (the V's fill shifts most actions by
    about 2 p slots)."""

    start = -1  # every action may move

    def __init__(self, slots: Slots):
        import numpy as np  # here, not at the top: the schedule package loads without numpy (or Paddle)
        self.np = np
        self.live = np.array(_live_counts(slots))
        self.budget = int(self.live.max(initial=0))
        taken = set(slots.values())
        self.free = [t for t in range(len(self.live)) if t not in taken]

    def move(self, a: Action, ready: int, was: int) -> int | None:
        """Move ``a`` to the earliest free slot in [ready, was) that keeps the peak; its slot, or None."""
        lo = ready
        if a[0] is Kind.F and self.live[ready:was].max() >= self.budget:
            # it fits from just after the last slot in range already at the budget
            lo = ready + int(self.np.flatnonzero(self.live[ready:was] >= self.budget)[-1]) + 1
        i = bisect.bisect_left(self.free, lo)
        if i == len(self.free) or self.free[i] >= was:
            return None
        t = self.free.pop(i)
        bisect.insort(self.free, was)
        if a.kind is not Kind.B:
            self.live[t:was] += 1 if a.kind is Kind.F else -1
        return t


class _Drain:
    """One rank's slots without W's, for the drain: a B after the rank's last F moves up to the first
    free slot where the rank's peak, its W's put back in the free slots in the order of their B's
    (``with_weights``), stays within what it was. That placement is a sweep over the slots that needs
    only counts (activations live, W's pending), so the counts before each slot are kept and a move is
    priced by sweeping from its new slot on."""

    def __init__(self, slots: Slots):
        self.start = max((t for a, t in slots.items() if a.kind is Kind.F), default=-1)
        self.end = max(slots.values(), default=-1)
        self.kind_at: list[Kind | None] = [None] * (self.end + 1)
        for a, t in slots.items():
            self.kind_at[t] = a.kind
        self.state = [(0, 0, 0)] * (self.end + 2)  # before each slot: live, W's pending, peak so far
        self._sweep(0)
        self.budget = self.state[-1][2]
        self.free = [t for t, k in enumerate(self.kind_at) if k is None]

    def _sweep(self, u0: int, limit: float = math.inf) -> float:
        """Run the placement from slot ``u0`` on and record the counts (a move is made); its peak.
        ``limit``: only price a move -- record nothing, and stop once the peak is over ``limit``."""
        live, pending, peak = self.state[u0]
        kinds, state, keep = self.kind_at, self.state, limit == math.inf
        for u in range(u0, self.end + 1):
            k = kinds[u]
            if k is Kind.F:
                live += 1
                if live > peak:
                    peak = live
                    if peak > limit:
                        return peak
            elif k is Kind.B:
                pending += 1
            elif pending:  # a W goes here; the W's left after the last slot only lower the count
                pending, live = pending - 1, live - 1
            if keep:
                state[u + 1] = (live, pending, peak)
        return peak

    def move(self, a: Action, ready: int, was: int) -> int | None:
        """Move B ``a`` to the earliest free slot in [ready, was) that keeps the peak; its slot, or None."""
        lo = bisect.bisect_left(self.free, ready)
        hi = bisect.bisect_left(self.free, was)
        for i in range(lo, hi):
            t = self.free[i]
            self.kind_at[t], self.kind_at[was] = a.kind, None
            if self._sweep(t, limit=self.budget) <= self.budget:
                self._sweep(t)
                del self.free[i]
                bisect.insort(self.free, was)
                return t
            self.kind_at[t], self.kind_at[was] = None, a.kind
        return None


def _live_counts(slots: Slots) -> list[int]:
    """Activations held after each time slot, the W's as placed."""
    change = [0] * (max(slots.values(), default=0) + 1)
    for a, t in slots.items():
        change[t] += (a.kind is Kind.F) - (a.kind is Kind.W)
    return list(itertools.accumulate(change))
