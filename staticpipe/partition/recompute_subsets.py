"""Which sets of recomputed stages ``auto_plan`` prices for one partition and schedule.

Why not every subset: there are 2^stages of them, 65,536 at 16 stages, and each is a memory model and a
simulated step. Up to ``EXHAUSTIVE_UP_TO`` stages every subset is priced, so the report shows each.
Beyond, two facts narrow the choice: recomputing a stage only adds work (its forward runs again before
its backward, so the simulated step of a fixed schedule can only grow), and a device's memory depends
only on which of its own stages recompute. So a fitting set is never beaten by a larger one, and
with one stage per device the fastest fitting set is unique: on each device over its cap, its stage,
and nothing elsewhere -- the set pricing every subset would choose. With two stages per device
(interleaved), a device where either one of its stages would do recomputes the one whose forward costs
less: a rule, since the step is a simulation, not a sum (the other one can be faster by a few percent).
Priced beyond six stages: no stage recomputed alone when it fits; else that, the set above, and every
stage recomputed (the least memory: the closest plan when nothing fits).
"""
from __future__ import annotations

import itertools
from typing import Callable, Mapping, Sequence

EXHAUSTIVE_UP_TO = 6  # stages; 2^6 = 64 subsets


def recompute_subsets(stage_ranks: Sequence[int], whole: bool,
                      over: Callable[[tuple[int, ...]], Mapping[int, float]],
                      forward_cost: Callable[[int], float]) -> list[tuple[int, ...]]:
    """The subsets of stages to price, no recompute first. ``over(recomputed)``: each rank's bytes above
    its cap (<= 0: fits) with those stages recomputed; ``forward_cost(stage)``: what recomputing it adds."""
    p = len(stage_ranks)
    everything = tuple(range(p))
    if whole:
        return [(), everything]
    if p <= EXHAUSTIVE_UP_TO:
        return list(itertools.chain.from_iterable(itertools.combinations(range(p), k) for k in range(p + 1)))
    if all(v <= 0 for v in over(()).values()):
        return [()]  # it fits as it is, and any recompute would only add work
    mine: dict[int, list[int]] = {}
    for stage, rank in enumerate(stage_ranks):
        mine.setdefault(rank, []).append(stage)
    positions = max(len(stages) for stages in mine.values())
    options = [c for k in range(positions + 1) for c in itertools.combinations(range(positions), k)]
    # option o recomputes, on every rank at once, its stages at positions o: one model prices all ranks
    over_by_option = {o: over(tuple(sorted(s[i] for s in mine.values() for i in o if i < len(s)))) for o in options}
    chosen: list[int] = []
    for rank, stages in mine.items():
        usable = [o for o in options if all(i < len(stages) for i in o)]
        fitting = [o for o in usable if over_by_option[o].get(rank, 0) <= 0]
        best = min(fitting, key=lambda o: (len(o), sum(forward_cost(stages[i]) for i in o))) if fitting else usable[-1]
        chosen.extend(stages[i] for i in best)
    return list(dict.fromkeys([(), tuple(sorted(chosen)), everything]))
