"""Lowering compute schedules to SEND/RECV actions, freedom from deadlock, and the validator's errors."""
from __future__ import annotations

import re

import pytest

from schedule_util import CASES, all_pairs_routes, as_strings, chain_routes, cut, route
from staticpipe.plan import BACKWARD, FORWARD, Route, SectionRef
from staticpipe.schedule import (Action, Kind, ScheduleError, f_then_b, get_kind, lower, make_schedule, one_f_one_b,
                                 parse_action, validate)

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------- lowering

def test_lower_two_stages_one_f_one_b_exact():
    routes = chain_routes(2)
    assert [(r.index, r.channel) for r in routes] == [(0, "F"), (1, "B")]
    lowered = lower(one_f_one_b(2, 3), routes)
    assert as_strings(lowered) == {
        0: "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0F2 0SEND_F2>1 0RECV_B1<1 0B1 0RECV_B2<1 0B2 0OPT",
        1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1RECV_F2<0 1F2 1B2 1SEND_B2>0 1OPT",
    }
    assert lowered[0][1] == Action(Kind.SEND, 0, 0, route=0, peer=1, channel="F")
    assert lowered[0][4] == Action(Kind.RECV, 0, 0, route=1, peer=1, channel="B")
    assert lowered[1][0] == Action(Kind.RECV, 1, 0, route=0, peer=0, channel="F")
    assert lowered[1][3] == Action(Kind.SEND, 1, 0, route=1, peer=0, channel="B")


def test_lower_two_stages_f_then_b_exact():
    lowered = lower(f_then_b(2, 3), chain_routes(2))
    assert as_strings(lowered) == {
        0: "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0F2 0SEND_F2>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0RECV_B2<1 0B2 0OPT",
        1: "1RECV_F0<0 1F0 1RECV_F1<0 1F1 1RECV_F2<0 1F2 1B0 1SEND_B0>0 1B1 1SEND_B1>0 1B2 1SEND_B2>0 1OPT",
    }


def test_lower_without_routes_is_identity():
    sched = one_f_one_b(3, 4)
    assert lower(sched, []) == sched


def skip_routes():
    """3 stages; route 1 carries a stage-0 forward value straight to stage 2's forward."""
    return [
        route(0, 0, FORWARD, 1, FORWARD, "a"),
        route(1, 0, FORWARD, 2, FORWARD, "a"),
        route(2, 1, FORWARD, 2, FORWARD, "b"),
        route(3, 2, BACKWARD, 1, BACKWARD, "b@GRAD"),
        route(4, 2, BACKWARD, 0, BACKWARD, "a@GRAD@RENAME@block0@0"),
        route(5, 1, BACKWARD, 0, BACKWARD, "a@GRAD@RENAME@block0@1"),
    ]


def test_lower_three_stages_with_skip_route():
    lowered = lower(one_f_one_b(3, 2), skip_routes())
    assert as_strings(lowered) == {
        0: "0F0 0SEND_F0>1 0SEND_F0>2 0F1 0SEND_F1>1 0SEND_F1>2 "
           "0RECV_B0<2 0RECV_B0<1 0B0 0RECV_B1<2 0RECV_B1<1 0B1 0OPT",
        1: "1RECV_F0<0 1F0 1SEND_F0>2 1RECV_F1<0 1F1 1SEND_F1>2 "
           "1RECV_B0<2 1B0 1SEND_B0>0 1RECV_B1<2 1B1 1SEND_B1>0 1OPT",
        2: "2RECV_F0<0 2RECV_F0<1 2F0 2B0 2SEND_B0>1 2SEND_B0>0 "
           "2RECV_F1<0 2RECV_F1<1 2F1 2B1 2SEND_B1>1 2SEND_B1>0 2OPT",
    }
    # on stage 2 every forward is preceded by its RECVs in route order: the skip route first
    acts = lowered[2]
    for i, a in enumerate(acts):
        if a.kind is Kind.F:
            assert [(b.kind, b.route, b.peer, b.microbatch) for b in acts[i - 2:i]] == [
                (Kind.RECV, 1, 0, a.microbatch), (Kind.RECV, 2, 1, a.microbatch)]


