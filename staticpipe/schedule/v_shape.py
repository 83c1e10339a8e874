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

Why the generation below works on integer ids -- (kind * 2p + stage) * m + micro-batch, kind 0, 1, 2 for
F, B, W -- kept in a ranks x slots array and in flat lists, and makes the Actions only at the end: at 64
ranks and 1024 micro-batches a schedule holds 400 000 actions, each placed and looked up several times, and
dicts keyed by Actions, sorts of them and walks over every slot in Python took seconds. The W's
placement and the counts the squeeze starts from are whole-array steps (``_queue``); the moves, which
depend on one another in time order, stay a loop, each a few C-level operations.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable

from ..gc_paused import gc_paused
from .actions import OPT, B, F, Schedule, W

PERIOD = 6
Offsets = Callable[[int, int, int], tuple[int, int, int, int]]  # (ranks, rank, d) -> F0, F1, B1, B0 offsets
FREE = -1  # a slot no action takes, in the ranks x slots array of action ids
KIND_F, KIND_B, KIND_FREE = 0, 1, 2  # the drain's slot kinds
_UP, _DOWN = bytes(range(1, 256)) + b"\0", b"\xff" + bytes(range(255))  # byte + 1, byte - 1 (mod 256)


def _v_min(p: int, i: int, d: int) -> tuple[int, int, int, int]:
    return i, 2 * p - 1 - i, 2 * p + d + i, 4 * p + d - 1 - i


def _v_half(p: int, i: int, d: int) -> tuple[int, int, int, int]:
    return 2 * i, 3 * p - 2 - i, 3 * p + d - 1 + 2 * i, 6 * p + d - 2 - i


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    return v_shape(num_ranks, num_microbatches, _v_min)


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    return v_shape(num_ranks, num_microbatches, _v_half)


@gc_paused()  # hundreds of thousands of Actions: see gc_paused
def v_shape(num_ranks: int, num_microbatches: int, offsets: Offsets) -> Schedule:
    """The building block ``offsets`` repeated ``num_microbatches`` times on ``num_ranks`` ranks in a V."""
    import numpy as np  # here, not at the top: the schedule package loads without numpy (or Paddle)
    p, m, n = num_ranks, num_microbatches, 2 * num_ranks  # n stages; an id per (kind, stage, micro-batch)
    d = next(d for d in itertools.count()
             if all(len({o % PERIOD for o in offsets(p, i, d)}) == 4 for i in range(p)))
    rank = np.arange(p)
    stage = np.stack([rank, n - 1 - rank, n - 1 - rank, rank], axis=1)  # F chunk 0, F chunk 1, B chunk 1, B chunk 0
    ids = ((np.array([0, 0, 1, 1]) * n + stage) * m)[:, :, None] + np.arange(m)
    slot = np.array([offsets(p, i, d) for i in range(p)])[:, :, None] + PERIOD * np.arange(m)
    width = int(slot.max(initial=0)) + 2 * m + 2  # room for the W's after a rank's last B, and a free slot
    occ = np.full((p, width), FREE)
    occ[rank[:, None, None], slot] = ids
    at = _squeeze_packed(_with_weights(occ, n * m), n, m)
    _squeeze_drain(_occupancy(at, p, m, width), at, n, m)
    occ = _with_weights(_occupancy(at, p, m, width), n * m)
    action = [make(s, mb) for make in (F, B, W) for s in range(n) for mb in range(m)]  # by id
    return {r: list(map(action.__getitem__, row[row != FREE].tolist())) + [OPT(r), OPT(n - 1 - r)]
            for r, row in enumerate(occ)}


def _occupancy(at: list[int], p: int, m: int, width: int):
    """The ranks x slots array of the F and B ids at their slots ``at``, the other slots free."""
    import numpy as np
    a = np.arange(2 * p * 2 * m)
    stage = a // m % (2 * p)
    occ = np.full((p, width), FREE)
    occ[np.minimum(stage, 2 * p - 1 - stage), np.array(at[:len(a)], dtype=np.int64)] = a
    return occ


def _queue(is_b, free):
    """W's placed in the free slots, each in the first after its B, in the order of the B's, as counts
    before each slot (ranks x slots + 1): the B's so far ``arrived`` and the W's so far ``placed``. A
    queue served by the free slots, so ``placed`` = min over earlier slots s of (arrived(s) +
    free slots from s on): one cumulative minimum, no walk over the slots."""
    import numpy as np
    arrived = np.zeros((is_b.shape[0], is_b.shape[1] + 1), dtype=np.int64)
    served = arrived.copy()
    np.cumsum(is_b, axis=1, out=arrived[:, 1:])
    np.cumsum(free, axis=1, out=served[:, 1:])
    return arrived, np.minimum.accumulate(arrived - served, axis=1) + served


