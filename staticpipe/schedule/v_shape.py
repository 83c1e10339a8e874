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

import itertools
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
    if any(a.kind is Kind.W for a in slots):
        return slots
    taken = {t: a for a, t in slots.items()}
    out, pending, t, end = dict(slots), [], 0, max(taken, default=-1)
    while t <= end or pending:
        a = taken.get(t)
        if a is not None and a.kind is Kind.B:
            pending.append(W(a.stage, a.microbatch))
        elif a is None and pending:
            out[pending.pop(0)] = t
        t += 1
    return out


def rank_peak(slots: Slots) -> int:
    """Most chunk activations the rank holds at once (F run, W not), its W's in free slots if not placed."""
    return max(_live_counts(with_weights(slots)))


def _inputs(a: Action, num_stages: int) -> list[Action]:
    """What must run before ``a``: its input, and the same kind of action of the previous micro-batch on
    its stage (micro-batches keep their order, so the W's stay in the order of their B's)."""
    if a.kind is Kind.F:
        needs = [F(a.stage - 1, a.microbatch)] if a.stage > 0 else []
    elif a.kind is Kind.B:
        needs = [B(a.stage + 1, a.microbatch) if a.stage < num_stages - 1 else F(a.stage, a.microbatch)]
    else:
        needs = [B(a.stage, a.microbatch)]
    return needs + ([Action(a.kind, a.stage, a.microbatch - 1)] if a.microbatch > 0 else [])


def _squeeze(slots: dict[int, Slots], layout: list[int], drain_only: bool = False) -> None:
    """Move each action, in time order, to the earliest free slot of its rank after its inputs' slots
    where the rank's peak memory stays within what it was. In time order, an action's inputs have
    already moved. ``drain_only``: only the actions after the rank's last F, and the W's not placed.

    Why two ways to check the peak: with the W's placed (the first pass) only an F moving up can raise
    it, holding one more activation over the slots it skips, so counts of live activations per slot
    answer at once. Without them a move shifts the W's, and the peak is counted again; that pass is
    kept to the drain because elsewhere its free slots are the W's own, which no move may take without
    raising the peak: only in the drain does taking the W's out let a B move up (and counting for every
    steady action would take seconds for p = 8, m = 64)."""
    at = {a: t for s in slots.values() for a, t in s.items()}
    taken = {r: set(s.values()) for r, s in slots.items()}
    budget = {r: rank_peak(s) for r, s in slots.items()}
    live = {} if drain_only else {r: _live_counts(s) for r, s in slots.items()}
    start = {r: max(t for a, t in s.items() if a.kind is Kind.F) if drain_only else -1 for r, s in slots.items()}
    for a in sorted(at, key=lambda a: (at[a], layout[a.stage])):
        r, was = layout[a.stage], at[a]
        ready = max((at[n] + 1 for n in _inputs(a, len(layout)) if n in at), default=0)
        for t in range(ready, was if was > start[r] else ready):
            if t in taken[r]:
                continue
            slots[r][a] = t
            fits = rank_peak(slots[r]) <= budget[r] if drain_only else _fits(live[r], a, t, was, budget[r])
            if fits:
                taken[r].symmetric_difference_update((was, t))
                at[a] = t
                break
            slots[r][a] = was


def _live_counts(slots: Slots) -> list[int]:
    """Activations held after each time slot, the W's as placed."""
    change = [0] * (max(slots.values(), default=0) + 1)
    for a, t in slots.items():
        change[t] += (a.kind is Kind.F) - (a.kind is Kind.W)
    return list(itertools.accumulate(change))


def _fits(live: list[int], a: Action, to: int, was: int, budget: int) -> bool:
    """Whether moving ``a`` from slot ``was`` up to ``to`` keeps the peak within ``budget``; if so,
    ``live`` is updated for the move (an F holds its activation over the skipped slots, a W frees it)."""
    if a.kind is Kind.F and max(live[to:was]) + 1 > budget:
        return False
    for t in range(to, was):
        live[t] += (a.kind is Kind.F) - (a.kind is Kind.W)
    return True
