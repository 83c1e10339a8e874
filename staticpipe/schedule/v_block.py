"""V-Min and V-Half orders other than ``v_shape``'s, for given costs and latency, and the eager timing
that picks the shortest.

``v_shape`` squeezes every action of the repeated building block to the earliest free slot at unit
time, each rank within its own peak. At unit costs that is about as short as it gets, but once F, B
and W cost different amounts, which order of the same block is shortest changes: moving an action up
a slot at unit time trades one rank's idle slot for another's, and at B = 2 F the trade can lose. The
building block's steady state keeps every rank busy whatever the costs, so one order here keeps it as
the block has it and squeezes only the fill and the drain (the construction of Qi et al., "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024):

1. W's in the block's free slots in the order of their B's; the fill (everything before the first
   micro-batch's last B) and the drain (everything after the first rank's last F) squeezed, each action
   to the earliest free slot after its inputs where no rank's peak exceeds the highest rank's, a rank's
   W's an anonymous queue (its k-th W after its k-th B, whichever that is by then);
2. the order timed at unit costs (each action as early as its inputs and its rank allow) and the drain
   squeezed once more with the W's taken out (they go back in the free slots, in B order);
3. timed at unit costs again, the W's put back in the free slots, each chunk's W's in the order of its
   B's, the later chunk's (the one whose B comes first) served first.

Three more orders vary steps 1 and 2: step 2 moving only the B's after each rank's last F (as
``v_shape``'s drain does), and step 1 squeezing every action. They cost little next to ``v_shape``'s
own squeeze, and on the grid of 2-16 ranks, p-64 micro-batches and six F:B:W:latency mixes each was
the shortest somewhere (V-Min: every action squeezed in step 1, up to 16 % shorter than the other
orders; V-Half: up to 2 %). Up to ``FULL`` each order is also tried with its W's run while the rank
waits for an input (``idle_weights``), never later than the order runs them; beyond, where the fill
and the drain are a small part of the step, only the first two orders are (see ``shortest``).

Why picking is exact and cheap: ``eager`` times an order (ids in slots) at the given costs and latency
the way ``simulate`` runs a schedule -- each rank its actions in order, each as early as its input
(plus the latency from another rank) and its rank allow -- a slot column at a time, since an action's
input always sits in an earlier slot. ``v_shape`` keeps the shortest, its own order on ties. The
first order here is action for action the one the paper's authors' scheduler gives (compared at 2-16
ranks, 1-64 micro-batches), and theirs is the same whatever the costs (they reorder at unit time
and only then time the order), so under any costs and latency the plan is no longer than theirs.
Every order holds at most the highest rank's peak of the building block (checked: one that holds more
than ``v_shape``'s order is passed over), so each is within the family's memory.
"""
from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Callable

from .actions import OPT, Kind
from .latency import Latency, stage_lags
from .simulate import simulate
from .v_squeeze import FREE, in_time_order, move_up, queue_counts, squeeze_drain, squeeze_start, with_weights
from .zero_bubble import zb_v

FULL = 8192  # (stage, micro-batch) pairs up to which ``shortest`` tries every order and ``idle_weights``


def block_orders(occ, width: int, n: int, m: int, everything: bool = True):
    """The orders made from the building block (``occ``: F and B ids in slots), as ranks x slots arrays of
    all ids: first the block with its steady state kept (steps 1-3 above), then with step 2's squeeze
    moving only the B's after each rank's last F, then (``everything``) both again with every action
    squeezed in step 1."""
    import numpy as np
    nm = n * m
    with_w = with_weights(occ, nm)
    fill, drain = _phases(with_w, n, m)
    unit = inputs(n, m)
    for movable in (fill | drain, with_w != FREE)[:1 + everything]:
        start = eager(_place(_squeeze_shared(with_w, movable, n, m), 3 * nm, n, m, width), unit)[0]
        timed = start.astype(np.int64).tolist() + [-1]
        fb = _place(timed, 2 * nm, n, m, width)
        for tail in (_phases(fb, n, m)[1], None):  # None: ``squeeze_drain``'s own, the B's after the last F
            at = list(timed)
            squeeze_drain(fb, at, n, m, tail, shared=True)
            start = eager(with_weights(_place(at, 2 * nm, n, m, width), nm), unit)[0]
            yield _weights_by_chunk(_place(start.astype(np.int64).tolist(), 2 * nm, n, m, width), n, m)


