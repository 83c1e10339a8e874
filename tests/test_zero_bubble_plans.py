"""The zero-bubble family's cost- and latency-aware plans (ZB-H1, ZB-2P, ZB-V): pinned step times, memory and validity.

Each case gives the family, ranks, micro-batches, the F/B/W costs (per stage, or per chunk on the V) and
the message latency ``comm``, then two makespans ``simulate`` gives under those costs and that latency:
the plan the generators made before the portfolio (planned by the list scheduler alone, without the
latency) and the plan they make now (planned with both). A plan is never longer than before; ZB-V's
are shorter almost everywhere, ZB-H1's where a latency makes its first micro-batches wait (m = p).
"""
from __future__ import annotations

import pytest

from schedule_util import rank_peak
from staticpipe.schedule import get_kind, make_schedule, simulate, validate
from staticpipe.schedule.simulate import stage_cost_function
from staticpipe.schedule.zero_bubble import FULL

pytestmark = pytest.mark.timeout(120)

MEMORY = {"ZB-H1": 1, "ZB-2P": 2, "ZB-V": 1}  # activations allowed, in multiples of 1F1B's
CHUNKS = {"ZB-H1": 1, "ZB-2P": 1, "ZB-V": 2}

# (family, ranks, micro-batches, costs, comm, makespan before, makespan now)
PINNED = [
    ("ZB-H1", 4, 4, {"F": 1, "B": 2, "W": 1}, 0, 22.0, 22.0),
    ("ZB-H1", 4, 4, {"F": 5, "B": 6, "W": 4}, 0, 81.0, 81.0),
    ("ZB-H1", 4, 4, {"F": 5478, "B": 5806, "W": 3534}, 200, 84522.0, 83722.0),
    ("ZB-H1", 4, 4, {"F": 4, "B": 4, "W": 4}, 1, 70.0, 66.0),
    ("ZB-H1", 4, 4, {"F": [1, 1, 2, 1], "B": [1, 2, 3, 1], "W": [0.5, 1, 1, 0.5]}, 0.25, 27.0, 26.5),
    ("ZB-H1", 4, 8, {"F": 1, "B": 2, "W": 1}, 0, 38.0, 38.0),
    ("ZB-H1", 4, 8, {"F": 5, "B": 6, "W": 4}, 0, 141.0, 141.0),
    ("ZB-H1", 4, 8, {"F": 5478, "B": 5806, "W": 3534}, 200, 144194.0, 144194.0),
    ("ZB-H1", 4, 8, {"F": 4, "B": 4, "W": 4}, 1, 120.0, 120.0),
    ("ZB-H1", 4, 8, {"F": [1, 1, 2, 1], "B": [1, 2, 3, 1], "W": [0.5, 1, 1, 0.5]}, 0.25, 51.0, 51.0),
    ("ZB-H1", 8, 16, {"F": 1, "B": 2, "W": 1}, 0, 78.0, 78.0),
    ("ZB-H1", 8, 16, {"F": 5, "B": 6, "W": 4}, 0, 289.0, 289.0),
    ("ZB-H1", 8, 16, {"F": 5478, "B": 5806, "W": 3534}, 200, 296938.0, 296938.0),
    ("ZB-H1", 8, 16, {"F": 4, "B": 4, "W": 4}, 1, 248.0, 248.0),
    ("ZB-H1", 8, 24, {"F": 1, "B": 2, "W": 1}, 0, 110.0, 110.0),
    ("ZB-H1", 8, 24, {"F": 5, "B": 6, "W": 4}, 0, 409.0, 409.0),
    ("ZB-H1", 8, 24, {"F": 5478, "B": 5806, "W": 3534}, 200, 415482.0, 415482.0),
    ("ZB-H1", 8, 24, {"F": 4, "B": 4, "W": 4}, 1, 344.0, 344.0),
    ("ZB-2P", 4, 4, {"F": 1, "B": 2, "W": 1}, 0, 22.0, 22.0),
    ("ZB-2P", 4, 4, {"F": 5, "B": 6, "W": 4}, 0, 81.0, 81.0),
    ("ZB-2P", 4, 4, {"F": 5478, "B": 5806, "W": 3534}, 200, 83722.0, 83722.0),
    ("ZB-2P", 4, 4, {"F": 4, "B": 4, "W": 4}, 1, 66.0, 66.0),
    ("ZB-2P", 4, 4, {"F": [1, 1, 2, 1], "B": [1, 2, 3, 1], "W": [0.5, 1, 1, 0.5]}, 0.25, 26.5, 26.5),
    ("ZB-2P", 4, 8, {"F": 1, "B": 2, "W": 1}, 0, 35.0, 35.0),
    ("ZB-2P", 4, 8, {"F": 5, "B": 6, "W": 4}, 0, 135.0, 135.0),
    ("ZB-2P", 4, 8, {"F": 5478, "B": 5806, "W": 3534}, 200, 135578.0, 135578.0),
    ("ZB-2P", 4, 8, {"F": 4, "B": 4, "W": 4}, 1, 111.0, 111.0),
    ("ZB-2P", 4, 8, {"F": [1, 1, 2, 1], "B": [1, 2, 3, 1], "W": [0.5, 1, 1, 0.5]}, 0.25, 50.75, 50.5),
    ("ZB-2P", 8, 16, {"F": 1, "B": 2, "W": 1}, 0, 71.0, 71.0),
    ("ZB-2P", 8, 16, {"F": 5, "B": 6, "W": 4}, 0, 275.0, 275.0),
    ("ZB-2P", 8, 16, {"F": 5478, "B": 5806, "W": 3534}, 200, 276834.0, 276834.0),
    ("ZB-2P", 8, 16, {"F": 4, "B": 4, "W": 4}, 1, 227.0, 227.0),
    ("ZB-2P", 8, 24, {"F": 1, "B": 2, "W": 1}, 0, 103.0, 103.0),
    ("ZB-2P", 8, 24, {"F": 5, "B": 6, "W": 4}, 0, 395.0, 395.0),
    ("ZB-2P", 8, 24, {"F": 5478, "B": 5806, "W": 3534}, 200, 395378.0, 395378.0),
    ("ZB-2P", 8, 24, {"F": 4, "B": 4, "W": 4}, 1, 323.0, 323.0),
    ("ZB-V", 4, 4, {"F": 1, "B": 2, "W": 1}, 0, 38.0, 38.0),
    ("ZB-V", 4, 4, {"F": 5, "B": 6, "W": 4}, 0, 138.0, 138.0),
    ("ZB-V", 4, 4, {"F": 5478, "B": 5806, "W": 3534}, 200, 137762.0, 137762.0),
    ("ZB-V", 4, 4, {"F": 4, "B": 4, "W": 4}, 1, 124.0, 117.0),
    ("ZB-V", 4, 8, {"F": 1, "B": 2, "W": 1}, 0, 74.0, 70.0),
    ("ZB-V", 4, 8, {"F": 5, "B": 6, "W": 4}, 0, 270.0, 258.0),
    ("ZB-V", 4, 8, {"F": 5478, "B": 5806, "W": 3534}, 200, 274276.0, 257106.0),
    ("ZB-V", 4, 8, {"F": 4, "B": 4, "W": 4}, 1, 228.0, 213.0),
    ("ZB-V", 8, 16, {"F": 1, "B": 2, "W": 1}, 0, 163.0, 142.0),
    ("ZB-V", 8, 16, {"F": 5, "B": 6, "W": 4}, 0, 566.0, 522.0),
    ("ZB-V", 8, 16, {"F": 5478, "B": 5806, "W": 3534}, 200, 572042.0, 521418.0),
    ("ZB-V", 8, 16, {"F": 4, "B": 4, "W": 4}, 1, 468.0, 436.0),
    ("ZB-V", 8, 24, {"F": 1, "B": 2, "W": 1}, 0, 224.0, 206.0),
    ("ZB-V", 8, 24, {"F": 5, "B": 6, "W": 4}, 0, 808.0, 762.0),
    ("ZB-V", 8, 24, {"F": 5478, "B": 5806, "W": 3534}, 200, 812402.0, 758506.0),
    ("ZB-V", 8, 24, {"F": 4, "B": 4, "W": 4}, 1, 676.0, 628.0),
    ("ZB-V", 2, 6, {"F": [1, 1, 2, 1], "B": [1, 2, 3, 1], "W": [0.5, 1, 1, 0.5]}, 0.25, 63.25, 61.25),
]


