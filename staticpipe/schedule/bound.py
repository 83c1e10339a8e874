"""The shortest step any schedule could have on a layout: what a generated plan is measured against.

Why this bound: a rank runs one action at a time, so it is busy at least its own work -- every
micro-batch's F, B and W of each stage it holds -- and it cannot start before the first micro-batch's
forward has come down the stages before its first one (the unavoidable fill: their F's, and the
latency of each link crossed). When the backward is not split, the last backward a rank runs is a B
whose gradient still has to go back through the stages before it (their B's, and links), which no order
avoids either; with W split off, a rank may end on a W that nobody waits for, so that tail is not
forced. The bound is the largest of these over the ranks -- ``m (F + B + W)`` per device plus the fill
-- and of one micro-batch's own path (every F, every B back, its W), which decides when m is small.
It ignores the memory limits that make it unreachable for most families (ZB-H1 reaches it at unit
costs, ``3m + p - 1``), which is why a plan is shown beside it rather than held to it.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .actions import Action, B, F, W
from .latency import Latency, stage_lags


def step_bound(stage_ranks: Sequence[int], num_microbatches: int, duration: Callable[[Action], float],
               latency: Latency | None = None, split_backward: bool = True) -> float:
    """The bound above for stage ``s`` on rank ``stage_ranks[s]``, actions priced by ``duration`` (of
    micro-batch 0's actions: a price per stage and kind), messages by ``latency``."""
    n = len(stage_ranks)
    f_lag, b_lag = stage_lags(list(stage_ranks), n, latency)
    f = [duration(F(s, 0)) for s in range(n)]
    b = [duration(B(s, 0)) for s in range(n)]
    w = [duration(W(s, 0)) if split_backward else 0.0 for s in range(n)]
    reach = [0.0] * n  # when stage s's first F can start at the earliest
    for s in range(1, n):
        reach[s] = reach[s - 1] + f[s - 1] + f_lag[s]
    back = [0.0] * n  # after stage s's B, what the gradient still has to go through
    for s in range(1, n):
        back[s] = back[s - 1] + b[s - 1] + b_lag[s - 1]
    end = reach[n - 1] + f[n - 1]  # one micro-batch's path: down the stages and back
    bound = 0.0
    for s in reversed(range(n)):
        end += b[s] + (b_lag[s] if s < n - 1 else 0.0)
        bound = max(bound, end + w[s])
    for r in dict.fromkeys(stage_ranks):
        mine = [s for s in range(n) if stage_ranks[s] == r]
        work = num_microbatches * sum(f[s] + b[s] + w[s] for s in mine)
        tail = 0.0 if split_backward else min(back[s] for s in mine)
        bound = max(bound, min(reach[s] for s in mine) + work + tail)
    return bound
