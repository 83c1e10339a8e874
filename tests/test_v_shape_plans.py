"""V-Half and V-Min planned for given costs and message latency (``v_shape`` with ``v_block``'s orders).

Pinned: each plan's makespan under the costs and latency it was planned for, next to what the plan
without costs (the unit-time squeeze, unchanged) takes under them; the planned one is never longer,
holds no more activations than the unit plan, and is a valid schedule."""
import pytest

from staticpipe.schedule import simulate, validate
from staticpipe.schedule.actions import Kind
from staticpipe.schedule.latency import link_latency
from staticpipe.schedule.simulate import stage_cost_function
from staticpipe.schedule.v_shape import v_half, v_min
from staticpipe.schedule.zero_bubble import zb_v, zb_v_layout

# (ranks, micro-batches, (F, B, W, latency), makespan of the unit plan, makespan of the planned one)
PINNED = {
    "V-Half": [
        (2, 4, (1, 2, 1, 0), 34, 34),
        (2, 2, (1, 2, 1, 0), 19, 18),
        (2, 2, (5478, 5806, 3534, 200), 68150, 65678),
        (2, 4, (5478, 5806, 3534, 200), 125022, 124950),
        (3, 7, (1, 2, 1, 0), 71, 70),
        (3, 7, (4, 4, 4, 1), 200, 200),
        (4, 8, (1, 2, 1, 0), 83, 81),
        (4, 8, (5, 6, 4, 0), 280, 278),
        (4, 8, (5478, 5806, 3534, 200), 282694, 280822),
        (8, 16, (1, 2, 1, 0), 187, 176),
        (8, 16, (5, 6, 4, 0), 616, 595),
        (8, 16, (5478, 5806, 3534, 200), 611534, 600486),
        (8, 16, (4, 4, 4, 1), 514, 496),
    ],
    "V-Min": [
        (3, 7, (1, 2, 1, 0), 72, 71),
        (4, 8, (5, 6, 4, 0), 338, 338),
        (4, 8, (5478, 5806, 3534, 200), 339730, 339730),
        (8, 16, (1, 2, 1, 0), 227, 224),
        (8, 16, (5, 6, 4, 0), 717, 709),
        (8, 16, (5478, 5806, 3534, 200), 725706, 715540),
        (8, 16, (4, 4, 4, 1), 596, 586),
    ],
}
GENERATE = {"V-Half": v_half, "V-Min": v_min}


def rank_peak(schedule) -> int:
    """The most chunk activations any rank holds: its F's so far less its W's so far."""
    peak = 0
    for acts in schedule.values():
        held = 0
        for a in acts:
            held += (a.kind is Kind.F) - (a.kind is Kind.W)
            peak = max(peak, held)
    return peak


def check(name, p, m, costs, comm):
    """The plan for ``costs`` and ``comm``: valid, within the unit plan's peak, and its makespan next to
    the unit plan's (both under them)."""
    generate, n = GENERATE[name], 2 * p
    unit = generate(p, m)
    costs = stage_cost_function(costs, n)
    plan = generate(p, m, costs, link_latency(comm))
    validate(plan, n, m, zb_v_layout(p), split_backward=True)
    assert rank_peak(plan) <= rank_peak(unit)
    before, after = simulate(unit, costs, n, comm=comm).total, simulate(plan, costs, n, comm=comm).total
    assert after <= before
    return before, after


@pytest.mark.parametrize("name,p,m,fbwc,before,after",
                         [(name, *row) for name, rows in PINNED.items() for row in rows])
def test_pinned_makespans(name, p, m, fbwc, before, after):
    assert after <= before  # the pins themselves: the plan for the costs never loses to the unit plan
    f, b, w, c = fbwc
    assert check(name, p, m, {"F": f, "B": b, "W": w}, c) == (before, after)


# at 2 ranks V-Min holds as much as ZB-V, whose plan (``zero_bubble.zb_v``) competes: no longer than the
# building block's orders (pinned) nor than ZB-V's plan
@pytest.mark.parametrize("p,m,fbwc,before,block", [
    (2, 2, (5478, 5806, 3534, 200), 83722, 73094),
    (2, 4, (1, 2, 1, 0), 43, 41),
    (2, 4, (5, 6, 4, 0), 147, 138),
    (2, 4, (5478, 5806, 3534, 200), 152226, 138366),
    (2, 4, (4, 4, 4, 1), 118, 110),
])
def test_v_min_on_two_ranks(p, m, fbwc, before, block):
    f, b, w, c = fbwc
    costs = {"F": f, "B": b, "W": w}
    unit, after = check("V-Min", p, m, costs, c)
    assert unit == before and after <= block
    assert after <= simulate(zb_v(p, m, stage_cost_function(costs), link_latency(c)), costs, 2 * p, comm=c).total


@pytest.mark.parametrize("name,before,after", [("V-Half", 160, 146), ("V-Min", 192.5, 192.5)])
def test_per_stage_costs_and_per_link_latency(name, before, after):
    costs = {"F": [1, 2, 1, 1, 3, 1, 2, 1], "B": [2, 2, 3, 2, 2, 4, 2, 2], "W": [1, 1, 0.5, 1, 1, 1, 2, 1]}
    comm = {(0, 1): 0.5, (1, 0): 0.5, (1, 2): 2, (2, 1): 2, (2, 3): 0.25, (3, 2): 0.25}
    assert check(name, 4, 9, costs, comm) == (before, after)


@pytest.mark.parametrize("name", GENERATE)
@pytest.mark.parametrize("p,m", [(1, 1), (1, 3), (2, 1), (3, 2), (5, 5), (5, 11), (6, 13)])
def test_never_longer_than_the_unit_plan(name, p, m):
    for fbwc in ((1, 1, 1, 0), (1, 3, 0.5, 0), (2, 1, 1, 0.5), (1, 1, 2, 3)):
        f, b, w, c = fbwc
        before, after = check(name, p, m, {"F": f, "B": b, "W": w}, c)
        assert after <= before


@pytest.mark.parametrize("name", GENERATE)
def test_latency_alone_plans_at_unit_costs(name):
    """A latency without costs: unit costs, the latency taken into account."""
    generate = GENERATE[name]
    plan = generate(4, 8, None, link_latency(1.5))
    unit = generate(4, 8)
    validate(plan, 8, 8, zb_v_layout(4), split_backward=True)
    assert simulate(plan, None, 8, comm=1.5).total <= simulate(unit, None, 8, comm=1.5).total
