"""``schedule/bound.py``: the shortest step any order could have, which plans are shown beside."""
from __future__ import annotations

import random

import pytest

from staticpipe.schedule import get_kind, make_schedule, simulate
from staticpipe.schedule.bound import step_bound
from staticpipe.schedule.latency import link_latency
from staticpipe.schedule.simulate import cost_function, stage_cost_function

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (8, 8), (8, 24)])
def test_plans_known_to_be_optimal_reach_it(p, m):
    """ZB-H1 at unit costs takes 3m + p - 1 (the paper's figure), and 1F1B with B = 2F takes 3 (m + p - 1):
    both are the bound -- work plus fill, and for 1F1B the last gradient's way back."""
    unit = cost_function(None)
    assert step_bound(range(p), m, unit) == simulate(make_schedule("ZB-H1", p, m)).total == 3 * m + p - 1
    whole = cost_function({"F": 1, "B": 2})
    assert step_bound(range(p), m, whole, split_backward=False) == simulate(
        make_schedule("1F1B", p, m), {"F": 1, "B": 2}).total == 3 * (m + p - 1)


def test_one_microbatch_is_its_own_path():
    # down 4 stages (F = 1, a link 0.5 each), back up (B = 2), then stage 0's W (3): 4 + 1.5 + 8 + 1.5 + 3
    price = stage_cost_function({"F": 1, "B": 2, "W": [3, 1, 1, 1]})
    assert step_bound(range(4), 1, price, link_latency(0.5)) == 18.0
    assert simulate(make_schedule("ZB-H1", 4, 1), price, comm=0.5).total == 18.0


@pytest.mark.parametrize("name", ["F-then-B", "1F1B", "interleaved", "ZB-H1", "ZB-2P", "ZB-V", "V-Min", "V-Half",
                                  "Eager1F1B", "DualPipeV"])
def test_no_plan_is_shorter_than_the_bound(name):
    kind, rnd = get_kind(name), random.Random(name)
    for p, m in ((2, 8), (4, 8), (4, 16)):
        chunks = kind.chunks or 2
        n = p * chunks
        costs = {k: [rnd.uniform(0.5, 3.0) for _ in range(n)] for k in ("F", "B", "W")}
        if not kind.split_backward:
            costs["B"] = [b + w for b, w in zip(costs["B"], costs.pop("W"))]
        price = stage_cost_function(costs, n)
        for comm in (0.0, 0.7):
            plan = make_schedule(name, p, m, chunks)
            bound = step_bound(kind.layout(p, chunks), m, price, link_latency(comm), kind.split_backward)
            assert 0 < bound <= simulate(plan, price, n, comm=comm).total + 1e-9, (p, m, comm)
