"""Cost-aware ZB-H1, ZB-V and ZB-2P plans: valid, never slower than unit-cost plans at measured costs, in
1F1B's memory (ZB-2P: twice it)."""
from __future__ import annotations

import random
import re

import pytest

from schedule_util import HEAVY_MIDDLE, as_strings, rank_peak
from staticpipe.schedule import format_schedule, get_kind, make_schedule, simulate, validate
from staticpipe.schedule.__main__ import main
from staticpipe.schedule.simulate import stage_cost_function

pytestmark = pytest.mark.timeout(300)


def test_hand_checked_plan_with_a_heavy_middle_stage():
    """p = 3, m = 2. Unit costs plan rank 1 in lock-step: when its 1B0 ends, 2B1 has not arrived in unit
    time, so it runs 1W0 first. At the real durations 1B0 runs 4..6 and 2B1 ends at 6 (2F1 4..5, 2B1
    5..6): 1B1 can start at once, and 0B1, on the critical path, starts 0.5 earlier: 9.5 instead of 10."""
    unit = make_schedule("ZB-H1", 3, 2)
    planned = make_schedule("ZB-H1", 3, 2, costs=HEAVY_MIDDLE)
    assert as_strings(planned) == {
        0: "0F0 0F1 0B0 0W0 0B1 0W1 0OPT",
        1: "1F0 1F1 1B0 1B1 1W0 1W1 1OPT",
        2: "2F0 2B0 2F1 2B1 2W0 2W1 2OPT",
    }
    assert as_strings(unit)[1] == "1F0 1F1 1B0 1W0 1B1 1W1 1OPT"
    price = stage_cost_function(HEAVY_MIDDLE, 3)
    assert (simulate(planned, price).total, simulate(unit, price).total) == (9.5, 10.0)
    ends = {str(a): end for _, a, _, end in simulate(planned, price).events}
    assert (ends["1B0"], ends["2B1"], ends["1B1"], ends["0B1"]) == (6.0, 6.0, 8.0, 9.0)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_uniform_costs_plan_the_unit_schedule(p):
    """Equal durations at any scale are unit costs: ZB-H1 keeps exactly the unit-cost order."""
    for m in range(1, 3 * p + 2):
        for scale in (1, 0.25, 3):
            costs = {"F": scale, "B": scale, "W": scale}
            assert make_schedule("ZB-H1", p, m, costs=costs) == make_schedule("ZB-H1", p, m), (m, scale)


def random_costs(rng, num_stages):
    """W cheap or free, one stage up to 3x heavier: the imbalances measured stages show."""
    heavy = rng.randrange(num_stages)
    costs = {k: [rng.choice([0.5, 1, 1.5]) * (rng.choice([2, 3]) if s == heavy else 1) for s in range(num_stages)]
             for k in "FB"}
    return costs | {"W": [rng.choice([0, 0.25, 0.5, 1]) for _ in range(num_stages)]}


@pytest.mark.parametrize("name, chunks, memory", [("ZB-H1", 1, 1), ("ZB-V", 2, 1), ("ZB-2P", 1, 2)])
def test_cost_aware_plans_are_valid_never_slower_and_within_their_memory(name, chunks, memory):
    """Within 1F1B's memory (ZB-2P: twice it)."""
    rng = random.Random(4)
    kind = get_kind(name)
    faster = 0
    for _ in range(120):
        p, m = rng.randint(2, 4), rng.randint(1, 12)
        costs = random_costs(rng, p * chunks)
        price = stage_cost_function(costs, p * chunks)
        planned = make_schedule(name, p, m, chunks, costs=costs)
        validate(planned, p * chunks, m, kind.layout(p, chunks), split_backward=True)
        unit = simulate(make_schedule(name, p, m, chunks), price).total
        assert simulate(planned, price).total <= unit, (p, m, costs)
        faster += simulate(planned, price).total < unit
        assert max(map(rank_peak, planned.values())) <= memory * p * chunks, (p, m, costs)
    assert faster >= 10  # the costs do change plans, for the better