def _squeeze_shared(occ, movable, n: int, m: int) -> list[int]:
    """``v_squeeze.squeeze_packed`` for the ids ``movable`` marks, every rank's peak allowed to reach the
    highest rank's, and the W's a rank's anonymous queue: its k-th W goes after its k-th B (whichever
    that is by then) and after its (k-1)-th W. The slot of every id, and -1 last."""
    import numpy as np
    nm = n * m
    at, slack, free = squeeze_start(occ, nm, shared=True)
    is_w = occ >= 2 * nm
    w_index = np.cumsum(is_w, axis=1) - 1  # at a W's slot: how many W's of its rank come before it
    w_slots = [np.flatnonzero(row).tolist() for row in is_w]  # the k-th W's slot, by rank
    b_slots = [np.flatnonzero(row).tolist() for row in (occ >= nm) & ~is_w]  # the B's slots, sorted
    for a, was, r, first, previous in in_time_order(occ, movable, n, m):
        if a >= 2 * nm:
            k = int(w_index[r, was])
            ready = max(b_slots[r][k], w_slots[r][k - 1] if k else -1) + 1
        else:
            ready = max(at[first], at[previous]) + 1
        if ready >= was or (t := move_up(a, ready, was, free[r], slack[r], nm)) is None:
            continue
        at[a] = t
        if a >= 2 * nm:
            w_slots[r][k] = t
        elif a >= nm:
            bs = b_slots[r]
            del bs[bisect.bisect_left(bs, was)]
            bisect.insort(bs, t)
    return at


