"""staticpipe.schedule: F-then-B and 1F1B action lists, the registry, and lowering with SEND/RECV actions."""
from __future__ import annotations

import re

import pytest

from staticpipe.plan import BACKWARD, FORWARD, CutVar, Route, SectionRef
from staticpipe.schedule import (Action, Kind, canonical_name, check_microbatches, f_then_b, format_schedule,
                                 get_kind, lower, make_schedule, one_f_one_b)

pytestmark = pytest.mark.timeout(120)

KNOWN = ("F-then-B (aliases FThenB, GPipe), 1F1B, interleaved (aliases Interleaved1F1B, interleaved-1F1B), "
         "ZB-H1, ZB-V")


def as_strings(schedule):
    return {s: " ".join(map(str, acts)) for s, acts in schedule.items()}


# ----------------------------------------------------------------------------- exact compute lists

F_THEN_B_M4 = {
    2: {0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0OPT",
        1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3 1OPT"},
    3: {0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0OPT",
        1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3 1OPT",
        2: "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3 2OPT"},
    4: {0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0OPT",
        1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3 1OPT",
        2: "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3 2OPT",
        3: "3F0 3F1 3F2 3F3 3B0 3B1 3B2 3B3 3OPT"},
}

ONE_F_ONE_B_M4 = {
    2: {0: "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3 0OPT",
        1: "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1OPT"},
    3: {0: "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3 0OPT",
        1: "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3 1OPT",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2OPT"},
    4: {0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0OPT",
        1: "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3 1OPT",
        2: "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2B3 2OPT",
        3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3OPT"},
}


@pytest.mark.parametrize("p", [2, 3, 4])
def test_f_then_b_exact_m4(p):
    assert as_strings(f_then_b(p, 4)) == F_THEN_B_M4[p]
    assert as_strings(make_schedule("F-then-B", p, 4)) == F_THEN_B_M4[p]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_one_f_one_b_exact_m4(p):
    assert as_strings(one_f_one_b(p, 4)) == ONE_F_ONE_B_M4[p]
    assert as_strings(make_schedule("1F1B", p, 4)) == ONE_F_ONE_B_M4[p]


def expected_f_then_b(p, m):
    return {s: " ".join([f"{s}F{i}" for i in range(m)] + [f"{s}B{i}" for i in range(m)] + [f"{s}OPT"])
            for s in range(p)}


def expected_one_f_one_b(p, m):
    """Greedy rule, independent of the code's warm-up arithmetic: run the next forward while fewer than
    p - s micro-batches are in flight on stage s and forwards remain, otherwise the oldest backward."""
    out = {}
    for s in range(p):
        acts, next_f, next_b = [], 0, 0
        while next_b < m:
            if next_f < m and next_f - next_b < p - s:
                acts.append(f"{s}F{next_f}")
                next_f += 1
            else:
                acts.append(f"{s}B{next_b}")
                next_b += 1
        out[s] = " ".join(acts + [f"{s}OPT"])
    return out


def test_independent_formulas_reproduce_the_literal_lists():
    for p in (2, 3, 4):
        assert expected_f_then_b(p, 4) == F_THEN_B_M4[p]
        assert expected_one_f_one_b(p, 4) == ONE_F_ONE_B_M4[p]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_schedules_exact_m8(p):
    assert as_strings(f_then_b(p, 8)) == expected_f_then_b(p, 8)
    assert as_strings(one_f_one_b(p, 8)) == expected_one_f_one_b(p, 8)
    # spot-check one literal m=8 list so the generator itself is anchored
    if p == 3:
        assert as_strings(one_f_one_b(3, 8))[1] == (
            "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3 1F5 1B4 1F6 1B5 1F7 1B6 1B7 1OPT")


def test_one_f_one_b_with_fewer_microbatches_than_stages():
    got = as_strings(one_f_one_b(4, 2))
    assert got == {
        0: "0F0 0F1 0B0 0B1 0OPT",
        1: "1F0 1F1 1B0 1B1 1OPT",
        2: "2F0 2F1 2B0 2B1 2OPT",
        # the last stage has no warm-up at all: at most p - s = 1 micro-batch in flight
        3: "3F0 3B0 3F1 3B1 3OPT",
    }
    # every stage but the last runs exactly the F-then-B order
    ftb = as_strings(f_then_b(4, 2))
    assert [got[s] == ftb[s] for s in range(4)] == [True, True, True, False]


def test_action_objects_and_format():
    sched = one_f_one_b(2, 2)
    assert sched[0] == [Action(Kind.F, 0, 0), Action(Kind.F, 0, 1), Action(Kind.B, 0, 0), Action(Kind.B, 0, 1),
                        Action(Kind.OPT, 0)]
    assert sched[0][-1].microbatch is None
    assert format_schedule(sched) == "rank 0: 0F0 0F1 0B0 0B1 0OPT\nrank 1: 1F0 1B0 1F1 1B1 1OPT"
    assert str(Action(Kind.SEND, 2, 5, route=3, peer=1, channel="B")) == "2SEND_B5>1"
    assert str(Action(Kind.RECV, 1, 0, route=0, peer=0, channel="FB")) == "1RECV_FB0<0"


# ----------------------------------------------------------------------------- invariants

def in_flight_profile(actions):
    """Largest number of micro-batches whose F ran and whose B did not, over the action list."""
    live, peak = set(), 0
    for a in actions:
        if a.kind is Kind.F:
            live.add(a.microbatch)
        elif a.kind is Kind.B:
            live.discard(a.microbatch)
        peak = max(peak, len(live))
    return peak


@pytest.mark.parametrize("name", ["F-then-B", "1F1B"])
def test_schedule_invariants(name):
    for p in range(1, 6):
        for m in range(1, 10):
            sched = make_schedule(name, p, m)
            assert sorted(sched) == list(range(p))
            for s, acts in sched.items():
                assert all(a.stage == s for a in acts)
                assert acts[-1] == Action(Kind.OPT, s)
                assert [a.kind for a in acts].count(Kind.OPT) == 1
                fs = [a.microbatch for a in acts if a.kind is Kind.F]
                bs = [a.microbatch for a in acts if a.kind is Kind.B]
                assert sorted(fs) == list(range(m)) and sorted(bs) == list(range(m)), (p, m, s)
                assert len(acts) == 2 * m + 1
                pos = {(a.kind, a.microbatch): i for i, a in enumerate(acts)}
                assert all(pos[(Kind.F, i)] < pos[(Kind.B, i)] for i in range(m)), (p, m, s)
                # micro-batches enter and leave in order
                assert fs == list(range(m)) and bs == list(range(m))
                peak = in_flight_profile(acts)
                if name == "1F1B":
                    assert peak <= p - s, (p, m, s)
                    assert peak == min(p - s, m), (p, m, s)
                else:
                    assert peak == m, (p, m, s)


# ----------------------------------------------------------------------------- registry

@pytest.mark.parametrize("alias, canonical", [
    ("F-then-B", "F-then-B"), ("FThenB", "F-then-B"), ("GPipe", "F-then-B"), ("1F1B", "1F1B"),
    ("interleaved", "interleaved"), ("Interleaved1F1B", "interleaved"), ("interleaved-1F1B", "interleaved"),
    ("ZB-H1", "ZB-H1"), ("ZB-V", "ZB-V"),
])
def test_canonical_names(alias, canonical):
    assert canonical_name(alias) == canonical
    assert get_kind(alias) is get_kind(canonical)
    assert get_kind(alias).name == canonical
    chunks = get_kind(canonical).chunks or 1
    assert as_strings(make_schedule(alias, 3, 6, chunks)) == as_strings(get_kind(canonical).generate(3, 6, chunks))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "PipeDream", "", "F then B", None, "zb-v", ["1F1B"]])
def test_unknown_schedule(name):
    message = f"unknown schedule {name!r}; known schedules: {KNOWN}"
    with pytest.raises(ValueError, match=re.escape(message)):
        canonical_name(name)
    with pytest.raises(ValueError, match=re.escape(message)):
        get_kind(name)
    with pytest.raises(ValueError, match=re.escape(message)):
        make_schedule(name, 2, 4)


@pytest.mark.parametrize("m", [0, -1, 2.5, True, False, "4", None])
def test_bad_num_microbatches(m):
    message = f"num_microbatches must be an integer >= 1, got {m!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        make_schedule("1F1B", 2, m)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_microbatches(m)


def test_check_microbatches_returns_value():
    assert check_microbatches(1) == 1
    assert check_microbatches(7) == 7


# ----------------------------------------------------------------------------- lowering

def cut(name):
    return (CutVar(name, (-1, 8), "float32", True),)


def route(index, src_stage, src_kind, dst_stage, dst_kind, name):
    return Route(index, SectionRef(src_stage, src_kind), SectionRef(dst_stage, dst_kind), cut(name))


def chain_routes(p):
    routes = [route(s, s, FORWARD, s + 1, FORWARD, f"h{s}") for s in range(p - 1)]
    routes += [route(p - 1 + k, s + 1, BACKWARD, s, BACKWARD, f"h{s}@GRAD")
               for k, s in enumerate(reversed(range(p - 1)))]
    return routes


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


def all_pairs_routes(p):
    """Chain routes plus every skip: forward s -> t, backward t -> s, and forward s -> backward t."""
    pairs = [(SectionRef(s, FORWARD), SectionRef(t, FORWARD)) for s in range(p) for t in range(s + 1, p)]
    pairs += [(SectionRef(t, BACKWARD), SectionRef(s, BACKWARD)) for s in range(p) for t in range(s + 1, p)]
    pairs += [(SectionRef(s, FORWARD), SectionRef(t, BACKWARD)) for s in range(p) for t in range(s + 1, p)]
    pairs.sort(key=lambda sd: (sd[0].order(p), sd[1].order(p)))
    return [Route(k, src, dst, cut(f"v{k}")) for k, (src, dst) in enumerate(pairs)]


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