def _with_weights(occ, per_kind: int):
    """``occ`` (F and B ids) with every B's W (its id + ``per_kind``) in the first free slot after it,
    the W's in the order of their B's."""
    import numpy as np
    is_b = (occ >= per_kind) & (occ < 2 * per_kind)
    placed = np.diff(_queue(is_b, occ == FREE)[1], axis=1) > 0
    out = occ.copy()
    out[placed] = occ[is_b] + per_kind  # row by row, in time order: the k-th W slot of a rank is its k-th B's
    return out


def _in_time_order(occ, movable, n: int, m: int):
    """(id, slot, rank, input, previous) of the ids ``movable`` marks, in time order (a rank runs one
    action per slot, so the slot and the rank order them). ``input`` and ``previous`` are the ids whose
    slots decide the first slot the action may take: after its input, and after the same kind of action
    of the previous micro-batch on its stage (micro-batches keep their order, so the W's stay in the
    order of their B's); -1 where there is none, the slot table's last entry, which is -1."""
    import numpy as np
    slot, rank = np.nonzero(movable.T)
    a = occ[rank, slot]
    kind, stage, mb, nm = a // (n * m), a // m % n, a % m, n * m
    first = np.where(kind == 0, np.where(stage > 0, a - m, -1),  # F: the F of the stage before
                     np.where((kind == 1) & (stage < n - 1), a + m, a - nm))  # B: the B after, or its F; W: its B
    return zip(*(x.tolist() for x in (a, slot, rank, first, np.where(mb > 0, a - 1, -1))))


def _squeeze_packed(occ, n: int, m: int) -> list[int]:
    """The squeeze with the W's placed (``occ``); the slot of every id, and -1 last. Each action, in time
    order, moves to the earliest free slot of its rank after its inputs' slots where the rank's peak
    memory stays within what it was; in time order, an action's inputs have already moved.

    Why this pass can count the peak at once: with the W's placed only an F moving up can raise it,
    holding one more activation over the slots it skips (a W moving up one fewer, a B none), so the
    slack per slot (``_Slack``) tells where an F may go, and the free slots (a sorted list) where
    anything may: a move is a few C-level operations, whatever the distance (the V's fill shifts most
    actions by about 2 p slots, V-Half's every action)."""
    import numpy as np
    nm = n * m
    at = np.full(3 * nm + 1, -1)
    rows, cols = np.nonzero(occ != FREE)
    at[occ[rows, cols]] = cols
    at = at.tolist()
    live = np.cumsum(((occ != FREE) & (occ < nm)).astype(np.int64) - (occ >= 2 * nm), axis=1)
    slack = [_Slack(row.max(initial=0) - row) for row in live]
    ends = np.where(occ != FREE, np.arange(occ.shape[1]), -1).max(axis=1) + 2
    free = [np.flatnonzero(row[:end] == FREE).tolist() for row, end in zip(occ, ends)]  # the last past all
    for a, was, r, first, previous in _in_time_order(occ, occ != FREE, n, m):
        ready, before = at[first] + 1, at[previous] + 1
        if before > ready:
            ready = before
        if ready >= was:
            continue
        slots = free[r]
        i = bisect.bisect_left(slots, ready)
        if slots[i] >= was:  # nowhere to go: the cheapest test first
            continue
        if a < nm and (full := slack[r].last_full(ready, was)) >= 0:  # it fits from after the last full slot
            i = bisect.bisect_left(slots, full + 1)
            if slots[i] >= was:
                continue
        at[a] = t = slots.pop(i)
        bisect.insort(slots, was)
        if a < nm:
            slack[r].add(t, was, -1)
        elif a >= 2 * nm:
            slack[r].add(t, was, 1)
    return at


