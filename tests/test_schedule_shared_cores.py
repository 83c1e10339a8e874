"""``schedule/shared_cores.py``: the simulator when ranks share processors (CPU stage threads on one machine)."""
from __future__ import annotations

import pytest

from schedule_util import chain_routes
from staticpipe.schedule import Action, Kind, ScheduleError, lower, make_schedule, simulate

pytestmark = pytest.mark.timeout(120)


def F(stage, mb):
    return Action(Kind.F, stage, mb)


def B(stage, mb):
    return Action(Kind.B, stage, mb)


def OPT(stage):
    return Action(Kind.OPT, stage, None)


@pytest.mark.parametrize("name", ["1F1B", "F-then-B", "ZB-H1", "ZB-V", "V-Min", "DualPipeV"])
def test_a_core_per_rank_is_the_independent_simulation(name):
    schedule = make_schedule(name, 4, 8, 2 if name in ("ZB-V", "V-Min", "DualPipeV") else 1)
    costs = {"F": 1.0, "B": 2.0, "W": 1.5, "OPT": 0.5}
    alone = simulate(schedule, costs)
    for cores in (4, 9):
        shared = simulate(schedule, costs, cores=cores)
        assert shared.total == pytest.approx(alone.total, abs=1e-9)
        assert [(r, a) for r, a, _, _ in shared.events] == [(r, a) for r, a, _, _ in alone.events]


@pytest.mark.parametrize("name", ["1F1B", "F-then-B", "ZB-H1", "ZB-V", "V-Half"])
def test_one_core_for_all_is_never_idle(name):
    """A schedule that cannot deadlock always has a rank that can go on, so one core never idles: the
    step is the sum of every action's cost."""
    schedule = make_schedule(name, 4, 6, 2 if name in ("ZB-V", "V-Half") else 1)
    costs = {"F": 1.0, "B": 2.0, "W": 0.5, "OPT": 0.25}
    work = sum(costs[a.kind.value] for acts in schedule.values() for a in acts)
    assert simulate(schedule, costs, cores=1).total == pytest.approx(work, abs=1e-9)


def test_two_ranks_on_one_core_run_at_half_speed_while_both_have_work():
    schedule = {0: [F(0, 0), F(0, 1)], 1: [F(1, 0), F(1, 1)]}
    sim = simulate(schedule, cores=1)
    # 0..1 rank 0 alone; 1..3 both at half speed; 3..4 rank 1 alone
    assert [(r, str(a), s, e) for r, a, s, e in sorted(sim.events, key=lambda e: (e[2], e[0]))] == [
        (0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 3.0), (1, "1F0", 1.0, 3.0), (1, "1F1", 3.0, 4.0)]
    assert sim.total == 4.0 and sim.busy == {0: 3.0, 1: 3.0}
    assert simulate(schedule, cores=1, sharing=[1]).total == 3.0  # rank 0 has its own processor
    assert simulate(schedule, cores=0.5, sharing=[1]).total == pytest.approx(1 + 2 + 2)


def test_collectives_hold_every_first_opt_until_all_ranks_reach_it():
    schedule = {0: [F(0, 0), OPT(0)], 1: [F(1, 0), B(1, 0), OPT(1)]}
    schedule[0].insert(1, B(0, 0))
    costs = {"F": 1.0, "B": 1.0, "OPT": 1.0}
    free = simulate(schedule, costs, cores=2)
    held = simulate(schedule, costs, cores=2, collectives=True)
    starts = {str(a): s for _, a, s, _ in held.events}
    assert starts["0OPT"] == starts["1OPT"] == 4.0  # rank 1 reaches its OPT at 3, rank 0 at 4
    assert {str(a): s for _, a, s, _ in free.events}["1OPT"] == 3.0


def test_a_lowered_schedule_waits_for_its_messages():
    schedule = lower(make_schedule("1F1B", 2, 2), chain_routes(2))
    costs = {"F": 1.0, "B": 1.0, "SEND": 0.25, "RECV": 0.25}
    assert simulate(schedule, costs, cores=2).total == pytest.approx(simulate(schedule, costs).total)
    work = sum(costs.get(a.kind.value, 0.0) for acts in schedule.values() for a in acts)
    assert simulate(schedule, costs, cores=1).total == pytest.approx(work)


def test_bad_cores_and_deadlocks_are_reported():
    with pytest.raises(ValueError) as err:
        simulate(make_schedule("1F1B", 2, 2), cores=0)
    assert str(err.value) == "cores must be > 0, got 0"
    with pytest.raises(ScheduleError) as err:  # found by the independent engine, which explains it
        simulate({0: [F(0, 0), B(0, 0)], 1: [B(1, 0), F(1, 0)]}, cores=1)
    assert "deadlock" in str(err.value)


@pytest.mark.parametrize("cost", [float("nan"), -1.0])
def test_a_cost_that_is_no_duration_is_named_instead_of_never_ending(cost):
    schedule = make_schedule("1F1B", 2, 4, 1)
    with pytest.raises(ValueError) as err:
        simulate(schedule, lambda a: cost if a.kind is Kind.B and a.stage == 1 else 1.0, cores=2)
    assert str(err.value) == f"action 1B0 of rank 1 costs {cost!r}: a cost is seconds >= 0"