def _place(at: list[int], count: int, n: int, m: int, width: int):
    """The ranks x slots array of the ids below ``count`` at their slots ``at``, the other slots free."""
    import numpy as np
    a = np.arange(count)
    stage = a // m % n
    occ = np.full((n // 2, width), FREE)
    occ[np.minimum(stage, n - 1 - stage), np.array(at[:count], dtype=np.int64)] = a
    return occ


def _phases(occ, n: int, m: int):
    """Masks of the fill and the drain of ``occ``: the actions in time order (slot, then rank) before the
    first micro-batch's B on stage 0, and those after the first F of chunk 0 of the last micro-batch
    that comes at or after that B (none if there is no such F)."""
    import numpy as np
    p = n // 2
    key = np.arange(occ.shape[1])[None, :] * p + np.arange(p)[:, None]  # time order
    held = occ != FREE
    first_b = int(key[occ == n * m][0])  # B(0, 0): rank 0
    last_f = held & (occ < p * m) & (occ % m == m - 1) & (key >= first_b)  # F(s < p, m - 1)
    end = int(key[last_f].min()) if last_f.any() else int(key.max()) + 1
    return held & (key < first_b), held & (key > end)


def _weights_by_chunk(occ, n: int, m: int):
    """``occ`` (F and B ids) with the W's in the free slots, each chunk's in the order of its B's, chunk
    1's first when both wait. Why two queues one after the other: chunk 1's W's take the free slots as
    if chunk 0's did not exist, and chunk 0's take the free slots left (``v_squeeze.queue_counts`` each)."""
    import numpy as np
    nm = n * m
    is_b = (occ >= nm) & (occ < 2 * nm)
    later = is_b & (occ // m % n >= n // 2)
    free = occ == FREE
    out = occ.copy()
    for mine in (later, is_b & ~later):
        placed = np.diff(queue_counts(mine, free)[1], axis=1) > 0
        out[placed] = occ[mine] + nm  # row by row, in time order: the k-th W slot of a rank is its k-th B's
        free &= ~placed
    return out


def inputs(n: int, m: int, lags: tuple[list[float], list[float]] | None = None):
    """Per id (and a last entry, ``eager``'s "no input"), its input's id and the latency it waits on
    top of that input's end: ``lags`` per stage for the F's and for the B's input (None: none)."""
    import numpy as np
    nm = n * m
    a = np.arange(3 * nm)
    kind, stage = a // nm, a // m % n
    inp = np.where(kind == 0, np.where(stage > 0, a - m, 3 * nm),
                   np.where((kind == 1) & (stage < n - 1), a + m, a - nm))
    lag = np.zeros(3 * nm + 1)
    if lags is not None:
        f_lag, b_lag = (np.asarray(x, dtype=float) for x in lags)
        lag[:3 * nm] = np.where(kind == 0, f_lag[stage], np.where(kind == 1, b_lag[stage], 0.0))
    return inp, lag


def eager(occ, links, cost=None, opt: list[float] | None = None):
    """Each id's start and the makespan when every rank runs ``occ``'s ids in slot order, each as early as
    its input (plus the input's latency, ``links`` from ``inputs``) and its rank allow: ``cost`` per id
    (None: 1 each), ``opt`` per rank what its OPTs add at its end. Slot by slot: an action's input sits
    in an earlier slot."""
    import numpy as np
    inp, lag = links
    size = len(lag)
    cost = np.ones(size) if cost is None else cost
    end, start, free = np.zeros(size), np.zeros(size), np.zeros(occ.shape[0])
    slot, rank = np.nonzero((occ != FREE).T)
    ids = occ[rank, slot]
    cuts = [0, *(np.flatnonzero(np.diff(slot)) + 1).tolist(), len(slot)]
    for lo, hi in zip(cuts, cuts[1:]):
        g, r = ids[lo:hi], rank[lo:hi]
        s = np.maximum(free[r], end[inp[g]] + lag[g])
        start[g] = s
        free[r] = end[g] = s + cost[g]
    if opt is not None:
        free = free + np.asarray(opt)
    return start[:-1], float(free.max(initial=0.0))


def shortest(squeezed, occ, width: int, n: int, m: int, action: list, costs: Callable | None,
             latency: Latency | None):
    """Of ``squeezed`` (``v_shape``'s order), the ``block_orders`` of the block ``occ`` and, up to ``FULL``,
    each of them with ``idle_weights``, the one timed shortest under ``costs`` (per action, None: unit)
    and ``latency``, the first of equals; an order whose peak goes over ``squeezed``'s is passed over.
    And ZB-V's plan (a Schedule) where it fits that peak and is shorter still, else None.
    Beyond ``FULL``, only the first two ``block_orders`` and no ``idle_weights``: at 64 ranks and 512
    micro-batches squeezing every action again takes V-Half 0.6 s (its fill moves every action), and
    with 24-64 ranks and 128-256 micro-batches the orders left out were at most 0.1 % shorter (their
    gains come from the fill and the drain, a small part of a long step)."""
    import numpy as np
    p, nm = n // 2, n * m
    cost = np.ones(3 * nm + 1) if costs is None else np.array([*map(costs, action), 0.0], dtype=float)
    opt = [0.0] * p if costs is None else [costs(OPT(r)) + costs(OPT(n - 1 - r)) for r in range(p)]
    links = inputs(n, m, stage_lags([min(s, n - 1 - s) for s in range(n)], n, latency))
    limit = _peak(squeezed, nm)
    best, best_time = squeezed, eager(squeezed, links, cost, opt)[1]
    for order in [squeezed, *block_orders(occ, width, n, m, nm <= FULL)]:
        timed = [] if order is squeezed else [(eager(order, links, cost, opt)[1], order)]
        if nm <= FULL:
            timed.append(idle_weights(order, links, cost, opt, nm))
        for t, candidate in timed:
            if t < best_time and _peak(candidate, nm) <= limit:
                best, best_time = candidate, t
    return best, (_zb_v_within(p, m, costs, latency, limit, best_time) if limit >= n else None)


def _zb_v_within(p: int, m: int, costs: Callable | None, latency: Latency | None, limit: int, time: float):
    """ZB-V's plan for the same costs and latency if it is shorter than ``time`` and holds at most
    ``limit`` chunk activations on a rank, else None. Why: where the family's peak reaches ZB-V's 2p
    chunk activations (2 ranks: V-Min's and V-Half's 2 micro-batches of a rank) ZB-V's order is as
    good a V-Min as any, and at 2 ranks the building block's orders are up to 25 % longer."""
    plan = zb_v(p, m, costs, latency)
    held = max((max(accumulate((a.kind is Kind.F) - (a.kind is Kind.W) for a in acts), default=0)
                for acts in plan.values()), default=0)
    if held <= limit and simulate(plan, costs, 2 * p, comm=latency).total < time:
        return plan
    return None


def idle_weights(occ, links, cost, opt: list[float], nm: int):
    """``occ``'s order with each rank running its next W's while it waits for an F's or a B's input, and
    its makespan (each rank's actions in a row, in order). A W is never run later than ``occ`` runs it
    (counted in the rank's W's before each F or B), so no rank holds more than there. Why: at unit time
    the W's sit in slots, and at real costs a rank can wait for an input with a W still to run (seen at
    2 ranks, and with latency, up to 5 % shorter)."""
    import numpy as np
    inp, lag = (x.tolist() for x in links)
    cost = cost.tolist()
    rows = [row[row != FREE].tolist() for row in occ]
    weights = [[a for a in row if a >= 2 * nm] for row in rows]
    due = []  # per rank, per F or B in order: the W's run before it in ``occ``
    for row in rows:
        count, due_row = 0, []
        for a in row:
            if a >= 2 * nm:
                count += 1
            else:
                due_row.append(count)
        due.append(due_row[::-1])
    end, ran = [0.0] * len(cost), [False] * len(cost)
    free, next_w = [0.0] * len(rows), [0] * len(rows)
    out: list[list[int]] = [[] for _ in rows]
    for a, r in zip(*_by_slot(occ, 2 * nm)):
        ready, ws, must = end[inp[a]] + lag[a], weights[r], due[r].pop()
        while next_w[r] < len(ws) and (next_w[r] < must or (free[r] < ready and ran[ws[next_w[r]] - nm])):
            w = ws[next_w[r]]
            free[r] = end[w] = free[r] + cost[w]
            out[r].append(w)
            next_w[r] += 1
        free[r] = end[a] = max(free[r], ready) + cost[a]
        ran[a] = True
        out[r].append(a)
    for r, ws in enumerate(weights):
        for w in ws[next_w[r]:]:
            free[r] += cost[w]
            out[r].append(w)
    return max((f + o for f, o in zip(free, opt)), default=0.0), np.array(out, dtype=np.int64)


def _by_slot(occ, below: int):
    """The ids under ``below`` of ``occ`` and their ranks, in time order (slot, then rank)."""
    import numpy as np
    slot, rank = np.nonzero(((occ != FREE) & (occ < below)).T)
    return occ[rank, slot].tolist(), rank.tolist()


def _peak(occ, nm: int) -> int:
    """The most chunk activations a rank of ``occ`` (all ids) holds: its F's so far less its W's so far."""
    import numpy as np
    held = np.cumsum(((occ >= 0) & (occ < nm)).astype(np.int64) - (occ >= 2 * nm), axis=1)
    return int(held.max(initial=0))