def test_lower_forward_to_backward_route():
    routes = chain_routes(2) + [route(2, 0, FORWARD, 1, BACKWARD, "x_kept")]
    assert routes[2].channel == "FB"
    lowered = lower(f_then_b(2, 2), routes)
    assert as_strings(lowered) == {
        0: "0F0 0SEND_F0>1 0SEND_FB0>1 0F1 0SEND_F1>1 0SEND_FB1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0OPT",
        1: "1RECV_F0<0 1F0 1RECV_F1<0 1F1 1RECV_FB0<0 1B0 1SEND_B0>0 1RECV_FB1<0 1B1 1SEND_B1>0 1OPT",
    }


def test_lowering_several_stages_per_rank():
    """Routes match the action's stage; a route between two stages of one rank is a SEND and a RECV
    on that rank; W and OPT get no messages."""
    lowered = lower(make_schedule("ZB-V", 2, 2, 2), chain_routes(4))
    assert as_strings(lowered) == {
        0: "0F0 0SEND_F0>1 0F1 0SEND_F1>1 3RECV_F0<2 3F0 3B0 3SEND_B0>2 3RECV_F1<2 3F1 3B1 3SEND_B1>2 "
           "0RECV_B0<1 0B0 3W0 0RECV_B1<1 0B1 0W0 3W1 0W1 0OPT 3OPT",
        1: "1RECV_F0<0 1F0 1SEND_F0>2 2RECV_F0<1 2F0 2SEND_F0>3 1RECV_F1<0 1F1 1SEND_F1>2 2RECV_F1<1 2F1 "
           "2SEND_F1>3 2RECV_B0<3 2B0 2SEND_B0>1 1RECV_B0<2 1B0 1SEND_B0>0 2RECV_B1<3 2B1 2SEND_B1>1 "
           "1RECV_B1<2 1B1 1SEND_B1>0 2W0 1W0 2W1 1W1 1OPT 2OPT",
    }
    assert lowered[1][2] == Action(Kind.SEND, 1, 0, route=1, peer=2, channel="F")
    assert lowered[1][3] == Action(Kind.RECV, 2, 0, route=1, peer=1, channel="F")


def test_lowering_refuses_routes_into_other_sections():
    bad = Route(0, SectionRef(0, FORWARD), SectionRef(1, "weight"), cut("x"))
    with pytest.raises(ValueError, match=re.escape("route 0 (stage 0 forward -> stage 1 weight): schedules move "
                                                   "cut variables only between forward and backward sections")):
        lower(make_schedule("ZB-H1", 2, 2), [bad])


# ----------------------------------------------------------------------------- deadlock freedom

class Deadlock(Exception):
    pass


def simulate(lowered):
    """Run every stage's list in order; a RECV waits for the SEND of the same (route, micro-batch);
    SENDs never block. Return the global execution order, or raise Deadlock."""
    ptr = {s: 0 for s in lowered}
    sent, received, order = set(), set(), []
    while any(ptr[s] < len(lowered[s]) for s in lowered):
        progress = False
        for s, acts in sorted(lowered.items()):
            while ptr[s] < len(acts):
                a = acts[ptr[s]]
                key = (a.route, a.microbatch)
                if a.kind is Kind.RECV:
                    if key not in sent:
                        break
                    assert key not in received, f"{a} received twice"
                    received.add(key)
                elif a.kind is Kind.SEND:
                    assert key not in sent, f"{a} sent twice"
                    sent.add(key)
                order.append(a)
                ptr[s] += 1
                progress = True
        if not progress:
            raise Deadlock({s: str(lowered[s][ptr[s]]) for s in lowered if ptr[s] < len(lowered[s])})
    assert sent == received, "every message sent must be received"
    return order


@pytest.mark.parametrize("name", ["F-then-B", "1F1B"])
@pytest.mark.parametrize("make_routes", [chain_routes, all_pairs_routes], ids=["chain", "all-pairs"])
def test_lowered_schedules_never_deadlock(name, make_routes):
    for p in range(2, 5):
        routes = make_routes(p)
        for m in range(1, 7):
            lowered = lower(make_schedule(name, p, m), routes)
            order = simulate(lowered)
            assert len(order) == sum(len(v) for v in lowered.values())
            # one SEND and one RECV per route and micro-batch
            for k in (Kind.SEND, Kind.RECV):
                assert sorted((a.route, a.microbatch) for a in order if a.kind is k) == sorted(
                    (r.index, i) for r in routes for i in range(m))
            # compute respects each micro-batch's path F0 < F1 < ... < B1 < B0
            done = [(a.stage, a.kind, a.microbatch) for a in order if a.kind in (Kind.F, Kind.B)]
            for i in range(m):
                path = [(s, Kind.F, i) for s in range(p)] + [(s, Kind.B, i) for s in reversed(range(p))]
                assert sorted(path, key=done.index) == path


