"""``schedule/latency.py``: message latency in the cost model -- what a message costs in flight, on no rank.

Checked against hand-worked timelines, against the same schedule lowered (a RECV waits for its SEND's start
plus the latency), against the engine for ranks sharing cores, and the arguments' errors.
"""
from __future__ import annotations

import pytest

import staticpipe
from schedule_util import chain_routes
from staticpipe._paddle import paddle
from staticpipe.schedule import lower, make_schedule, simulate
from staticpipe.schedule.actions import OPT, B, F, W
from staticpipe.schedule.latency import link_latency, stage_lags

pytestmark = pytest.mark.timeout(120)

COSTS = {"F": 1.0, "B": 2.0, "W": 1.0}
FAMILIES = [("1F1B", 1), ("ZB-H1", 1), ("ZB-2P", 1), ("ZB-V", 2), ("V-Min", 2), ("V-Half", 2), ("DualPipeV", 2),
            ("interleaved", 2)]


def test_one_microbatch_waits_for_every_link_it_crosses_both_ways():
    # F0 [0,1], in flight 1.5, F1 [2.5,3.5], B1 [3.5,5.5], in flight 1.5, B0 [7,9], W0 [9,10]
    schedule = {0: [F(0, 0), B(0, 0), W(0, 0), OPT(0)], 1: [F(1, 0), B(1, 0), W(1, 0), OPT(1)]}
    sim = simulate(schedule, COSTS, comm=1.5)
    starts = {(r, str(a)): (s, e) for r, a, s, e in sim.events}
    assert starts[(1, "1F0")] == (2.5, 3.5) and starts[(0, "0B0")] == (7.0, 9.0) and sim.total == 10.0
    assert simulate(schedule, COSTS).total == 7.0


def test_a_link_within_a_rank_costs_nothing_and_links_are_priced_one_by_one():
    # ZB-V's rank 0 holds stages 0 and 3: the turn at the V's bottom (stage 1 -> 2) is on rank 1, free
    lags = stage_lags([0, 1, 1, 0], 4, link_latency({(0, 1): 2.0, (1, 0): 0.5}))
    assert lags == ([0.0, 2.0, 0.0, 0.5], [0.5, 0.0, 2.0, 0.0])  # F: from s - 1; B: from s + 1
    assert stage_lags([0, 1], 2, link_latency(0)) == ([0.0, 0.0], [0.0, 0.0])


@pytest.mark.parametrize("name,chunks", FAMILIES)
@pytest.mark.parametrize("comm", [0.0, 1.5, {(0, 1): 2.0, (1, 0): 0.5, (2, 3): 3.0}], ids=["free", "1.5", "per-link"])
def test_lowered_schedules_and_shared_cores_take_the_same_time_as_the_compute_order(name, chunks, comm):
    """The three engines agree: a RECV that waits for its SEND's start plus the latency (SENDs costing
    nothing) is the compute-only rule, and ranks with a core each run as if alone."""
    p = 4
    schedule = make_schedule(name, p, 8, chunks)
    lowered = lower(schedule, chain_routes(p * chunks))
    alone = simulate(schedule, COSTS, comm=comm)
    assert simulate(lowered, COSTS, comm=comm).total == alone.total
    assert simulate(schedule, COSTS, comm=comm, cores=p).total == pytest.approx(alone.total, abs=1e-9)
    assert simulate(lowered, COSTS, comm=comm, cores=p, collectives=True).total == pytest.approx(
        simulate(lowered, COSTS, comm=comm, collectives=True).total, abs=1e-9)
    if comm:
        assert alone.total > simulate(schedule, COSTS).total


def test_a_send_that_takes_time_delivers_at_the_later_of_its_end_and_its_start_plus_the_latency():
    lowered = lower(make_schedule("1F1B", 2, 1), chain_routes(2))
    costs = dict(COSTS, SEND=3.0)
    assert simulate(lowered, costs, comm=1.0).total == simulate(lowered, costs).total  # the SEND is slower
    assert simulate(lowered, costs, comm=5.0).total == simulate(lowered, costs).total + 2 * (5.0 - 3.0)


def test_sharing_cores_a_message_in_flight_leaves_the_core_to_the_other_rank():
    """Two ranks on one core: while stage 0's output is in flight rank 1 has nothing to run, so rank 0 runs
    at full speed; the step is the one-core step plus the latencies that nothing hides."""
    schedule = {0: [F(0, 0), B(0, 0), OPT(0)], 1: [F(1, 0), B(1, 0), OPT(1)]}
    costs = {"F": 1.0, "B": 2.0}
    assert simulate(schedule, costs, cores=1).total == 6.0
    assert simulate(schedule, costs, cores=1, comm=0.25).total == 6.5


def test_arguments_are_checked_and_name_the_fault():
    with pytest.raises(ValueError, match=r"comm must be seconds >= 0, a mapping .* got -1"):
        simulate(make_schedule("1F1B", 2, 2), comm=-1)
    with pytest.raises(ValueError, match=r"comm\[\(0, 1\)\] must be seconds >= 0, got 'fast'"):
        simulate(make_schedule("1F1B", 2, 2), comm={(0, 1): "fast"})
    with pytest.raises(ValueError, match=r"comm keys must be \(source rank, destination rank\) pairs, got 'gpu:0'"):
        link_latency({"gpu:0": 1.0})
    with pytest.raises(ValueError, match=r"comm gives the link from rank 1 to rank 0 nan; it must be seconds >= 0"):
        simulate(make_schedule("1F1B", 2, 2), comm=lambda src, dst: float("nan"))
    with pytest.raises(ValueError, match=r"comm is for the schedules that plan by measured costs \(.*\); schedule "
                                         r"1F1B does not use it"):
        make_schedule("1F1B", 2, 2, comm=1.0)
    assert make_schedule("1F1B", 2, 2, comm=0) == make_schedule("1F1B", 2, 2)
    with pytest.raises(ValueError, match=r"schedule_comm is for the schedules that plan by measured costs .*schedule "
                                         r"1F1B does not use it"):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), 2, schedule="1F1B", schedule_comm=1.0)
    with pytest.raises(ValueError, match=r"schedule_comm plans the order of a named schedule .*a custom schedule"):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), 1, schedule={0: ["0F0", "0B0", "0OPT"]},
                                     schedule_comm=1.0)