def plan(name, p, m, costs, comm):
    chunks = CHUNKS[name]
    schedule = make_schedule(name, p, m, chunks, costs=costs, comm=comm)
    validate(schedule, p * chunks, m, get_kind(name).layout(p, chunks), split_backward=True)
    assert max(map(rank_peak, schedule.values())) <= MEMORY[name] * p * chunks
    return schedule, stage_cost_function(costs, p * chunks)


@pytest.mark.parametrize("name, p, m, costs, comm, before, now", PINNED)
def test_pinned_makespans_never_longer_than_before(name, p, m, costs, comm, before, now):
    schedule, price = plan(name, p, m, costs, comm)
    assert now <= before
    assert simulate(schedule, price, p * CHUNKS[name], comm=comm).total == now


def test_plans_differ_where_the_latency_matters():
    """ZB-H1, p = m = 4, F = B = W = 4, messages 1: planned without the latency, the lock-step plan takes 70;
    the search, which waits for late inputs with W's, 66. Planned with comm the plan differs from the
    plan without it, and is faster under it."""
    costs = {"F": 4, "B": 4, "W": 4}
    with_comm, price = plan("ZB-H1", 4, 4, costs, 1)
    without, _ = plan("ZB-H1", 4, 4, costs, None)
    assert with_comm != without
    assert simulate(with_comm, price, 4, comm=1).total == 66 < simulate(without, price, 4, comm=1).total