class _Slack:
    """One rank's slack per slot -- activations it may still take on before its peak grows -- as its
    low byte in a bytearray and the rest in a list. Why: most of the squeeze's moves add 1 to or take 1
    from the slack of some 2 p slots, and each F asks for the last slot in a range with none left; a
    bytearray does both in C (``translate``, ``rfind``) in a fifth of a numpy call's overhead. The list
    changes only where the low byte wraps, which it never does while the peak is under 256."""

    def __init__(self, slack):
        import numpy as np
        self.low = bytearray((slack & 255).astype(np.uint8).tobytes())
        self.high = (slack >> 8).tolist()

    def last_full(self, lo: int, hi: int) -> int:
        """The last slot in [lo, hi) with no slack left, or -1."""
        low, high = self.low, self.high
        j = low.rfind(0, lo, hi)
        while j >= 0 and high[j]:
            j = low.rfind(0, lo, j)
        return j

    def add(self, lo: int, hi: int, step: int) -> None:
        """``step`` (1 or -1) more slack in the slots [lo, hi)."""
        low, wrap = self.low, 255 if step > 0 else 0
        j = low.find(wrap, lo, hi)
        while j >= 0:
            self.high[j] += step
            j = low.find(wrap, j + 1, hi)
        low[lo:hi] = low[lo:hi].translate(_UP if step > 0 else _DOWN)


def _squeeze_drain(occ, at: list[int], n: int, m: int) -> None:
    """The squeeze once more, the W's taken out (``occ``: F and B ids), for the actions after each
    rank's last F (B's): each, in time order, moves to the earliest free slot after its inputs where the
    rank's peak, its W's put back in the free slots in the order of their B's, stays within what it
    was; ``at`` is updated. Why only the drain: elsewhere the free slots are the W's own, which no move
    may take without raising the peak; only in the drain does taking the W's out let a B move up."""
    import numpy as np
    kinds = np.where(occ == FREE, KIND_FREE, occ >= n * m)  # F and B only
    arrived, placed = _queue(kinds == KIND_B, kinds == KIND_FREE)
    live = np.zeros_like(arrived)
    np.cumsum(kinds == KIND_F, axis=1, out=live[:, 1:])
    live -= placed
    cols = np.arange(occ.shape[1])
    last_f = np.where(kinds == KIND_F, cols, -1).max(axis=1)
    ends = np.where(occ != FREE, cols, -1).max(axis=1) + 1
    pending = arrived - placed
    drains = [_Drain(kinds[r, :e].tolist(), live[r, :e + 1].tolist(), pending[r, :e + 1].tolist())
              for r, e in enumerate(ends.tolist())]
    for a, was, r, first, previous in _in_time_order(occ, (occ != FREE) & (cols > last_f[:, None]), n, m):
        ready = max(at[first], at[previous]) + 1
        if ready < was and (t := drains[r].move(ready, was)) is not None:
            at[a] = t


class _Drain:
    """One rank's slots without W's: ``kinds`` per slot, and before each slot (and after the last) the
    activations ``live`` and the W's ``pending`` when the W's go back in the free slots in the order of
    their B's (a W goes where a slot is free and one is pending; the W's left after the last slot only
    lower the count). A move is priced by sweeping those counts from its new slot until they meet the
    recorded ones again past its old slot: from there on nothing changed."""

    def __init__(self, kinds: list[int], live: list[int], pending: list[int]):
        self.kinds, self.live, self.pending = kinds, live, pending
        self.budget = max(live)
        self.free = [t for t, k in enumerate(kinds) if k == KIND_FREE]

    def move(self, ready: int, was: int) -> int | None:
        """Move the B at ``was`` to the earliest free slot in [ready, was) that keeps the peak; its slot, or None."""
        free, kinds = self.free, self.kinds
        for i in range(bisect.bisect_left(free, ready), bisect.bisect_left(free, was)):
            t = free[i]
            kinds[t], kinds[was] = KIND_B, KIND_FREE
            if (counts := self._sweep(t, was)) is not None:
                self.live[t + 1:t + 1 + len(counts[0])], self.pending[t + 1:t + 1 + len(counts[1])] = counts
                del free[i]
                bisect.insort(free, was)
                return t
            kinds[t], kinds[was] = KIND_FREE, KIND_B
        return None

    def _sweep(self, t: int, was: int) -> tuple[list[int], list[int]] | None:
        """The counts after slot ``t`` on that differ from the recorded ones, or None where the peak goes
        over the budget (the peak before ``t`` is within it)."""
        kinds, live, pending, budget = self.kinds, self.live, self.pending, self.budget
        x, y, lives, pendings = live[t], pending[t], [], []
        for u in range(t, len(kinds)):
            k = kinds[u]
            if k == KIND_F:
                x += 1
                if x > budget:
                    return None
            elif k == KIND_B:
                y += 1
            elif y:
                x, y = x - 1, y - 1
            if u >= was and x == live[u + 1] and y == pending[u + 1]:
                break
            lives.append(x)
            pendings.append(y)
        return lives, pendings
