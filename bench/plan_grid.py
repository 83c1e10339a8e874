"""The generated plans on a grid of costs, beside the bound no order can beat (``bench/schedules.py --plans``).

No Paddle and no devices: each family's plan for every (ranks, micro-batches, costs, latency) of the grid
is simulated, and printed per family and costs as the plan's step over the bound (``schedule/bound.py``:
work plus the unavoidable fill), its bubble, and the same for the plan made blind (unit costs, no
latency, as every schedule was planned before plans took costs), so the table shows what planning with
the costs buys. Then each family's generation time at 64 ranks and 512 micro-batches with costs.

The grid is the one the Zero Bubble authors' schedulers were compared on: p in {2, 4, 8, 16}, m in
{p, 2p, 3p, 24, 64} (m >= p), F:B:W:comm as below (per stage; a V's chunk is a stage).
"""
from __future__ import annotations

import math
import time

from staticpipe.schedule import get_kind, make_schedule, simulate
from staticpipe.schedule.bound import step_bound
from staticpipe.schedule.latency import link_latency
from staticpipe.schedule.simulate import cost_function

FAMILIES = ["1F1B", "ZB-H1", "ZB-2P", "ZB-V", "V-Min", "V-Half", "DualPipeV"]
COSTS = [(1, 1, 1, 0), (1, 2, 1, 0), (5, 6, 4, 0), (5478, 5806, 3534, 200), (14407, 14380, 9676, 1610), (4, 4, 4, 1)]
RANKS = [2, 4, 8, 16]


def microbatches(p: int) -> list[int]:
    return sorted({m for m in (p, 2 * p, 3 * p, 24, 64) if m >= p})


def priced(name: str, p: int, m: int, cost: tuple, planned: bool) -> tuple[float, float] | None:
    """(step, bubble) of ``name``'s plan under ``cost``, planned with it (``planned``) or blind; None where the
    family does not run (m too small)."""
    kind = get_kind(name)
    f, b, w, comm = cost
    costs = {"F": f, "B": b + (0 if kind.split_backward else w), "W": w}
    chunks = kind.chunks or 1
    aware = planned and kind.cost_aware
    try:
        plan = make_schedule(name, p, m, chunks, costs if aware else None, comm if aware else None)
    except ValueError:
        return None
    sim = simulate(plan, costs, p * chunks, comm=comm)
    return sim.total, sim.bubble


def table() -> None:
    print(f"{'family':<10} {'F:B:W:comm':>22} {'configs':>7} {'plan/bound':>11} {'worst':>6} {'bubble':>7}   "
          f"{'blind/bound':>11} {'worst':>6} {'bubble':>7}   {'shorter than blind':>18}")
    for name in FAMILIES:
        kind = get_kind(name)
        for cost in COSTS:
            rows = []
            for p in RANKS:
                for m in microbatches(p):
                    got, blind = priced(name, p, m, cost, True), priced(name, p, m, cost, False)
                    if got is None:
                        continue
                    f, b, w, comm = cost
                    price = cost_function({"F": f, "B": b + (0 if kind.split_backward else w), "W": w})
                    bound = step_bound(kind.layout(p, kind.chunks or 1), m, price, link_latency(comm),
                                       kind.split_backward)
                    rows.append((got[0] / bound, got[1], blind[0] / bound, blind[1]))
            if not rows:
                continue
            mean = [math.exp(sum(math.log(r[i]) for r in rows) / len(rows)) if i in (0, 2) else
                    sum(r[i] for r in rows) / len(rows) for i in range(4)]
            better = sum(r[0] < r[2] - 1e-12 for r in rows)
            print(f"{name:<10} {':'.join(map(str, cost)):>22} {len(rows):>7} {mean[0]:>10.3f}x "
                  f"{max(r[0] for r in rows):>5.3f} {mean[1]:>7.3f}   {mean[2]:>10.3f}x "
                  f"{max(r[2] for r in rows):>5.3f} {mean[3]:>7.3f}   {better:>18}")
    print("plan/bound: geometric mean over the grid of the plan's step over the bound (1.000: no order is shorter); "
          "worst: the largest; bubble: the mean idle fraction. blind: the plan made at unit costs without latency.")


def generation_times(p: int = 64, m: int = 512) -> None:
    print(f"\ngeneration at p={p}, m={m} (F:B:W = 1:2:1 per stage, comm 0.5), seconds:")
    for name in FAMILIES:
        kind = get_kind(name)
        chunks = kind.chunks or 1
        start = time.perf_counter()
        make_schedule(name, p, m, chunks)
        blind = time.perf_counter() - start
        line = f"  {name:<10} unit costs {blind:6.2f}"
        if kind.cost_aware:
            start = time.perf_counter()
            make_schedule(name, p, m, chunks, {"F": 1, "B": 2, "W": 1}, 0.5)
            line += f"   with costs and latency {time.perf_counter() - start:6.2f}"
        print(line)


def main() -> None:
    table()
    generation_times()
