"""The slot arrays V-Min and V-Half are made in, and the squeeze that moves their actions up.

An order is a ranks x slots array of action ids -- (kind * 2p + stage) * m + micro-batch, kind 0, 1, 2
for F, B, W; ``FREE`` where no action is -- a rank running its actions in slot order. The squeeze moves
each action, in time order, to the earliest free slot of its rank after its inputs where the rank's peak
memory does not grow; the W's go into free slots in the order of their B's.

Why the generation works on integer ids, kept in a ranks x slots array and in flat lists, and makes the Actions only at the end: at 64
ranks and 1024 micro-batches a schedule holds 400 000 actions, each placed and looked up several times, and
dicts keyed by Actions, sorts of them and walks over every slot in Python took seconds. The W's
placement and the counts the squeeze starts from are whole-array steps (``queue_counts``); the moves, which
depend on one another in time order, stay a loop, each a few C-level operations.
"""
from __future__ import annotations

import bisect

FREE = -1  # a slot no action takes, in the ranks x slots array of action ids
KIND_F, KIND_B, KIND_FREE = 0, 1, 2  # the drain's slot kinds
_UP, _DOWN = bytes(range(1, 256)) + b"\0", b"\xff" + bytes(range(255))  # byte + 1, byte - 1 (mod 256)


def occupancy(at: list[int], p: int, m: int, width: int):
    """The ranks x slots array of the F and B ids at their slots ``at``, the other slots free."""
    import numpy as np
    a = np.arange(2 * p * 2 * m)
    stage = a // m % (2 * p)
    occ = np.full((p, width), FREE)
    occ[np.minimum(stage, 2 * p - 1 - stage), np.array(at[:len(a)], dtype=np.int64)] = a
    return occ


def queue_counts(is_b, free):
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


def with_weights(occ, per_kind: int):
    """``occ`` (F and B ids) with every B's W (its id + ``per_kind``) in the first free slot after it,
    the W's in the order of their B's."""
    import numpy as np
    is_b = (occ >= per_kind) & (occ < 2 * per_kind)
    placed = np.diff(queue_counts(is_b, occ == FREE)[1], axis=1) > 0
    out = occ.copy()
    out[placed] = occ[is_b] + per_kind  # row by row, in time order: the k-th W slot of a rank is its k-th B's
    return out


def in_time_order(occ, movable, n: int, m: int):
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


def squeeze_packed(occ, n: int, m: int) -> list[int]:
    """The squeeze with the W's placed (``occ``); the slot of every id, and -1 last. Each action, in time
    order, moves to the earliest free slot of its rank after its inputs' slots where the rank's peak
    memory stays within what it was; in time order, an action's inputs have already moved.

    Why this pass can count the peak at once: with the W's placed only an F moving up can raise it,
    holding one more activation over the slots it skips (a W moving up one fewer, a B none), so the
    slack per slot (``Slack``) tells where an F may go, and the free slots (a sorted list) where
    anything may: a move is a few C-level operations, whatever the distance (the V's fill shifts most
    actions by about 2 p slots, V-Half's every action)."""
    nm = n * m
    at, slack, free = squeeze_start(occ, nm)
    for a, was, r, first, previous in in_time_order(occ, occ != FREE, n, m):
        ready, before = at[first] + 1, at[previous] + 1
        if before > ready:
            ready = before
        if ready < was and (t := move_up(a, ready, was, free[r], slack[r], nm)) is not None:
            at[a] = t
    return at


def move_up(a: int, ready: int, was: int, slots: list[int], slack: "Slack", nm: int) -> int | None:
    """Move action ``a`` from slot ``was`` to the earliest of its rank's free ``slots`` from ``ready`` on
    where the rank's ``slack`` lets it (an F holds one more activation over the slots it skips, a W one
    fewer, a B none); its new slot, or None where it stays."""
    i = bisect.bisect_left(slots, ready)
    if slots[i] >= was:  # nowhere to go: the cheapest test first
        return None
    if a < nm and (full := slack.last_full(ready, was)) >= 0:  # it fits from after the last full slot
        i = bisect.bisect_left(slots, full + 1)
        if slots[i] >= was:
            return None
    t = slots.pop(i)
    bisect.insort(slots, was)
    if a < nm:
        slack.add(t, was, -1)
    elif a >= 2 * nm:
        slack.add(t, was, 1)
    return t


