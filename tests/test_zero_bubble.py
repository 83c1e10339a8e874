"""Cost-aware zero-bubble schedules: planned at measured F/B/W durations, never slower than the unit-cost
plan under those durations, at 1F1B's memory, and training exactly like single-device training."""
from __future__ import annotations

import random
import re
from functools import partial

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import assert_same_training, minimize, train_twins
from staticpipe._paddle import paddle
from staticpipe.schedule import Kind, get_kind, make_schedule, simulate, validate
from staticpipe.schedule.__main__ import main
from staticpipe.schedule.simulate import stage_cost_function

pytestmark = pytest.mark.timeout(300)

# stage 1 of 3 has a backward twice as long as the others', and W's are cheap
HEAVY_MIDDLE = {"F": 1, "B": [1, 2, 1], "W": 0.5}


def as_strings(schedule):
    return {r: " ".join(map(str, acts)) for r, acts in schedule.items()}


def rank_peak(schedule):
    """Per rank, the most (stage, micro-batch) pairs between their F and their W: the activations the
    rank holds at once (1F1B's bound: as many as there are stages)."""
    peak = {}
    for r, acts in schedule.items():
        held = 0
        for a in acts:
            held += (a.kind is Kind.F) - (a.kind is Kind.W)
            peak[r] = max(peak.get(r, 0), held)
    return peak


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


@pytest.mark.parametrize("name, chunks", [("ZB-H1", 1), ("ZB-V", 2)])
def test_cost_aware_plans_are_valid_never_slower_and_within_1f1b_memory(name, chunks):
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
        assert max(rank_peak(planned).values()) <= p * chunks, (p, m, costs)
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
            "costs is for the schedules that plan by measured costs (ZB-H1, ZB-V); schedule 1F1B does not use it")):
        make_schedule("1F1B", 2, 4, costs={"F": 1})
    with pytest.raises(ValueError, match=re.escape("costs give action 1B0 a negative duration (-1)")):
        make_schedule("ZB-H1", 2, 4, costs=lambda a: -1 if str(a) == "1B0" else 1)


def test_pipeline_optimizer_checks_schedule_costs():
    opt = paddle.optimizer.SGD(0.1)
    with pytest.raises(ValueError, match=re.escape("unknown action kind 'w' in schedule_costs; kinds: F, B, W")):
        staticpipe.PipelineOptimizer(opt, 4, "ZB-H1", schedule_costs={"w": 0.5})
    with pytest.raises(ValueError, match=re.escape("schedule_costs is for the schedules that plan by measured costs "
                                                   "(ZB-H1, ZB-V); schedule interleaved does not use it")):
        staticpipe.PipelineOptimizer(opt, 4, "interleaved", schedule_costs={"W": 0.5})
    with pytest.raises(ValueError, match=re.escape("schedule_costs plans the order of a named schedule (ZB-H1, ZB-V); "
                                                   "a custom schedule gives its own order")):
        staticpipe.PipelineOptimizer(opt, 1, "rank 0: 0F0 0B0 0OPT", schedule_costs={"W": 0.5})
    net = build_mlp(num_stages=2)
    with pytest.raises(ValueError, match=re.escape("schedule_costs['F'] has 3 values for 2 stages: [1, 1, 2]")):
        minimize(net, opt, dict(num_microbatches=4, schedule="ZB-H1", schedule_costs={"F": [1, 1, 2]}))


def momentum():
    return paddle.optimizer.Momentum(0.1, momentum=0.9)


def test_cost_aware_plan_trains_like_one_device():
    builder = partial(build_mlp, num_stages=3)
    twin = train_twins(builder, momentum, num_microbatches=2, schedule="ZB-H1", schedule_costs=HEAVY_MIDDLE)
    assert_same_training(twin)
    net = builder()
    minimize(net, momentum(), dict(num_microbatches=2, schedule="ZB-H1", schedule_costs=HEAVY_MIDDLE))
    compute = {r: [a for a in acts if a.kind in (Kind.F, Kind.B, Kind.W)]
               for r, acts in staticpipe.plan_of(net.main).actions.items()}
    assert " ".join(map(str, compute[1])) == "1F0 1F1 1B0 1B1 1W0 1W1"  # the cost-aware order, not the unit one


def test_timeline_stage_costs_plan_the_next_build():
    net = build_mlp(num_stages=2)
    minimize(net, momentum(), dict(num_microbatches=4, schedule="ZB-H1"))
    exe = staticpipe.Executor(trace=True)
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(16))
    costs = exe.timeline(net.main).stage_costs()
    exe.close()
    assert sorted(costs) == ["B", "F", "W"] and all(len(v) == 2 and min(v) > 0 for v in costs.values())
    again = build_mlp(num_stages=2)
    minimize(again, momentum(), dict(num_microbatches=4, schedule="ZB-H1", schedule_costs=costs))
    assert staticpipe.plan_of(again.main).schedule == "ZB-H1"


def test_cli_plans_with_costs(capsys):
    """ZB-V, cheap W's: rank 0 runs 0W0 while 1B1 is still on its way, where the unit plan (in which
    1B1 has arrived) runs 0B1 and then waits."""
    main(["--schedule", "ZB-V", "--stages", "2", "--microbatches", "2", "--costs", "F=1,B=1,W=0.5,OPT=0"])
    assert capsys.readouterr().out.splitlines() == [
        "rank 0: 0F0 0F1 3F0 3B0 3F1 3B1 0B0 3W0 0W0 0B1 3W1 0W1 0OPT 3OPT",
        "rank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 1W0 2W1 1W1 1OPT 2OPT",
        "simulated total: 11", "bubble: 0.0909", "peak in flight: stage 0: 2, stage 1: 2, stage 2: 2, stage 3: 2",
        "unit-cost plan under these costs: simulated total 11.5, bubble 0.1304"]
    main(["--schedule", "1F1B", "--stages", "2", "--microbatches", "2", "--costs", "F=1,B=2"])
    assert "unit-cost plan" not in capsys.readouterr().out