def test_latency_per_link_and_as_a_function():
    """A mapping of links and a function of the two ranks plan like the number they amount to."""
    costs = {"F": 5, "B": 6, "W": 4}
    as_number, _ = plan("ZB-V", 4, 8, costs, 1.5)
    links = {(a, b): 1.5 for a in range(4) for b in range(4) if a != b}
    assert plan("ZB-V", 4, 8, costs, links)[0] == as_number
    assert plan("ZB-V", 4, 8, costs, lambda a, b: 1.5 * (a != b))[0] == as_number


def test_unit_costs_without_latency_are_the_unit_plans():
    for name in MEMORY:
        for p, m in ((2, 3), (4, 8)):
            assert make_schedule(name, p, m, CHUNKS[name], costs=None, comm=None) == make_schedule(
                name, p, m, CHUNKS[name])
            assert make_schedule(name, p, m, CHUNKS[name], comm=0) == make_schedule(name, p, m, CHUNKS[name])


@pytest.mark.parametrize("name", list(MEMORY))
def test_large_plans_take_the_cheaper_portfolio(name):
    """Beyond ``FULL`` pairs the portfolio is cut down; the plans stay valid, within memory, and no slower
    than the unit plan under the costs and latency they were planned for."""
    p, m = 8, FULL // 8 + 8
    costs = {"F": 1, "B": 2, "W": 1}
    schedule, price = plan(name, p, m, costs, 0.5)
    unit = make_schedule(name, p, m, CHUNKS[name])
    assert p * CHUNKS[name] * m > FULL
    total = simulate(schedule, price, p * CHUNKS[name], comm=0.5).total
    assert total <= simulate(unit, price, p * CHUNKS[name], comm=0.5).total