def test_simulator_detects_a_deadlock():
    # stage 0 tries to run a backward before its forward: it waits on stage 1, which waits on stage 0
    bad = {0: [Action(Kind.B, 0, 0), Action(Kind.F, 0, 0), Action(Kind.OPT, 0)],
           1: [Action(Kind.F, 1, 0), Action(Kind.B, 1, 0), Action(Kind.OPT, 1)]}
    with pytest.raises(Deadlock):
        simulate(lower(bad, chain_routes(2)))


# ----------------------------------------------------------------------------- every schedule is valid

@pytest.mark.parametrize("name, p, m, v", CASES)
def test_every_schedule_validates_compute_only_and_lowered(name, p, m, v):
    kind = get_kind(name)
    sched = make_schedule(name, p, m, v)
    assert sorted(sched) == list(range(p))
    ranks = kind.layout(p, v)
    for s in (sched, lower(sched, chain_routes(p * v)), lower(sched, all_pairs_routes(p * v, plan_order=False))):
        validate(s, p * v, m, ranks, split_backward=kind.split_backward, collectives=True)
    for r, acts in sched.items():  # OPTs last, one per stage of the rank, in stage order
        assert [str(a) for a in acts if a.kind is Kind.OPT] == [f"{s}OPT" for s, q in enumerate(ranks) if q == r]
        assert all(a.kind is Kind.OPT for a in acts[-v:])


# ----------------------------------------------------------------------------- validator errors

def parsed(lines):
    return {r: [parse_action(t) for t in text.split()] for r, text in lines.items()}


def raises(schedule, message, num_stages=2, m=2, ranks=(0, 1), split=False, collectives=False):
    with pytest.raises(ScheduleError, match=f"^{re.escape(message)}$") as info:
        validate(schedule, num_stages, m, list(ranks), split_backward=split, collectives=collectives)
    assert isinstance(info.value, ValueError)
    return info.value


def test_criss_cross_deadlock():
    """Each rank receives before it sends what the other is waiting for."""
    compute = parsed({0: "0F0 0B0 0F1 0B1 0OPT", 1: "1F1 1B1 1F0 1B0 1OPT"})
    err = raises(lower(compute, chain_routes(2)), "deadlock: rank 0 at step 2 (0RECV_B0<1) waits for 1SEND_B0>0 on route 1; "
                                                  "rank 1 at step 0 (1RECV_F1<0) waits for 0SEND_F1>1 on route 0")
    assert (err.rank, err.step, err.action) == (0, 2, Action(Kind.RECV, 0, 0, 1, 1, "B"))
    err = raises(compute, "deadlock: rank 0 at step 1 (0B0) waits for 1B0; rank 1 at step 0 (1F1) waits for 0F1")
    assert (err.rank, err.step, str(err.action)) == (0, 1, "0B0")


def test_opt_barrier_deadlock_only_with_collectives():
    sched = parsed({0: "0F0 0SEND_F0>1 0RECV_B0<1 0B0 0OPT", 1: "1RECV_F0<0 1F0 1B0 1OPT 1SEND_B0>0"})
    sched = {r: [Action(a.kind, a.stage, a.microbatch, 0 if a.channel == "F" else 1, a.peer, a.channel)
                 if a.kind in (Kind.SEND, Kind.RECV) else a for a in acts] for r, acts in sched.items()}
    validate(sched, 2, 1, [0, 1])
    raises(sched, "deadlock: rank 0 at step 2 (0RECV_B0<1) waits for 1SEND_B0>0 on route 1; rank 1 at step 3 (1OPT) waits "
                  "for the OPT barrier (rank 0 not there)", m=1, collectives=True)


