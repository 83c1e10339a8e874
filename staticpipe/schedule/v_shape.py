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

Given the actions' costs or a message latency, the generators plan for them: at other costs another
order of the same block can be shorter, so of this order and those ``v_block`` makes from the block
(its steady state kept and only the fill and the drain squeezed, as the paper's authors do, and
variations of that), each timed under the costs and the latency, the shortest is kept -- or ZB-V's
plan for them, at 2 ranks, where the family holds as much as ZB-V.

The arrays of action ids the orders are made in, and the squeeze, are ``v_squeeze``'s.
"""
from __future__ import annotations

import itertools
from typing import Callable

from ..gc_paused import gc_paused
from .actions import OPT, Action, B, F, Schedule, W
from .latency import Latency
from .v_block import shortest
from .v_squeeze import FREE, occupancy, squeeze_drain, squeeze_packed, with_weights

PERIOD = 6
Offsets = Callable[[int, int, int], tuple[int, int, int, int]]  # (ranks, rank, d) -> F0, F1, B1, B0 offsets


def _v_min(p: int, i: int, d: int) -> tuple[int, int, int, int]:
    return i, 2 * p - 1 - i, 2 * p + d + i, 4 * p + d - 1 - i


def _v_half(p: int, i: int, d: int) -> tuple[int, int, int, int]:
    return 2 * i, 3 * p - 2 - i, 3 * p + d - 1 + 2 * i, 6 * p + d - 2 - i


def v_min(num_ranks: int, num_microbatches: int, costs: Callable[[Action], float] | None = None,
          latency: Latency | None = None) -> Schedule:
    return v_shape(num_ranks, num_microbatches, _v_min, costs, latency)


def v_half(num_ranks: int, num_microbatches: int, costs: Callable[[Action], float] | None = None,
           latency: Latency | None = None) -> Schedule:
    return v_shape(num_ranks, num_microbatches, _v_half, costs, latency)


@gc_paused()  # hundreds of thousands of Actions: see gc_paused
def v_shape(num_ranks: int, num_microbatches: int, offsets: Offsets, costs: Callable[[Action], float] | None = None,
            latency: Latency | None = None) -> Schedule:
    """The building block ``offsets`` repeated ``num_microbatches`` times on ``num_ranks`` ranks in a V.
    With ``costs`` (a duration per action, None: unit) or a ``latency`` (``latency.Latency``), the
    shortest under them of this module's order and ``v_block.block_orders`` (``v_block.shortest``);
    with neither, this module's order."""
    p, m, n = num_ranks, num_microbatches, 2 * num_ranks
    occ, width = _pattern(p, m, offsets)
    action = [make(s, mb) for make in (F, B, W) for s in range(n) for mb in range(m)]  # by id
    squeezed = _squeezed(occ, width, n, m)
    if costs is not None or latency is not None:
        squeezed, plan = shortest(squeezed, occ, width, n, m, action, costs, latency)
        if plan is not None:
            return plan
    return {r: list(map(action.__getitem__, row[row != FREE].tolist())) + [OPT(r), OPT(n - 1 - r)]
            for r, row in enumerate(squeezed)}


def _pattern(p: int, m: int, offsets: Offsets):
    """The building block repeated: the ranks x slots array of the F and B ids (the other slots free), and
    the number of slots, room left for the W's after a rank's last B and a free slot."""
    import numpy as np  # here, not at the top: the schedule package loads without numpy (or Paddle)
    n = 2 * p  # n stages; an id per (kind, stage, micro-batch)
    d = next(d for d in itertools.count()
             if all(len({o % PERIOD for o in offsets(p, i, d)}) == 4 for i in range(p)))
    rank = np.arange(p)
    stage = np.stack([rank, n - 1 - rank, n - 1 - rank, rank], axis=1)  # F chunk 0, F chunk 1, B chunk 1, B chunk 0
    ids = ((np.array([0, 0, 1, 1]) * n + stage) * m)[:, :, None] + np.arange(m)
    slot = np.array([offsets(p, i, d) for i in range(p)])[:, :, None] + PERIOD * np.arange(m)
    width = int(slot.max(initial=0)) + 2 * m + 2  # room for the W's after a rank's last B, and a free slot
    occ = np.full((p, width), FREE)
    occ[rank[:, None, None], slot] = ids
    return occ, width


def _squeezed(occ, width: int, n: int, m: int):
    """This module's order: every action squeezed with the W's placed, the drain once more without them,
    the W's placed in the order of their B's (the ranks x slots array of all ids)."""
    p = n // 2
    at = squeeze_packed(with_weights(occ, n * m), n, m)
    squeeze_drain(occupancy(at, p, m, width), at, n, m)
    return with_weights(occupancy(at, p, m, width), n * m)