def test_costs_are_checked_and_name_the_fault():
    for costs, error in [
        ({"X": 1}, "unknown action kind 'X' in costs; kinds: F, B, W"),
        ({"OPT": 1}, "unknown action kind 'OPT' in costs; kinds: F, B, W"),
        ({"W": -1}, "costs['W'] must be seconds >= 0, or a list of them (one per stage); got -1"),
        ({"F": [1, float("nan")]}, "costs['F'] must be seconds >= 0, or a list of them (one per stage); got [1, nan]"),
        ({"B": "fast"}, "costs['B'] must be seconds >= 0, or a list of them (one per stage); got 'fast'"),
        ({"F": [1, 2, 3]}, "costs['F'] has 3 values for 2 stages: [1, 2, 3]"),
        ([1, 2], "costs must be a mapping such as {'F': 1, 'B': 1, 'W': 0.5} or a function of the action, got [1, 2]"),
    ]:
        with pytest.raises(ValueError, match=re.escape(error)):
            make_schedule("ZB-H1", 2, 4, costs=costs)
    with pytest.raises(ValueError, match=re.escape(
            "costs is for the schedules that plan by measured costs (ZB-H1, ZB-V, V-Min, V-Half, ZB-2P); schedule 1F1B "
            "does not use it")):
        make_schedule("1F1B", 2, 4, costs={"F": 1})
    with pytest.raises(ValueError, match=re.escape("costs give action 1B0 a negative duration (-1)")):
        make_schedule("ZB-H1", 2, 4, costs=lambda a: -1 if str(a) == "1B0" else 1)


def test_cli_plans_with_costs(capsys):
    """ZB-V, cheap W's: rank 0 runs 0W0 while 1B1 is still on its way, where the unit plan (in which
    1B1 has arrived) runs 0B1 and then waits."""
    main(["--schedule", "ZB-V", "--stages", "2", "--microbatches", "2", "--costs", "F=1,B=1,W=0.5,OPT=0"])
    assert capsys.readouterr().out.splitlines() == [
        "rank 0: 0F0 0F1 3F0 3B0 3F1 3B1 0B0 3W0 0W0 0B1 3W1 0W1 0OPT 3OPT",
        "rank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 1W0 2W1 1W1 1OPT 2OPT",
        "simulated total: 11", "bubble: 0.0909", "span bubble: 0.0909",
        "bound: 11 (the shortest step any order could have: the plan is 1.000x it)",
        "peak in flight: stage 0: 2, stage 1: 2, stage 2: 2, stage 3: 2",
        "unit-cost plan under these costs: simulated total 11.5, bubble 0.1304"]
    main(["--schedule", "1F1B", "--stages", "2", "--microbatches", "2", "--costs", "F=1,B=2"])
    assert "unit-cost plan" not in capsys.readouterr().out
    # a latency: planned with it; the bound has the first micro-batch's way down and back over the link
    main(["--schedule", "ZB-H1", "--stages", "2", "--microbatches", "4", "--costs", "F=1,B=1,W=1", "--comm", "2"])
    out = capsys.readouterr().out.splitlines()
    plan = make_schedule("ZB-H1", 2, 4, costs={"F": 1, "B": 1, "W": 1}, comm=2)
    total = simulate(plan, {"F": 1, "B": 1, "W": 1}, comm=2).total
    assert out[:2] == format_schedule(plan).splitlines() and out[2] == f"simulated total: {total:g}"
    assert out[5] == f"bound: 15 (the shortest step any order could have: the plan is {total / 15:.3f}x it)"
    unit = simulate(make_schedule("ZB-H1", 2, 4), {"F": 1, "B": 1, "W": 1}, comm=2)
    assert out[7] == f"unit-cost plan under these costs: simulated total {unit.total:g}, bubble {unit.bubble:.4f}"