def test_missing_and_duplicate_actions():
    err = raises(parsed({0: "0F0 0F1 0B0 0B1 0OPT", 1: "1F0 1B0 1F1 1OPT"}), "stage 1 lacks B of micro-batch 1")
    assert (err.rank, err.step, err.action) == (1, None, None)
    raises(parsed({0: "0F0 0F1 0B0 0B1 0OPT", 1: "1F0 1B0 1F1 1B1"}), "stage 1 lacks its OPT")
    raises(parsed({0: "0F0 0F1 0B0 0B1 0OPT", 1: "1F0 1B0 1F1 1B1 1OPT"}),
           "stage 0 lacks W of micro-batches 0, 1", split=True)
    raises(parsed({0: "0F0 0F1 0F1 0B0 0B1 0OPT", 1: "1F0 1B0 1F1 1B1 1OPT"}),
           "rank 0, step 2, action 0F1: stage 0 runs F of micro-batch 1 twice")
    raises(parsed({0: "0F0 0F1 0B0 0B1 0OPT 0OPT", 1: "1F0 1B0 1F1 1B1 1OPT"}),
           "rank 0, step 5, action 0OPT: stage 0 runs OPT twice")


def test_misplaced_and_malformed_actions():
    raises(parsed({0: "0F0 0F1 0B0 0B1 0OPT", 1: "0F0 1B0 1F1 1B1 1OPT"}),
           "rank 1, step 0, action 0F0: stage 0 is placed on rank 0, not rank 1")
    raises(parsed({0: "0F0 0F1 0B0 0B1 0OPT 0W0", 1: "1F0 1B0 1F1 1B1 1OPT"}),
           "rank 0, step 5, action 0W0: a W action, but this schedule does not split the backward "
           "(split_backward=False)")
    raises(parsed({0: "0F0 0F2 0B0 0B1 0OPT"}), "rank 0, step 1, action 0F2: micro-batch 2 does not exist "
                                                 "(micro-batches 0..1)")
    raises(parsed({0: "0F0 2F0"}), "rank 0, step 1, action 2F0: stage 2 does not exist (stages 0..1)")
    raises({0: ["0F0"]}, "rank 0, step 0: '0F0' is not an Action (parse_action reads text)")
    raises({0: [Action(Kind.SEND, 0, 0, peer=1, channel="F")]},
           "rank 0, step 0, action 0SEND_F0>1: SEND needs a route index, a peer stage other than its own (0..1) "
           "and a channel F, B or FB")
    with pytest.raises(ValueError, match=re.escape("stage_ranks has 1 entries for 2 stages")):
        validate({}, 2, 1, [0])


def test_order_within_a_stage():
    raises(parsed({0: "0F0 0F1 0F2 0B0 0B1 0B2 0OPT", 1: "1F0 1B0 1F1 1B1 1B2 1F2 1OPT"}),
           "rank 1, step 4, action 1B2: B of micro-batch 2 comes before its F on stage 1", m=3)
    raises(parsed({0: "0F0 0F1 0W0 0B0 0B1 0W1 0OPT", 1: "1F0 1B0 1W0 1F1 1B1 1W1 1OPT"}),
           "rank 0, step 2, action 0W0: W of micro-batch 0 comes before its B on stage 0", split=True)
    raises(parsed({0: "0F0 0F1 0B0 0OPT 0B1", 1: "1F0 1B0 1F1 1B1 1OPT"}),
           "rank 0, step 3, action 0OPT: OPT of stage 0 comes before its B of micro-batch 1")


def test_message_errors():
    good = lower(one_f_one_b(2, 2), chain_routes(2))
    validate(good, 2, 2, [0, 1])
    lost = {0: good[0], 1: [a for a in good[1] if str(a) != "1RECV_F1<0"]}
    raises(lost, "rank 0, step 3, action 0SEND_F1>1: route 0, micro-batch 1 is never received")
    twice = {0: good[0][:2] + good[0][1:], 1: good[1]}
    raises(twice, "rank 0, step 2, action 0SEND_F0>1: route 0, micro-batch 0 is sent twice "
                  "(also by rank 0, step 1, action 0SEND_F0>1)")
    wrong = {0: good[0], 1: [Action(Kind.RECV, 1, 0, 0, 0, "FB") if str(a) == "1RECV_F0<0" else a for a in good[1]]}
    raises(wrong, "rank 1, step 0, action 1RECV_FB0<0: route 0, micro-batch 0 was sent as 0SEND_F0>1 "
                  "(rank 0, step 1)")
    orphan = {0: good[0], 1: [Action(Kind.RECV, 1, 0, 7, 0, "F")] + good[1]}
    raises(orphan, "deadlock: rank 0 at step 4 (0RECV_B0<1) waits for 1SEND_B0>0 on route 1; "
                   "rank 1 at step 0 (1RECV_F0<0) waits for 0SEND_F0>1 on route 7")