def squeeze_start(occ, nm: int, shared: bool = False) -> tuple[list[int], list["Slack"], list[list[int]]]:
    """What a squeeze of ``occ`` (all ids placed) starts from: the slot of every id (and -1 last), each
    rank's ``Slack`` up to its own peak (``shared``: up to the highest rank's), and each rank's free
    slots up to one past its last action."""
    import numpy as np
    at = np.full(3 * nm + 1, -1)
    rows, cols = np.nonzero(occ != FREE)
    at[occ[rows, cols]] = cols
    live = np.cumsum(((occ != FREE) & (occ < nm)).astype(np.int64) - (occ >= 2 * nm), axis=1)
    top = live.max(initial=0)
    slack = [Slack((top if shared else row.max(initial=0)) - row) for row in live]
    ends = np.where(occ != FREE, np.arange(occ.shape[1]), -1).max(axis=1) + 2
    free = [np.flatnonzero(row[:end] == FREE).tolist() for row, end in zip(occ, ends)]  # the last past all
    return at.tolist(), slack, free


class Slack:
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


def squeeze_drain(occ, at: list[int], n: int, m: int, movable=None, shared: bool = False) -> None:
    """The squeeze once more, the W's taken out (``occ``: F and B ids), for the actions after each
    rank's last F (B's): each, in time order, moves to the earliest free slot after its inputs where the
    rank's peak, its W's put back in the free slots in the order of their B's, stays within what it
    was; ``at`` is updated. Why only the drain: elsewhere the free slots are the W's own, which no move
    may take without raising the peak; only in the drain does taking the W's out let a B move up.
    ``movable`` (F's too) replaces the drain; ``shared`` lets every rank's peak grow to the highest rank's."""
    import numpy as np
    kinds = np.where(occ == FREE, KIND_FREE, occ >= n * m)  # F and B only
    arrived, placed = queue_counts(kinds == KIND_B, kinds == KIND_FREE)
    live = np.zeros_like(arrived)
    np.cumsum(kinds == KIND_F, axis=1, out=live[:, 1:])
    live -= placed
    cols = np.arange(occ.shape[1])
    last_f = np.where(kinds == KIND_F, cols, -1).max(axis=1)
    ends = np.where(occ != FREE, cols, -1).max(axis=1) + 1
    pending = arrived - placed
    budget = max((int(live[r, :e + 1].max()) for r, e in enumerate(ends.tolist())), default=0) if shared else None
    drains = [Drain(kinds[r, :e].tolist(), live[r, :e + 1].tolist(), pending[r, :e + 1].tolist(), budget)
              for r, e in enumerate(ends.tolist())]
    if movable is None:
        movable = (occ != FREE) & (cols > last_f[:, None])
    for a, was, r, first, previous in in_time_order(occ, movable, n, m):
        ready = max(at[first], at[previous]) + 1
        if ready < was and (t := drains[r].move(ready, was)) is not None:
            at[a] = t


class Drain:
    """One rank's slots without W's: ``kinds`` per slot, and before each slot (and after the last) the
    activations ``live`` and the W's ``pending`` when the W's go back in the free slots in the order of
    their B's (a W goes where a slot is free and one is pending; the W's left after the last slot only
    lower the count). A move is priced by sweeping those counts from its new slot until they meet the
    recorded ones again past its old slot: from there on nothing changed."""

    def __init__(self, kinds: list[int], live: list[int], pending: list[int], budget: int | None = None):
        self.kinds, self.live, self.pending = kinds, live, pending
        self.budget = max(live) if budget is None else budget
        self.free = [t for t, k in enumerate(kinds) if k == KIND_FREE]

    def move(self, ready: int, was: int) -> int | None:
        """Move the action at ``was`` to the earliest free slot in [ready, was) that keeps the peak within
        the budget; its slot, or None."""
        free, kinds = self.free, self.kinds
        kind = kinds[was]
        for i in range(bisect.bisect_left(free, ready), bisect.bisect_left(free, was)):
            t = free[i]
            kinds[t], kinds[was] = kind, KIND_FREE
            if (counts := self._sweep(t, was)) is not None:
                self.live[t + 1:t + 1 + len(counts[0])], self.pending[t + 1:t + 1 + len(counts[1])] = counts
                del free[i]
                bisect.insort(free, was)
                return t
            kinds[t], kinds[was] = KIND_FREE, kind
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
