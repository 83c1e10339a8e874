"""staticpipe.schedule beyond F-then-B and 1F1B: interleaved 1F1B, ZB-H1, ZB-V, the registry's
constraints, text and JSON forms, lowering of several stages per rank, and the validator's errors."""
from __future__ import annotations

import re

import pytest

from staticpipe.plan import BACKWARD, FORWARD, CutVar, Route, SectionRef
from staticpipe.schedule import (Action, Kind, ScheduleError, format_schedule, get_kind, interleaved, lower,
                                 make_schedule, one_f_one_b, parse_action, parse_schedule, schedule_from_json,
                                 schedule_to_json, validate)

pytestmark = pytest.mark.timeout(120)


def as_strings(schedule):
    return {r: " ".join(map(str, acts)) for r, acts in schedule.items()}


def parsed(lines):
    return {r: [parse_action(t) for t in text.split()] for r, text in lines.items()}


def layout(name, p, v):
    return get_kind(name).layout(p, v)


# every (name, ranks, micro-batches, chunks) the sweeps below run
CASES = ([(n, p, m, 1) for n in ("F-then-B", "1F1B", "ZB-H1") for p in range(1, 5) for m in range(1, 2 * p + 3)]
         + [("interleaved", p, m, v) for p in range(1, 5) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)]
         + [("ZB-V", p, m, 2) for p in range(1, 5) for m in range(1, 2 * p + 3)])


# ----------------------------------------------------------------------------- interleaved 1F1B

INTERLEAVED_P2_V2_M4 = {
    0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 0OPT 2OPT",
    1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 1OPT 3OPT",
}


def test_interleaved_exact_p2_v2_m4():
    assert as_strings(interleaved(2, 4, 2)) == INTERLEAVED_P2_V2_M4
    assert as_strings(make_schedule("Interleaved1F1B", 2, 4, 2)) == INTERLEAVED_P2_V2_M4


def megatron_order(p, m, v, r):
    """Megatron-LM's order written as nested loops: groups of p micro-batches, chunk by chunk."""
    forward = [(c * p + r, g * p + i) for g in range(m // p) for c in range(v) for i in range(p)]
    backward = [(c * p + r, g * p + i) for g in range(m // p) for c in reversed(range(v)) for i in range(p)]
    warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v) if v > 1 else min(p - r - 1, m)
    acts = [f"{s}F{mb}" for s, mb in forward[:warmup]]
    for (fs, fm), (bs, bm) in zip(forward[warmup:], backward):
        acts += [f"{fs}F{fm}", f"{bs}B{bm}"]
    acts += [f"{s}B{mb}" for s, mb in backward[len(forward) - warmup:]]
    return " ".join(acts + [f"{c * p + r}OPT" for c in range(v)])


@pytest.mark.parametrize("p, v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
def test_interleaved_matches_megatron_order(p, v):
    assert megatron_order(2, 4, 2, 0) == INTERLEAVED_P2_V2_M4[0]
    for m in (p, 2 * p, 3 * p):
        assert as_strings(interleaved(p, m, v)) == {r: megatron_order(p, m, v, r) for r in range(p)}


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_interleaved_with_one_chunk_is_1f1b(p):
    for m in (p, 2 * p, 3 * p):
        assert make_schedule("interleaved", p, m, 1) == one_f_one_b(p, m) == make_schedule("1F1B", p, m)


# ----------------------------------------------------------------------------- zero bubble

ZB_H1_P4_M8 = {  # the paper's ZB-H1 shape: stage s delays its first W by s backwards, then F B W
    0: "0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0F6 0B3 0W3 0F7 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7 0OPT",
    1: "1F0 1F1 1F2 1B0 1F3 1B1 1W0 1F4 1B2 1W1 1F5 1B3 1W2 1F6 1B4 1W3 1F7 1B5 1W4 1B6 1W5 1B7 1W6 1W7 1OPT",
    2: "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2W0 2F4 2B3 2W1 2F5 2B4 2W2 2F6 2B5 2W3 2F7 2B6 2W4 2B7 2W5 2W6 2W7 2OPT",
    3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 3F7 3B7 3W4 3W5 3W6 3W7 3OPT",
}

ZB_V_P2_M4 = {
    0: "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 0B0 0W0 0F3 0B1 3W1 3F2 3B2 0W1 3W2 0B2 0W2 3F3 3B3 3W3 0B3 0W3 "
       "0OPT 3OPT",
    1: "1F0 2F0 1F1 2F1 2B0 1B0 2W0 1F2 2B1 1B1 1W0 2F2 2W1 1F3 2B2 1B2 1W1 2F3 2W2 1W2 2B3 1B3 2W3 1W3 "
       "1OPT 2OPT",
}


def test_zero_bubble_exact():
    assert as_strings(make_schedule("ZB-H1", 4, 8)) == ZB_H1_P4_M8
    assert as_strings(make_schedule("ZB-V", 2, 4, 2)) == ZB_V_P2_M4


def rank_peak(actions):
    """Most (stage, micro-batch) pairs a rank holds between F and W."""
    live, peak = set(), 0
    for a in actions:
        if a.kind is Kind.F:
            live.add((a.stage, a.microbatch))
        elif a.kind is Kind.W:
            live.discard((a.stage, a.microbatch))
        peak = max(peak, len(live))
    return peak


@pytest.mark.parametrize("name, v", [("ZB-H1", 1), ("ZB-V", 2)])
def test_zero_bubble_memory_stays_at_1f1b_peak(name, v):
    """No rank holds more than 1F1B's first stage: p micro-batches of a whole rank's layers."""
    for p in range(1, 5):
        for m in range(1, 3 * p + 1):
            sched = make_schedule(name, p, m, v)
            assert all(rank_peak(acts) <= min(p, m) * v for acts in sched.values()), (p, m)
            for acts in sched.values():  # each stage keeps 1F1B's warm-up limit between F and B
                for s in {a.stage for a in acts}:
                    live, peak = set(), 0
                    for a in acts:
                        if a.stage == s and a.kind in (Kind.F, Kind.B):
                            (live.add if a.kind is Kind.F else live.discard)(a.microbatch)
                            peak = max(peak, len(live))
                    assert peak <= p * v - s, (p, m, s)


# ----------------------------------------------------------------------------- registry

def test_kinds():
    assert [(k.name, k.split_backward, k.chunks) for k in map(get_kind, ["GPipe", "1F1B", "interleaved", "ZB-H1",
                                                                        "ZB-V"])] == [
        ("F-then-B", False, 1), ("1F1B", False, 1), ("interleaved", False, None), ("ZB-H1", True, 1),
        ("ZB-V", True, 2)]
    assert layout("1F1B", 4, 1) == [0, 1, 2, 3]
    assert layout("interleaved", 2, 3) == [0, 1, 0, 1, 0, 1]
    assert layout("ZB-V", 3, 2) == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize("name, p, m, v, message", [
    ("ZB-V", 3, 4, 1, "schedule ZB-V needs 2 chunks per device (stages = 2 x devices); "
                      "the program has 3 stages on 3 devices"),
    ("ZB-V", 2, 4, 3, "schedule ZB-V needs 2 chunks per device (stages = 2 x devices); "
                      "the program has 6 stages on 2 devices"),
    ("1F1B", 2, 4, 2, "schedule 1F1B needs 1 chunk per device (stages = devices); "
                      "the program has 4 stages on 2 devices"),
    ("ZB-H1", 2, 4, 2, "schedule ZB-H1 needs 1 chunk per device (stages = devices); "
                       "the program has 4 stages on 2 devices"),
    ("interleaved", 2, 5, 2, "interleaved 1F1B needs num_microbatches to be a multiple of the number of "
                             "devices (2); got 5: use 4 or 6"),
    ("interleaved", 4, 2, 2, "interleaved 1F1B needs num_microbatches to be a multiple of the number of "
                             "devices (4); got 2: use 4"),
    ("1F1B", 0, 4, 1, "num_ranks must be an integer >= 1, got 0"),
    ("interleaved", 2, 4, 0, "num_chunks must be an integer >= 1, got 0"),
    ("1F1B", 2, 0, 1, "num_microbatches must be an integer >= 1, got 0"),
])
def test_make_schedule_constraints(name, p, m, v, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make_schedule(name, p, m, v)


# ----------------------------------------------------------------------------- every schedule is valid

def cut(name):
    return (CutVar(name, (-1, 8), "float32", True),)


def chain_routes(num_stages):
    routes = [Route(s, SectionRef(s, FORWARD), SectionRef(s + 1, FORWARD), cut(f"h{s}"))
              for s in range(num_stages - 1)]
    return routes + [Route(num_stages - 1 + k, SectionRef(s + 1, BACKWARD), SectionRef(s, BACKWARD), cut(f"g{s}"))
                     for k, s in enumerate(reversed(range(num_stages - 1)))]


def all_pairs_routes(num_stages):
    pairs = [(SectionRef(s, a), SectionRef(t, b)) for s in range(num_stages) for t in range(s + 1, num_stages)
             for a, b in ((FORWARD, FORWARD), (FORWARD, BACKWARD))]
    pairs += [(SectionRef(t, BACKWARD), SectionRef(s, BACKWARD)) for s in range(num_stages)
              for t in range(s + 1, num_stages)]
    return [Route(k, src, dst, cut(f"v{k}")) for k, (src, dst) in enumerate(pairs)]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_every_schedule_validates_compute_only_and_lowered(name, p, m, v):
    kind = get_kind(name)
    sched = make_schedule(name, p, m, v)
    assert sorted(sched) == list(range(p))
    ranks = kind.layout(p, v)
    for s in (sched, lower(sched, chain_routes(p * v)), lower(sched, all_pairs_routes(p * v))):
        validate(s, p * v, m, ranks, split_backward=kind.split_backward, collectives=True)
    for r, acts in sched.items():  # OPTs last, one per stage of the rank, in stage order
        assert [str(a) for a in acts if a.kind is Kind.OPT] == [f"{s}OPT" for s, q in enumerate(ranks) if q == r]
        assert all(a.kind is Kind.OPT for a in acts[-v:])


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


# ----------------------------------------------------------------------------- text and JSON

@pytest.mark.parametrize("name, p, m, v", [c for c in CASES if c[2] <= 2 * c[1]])
def test_round_trips(name, p, m, v):
    sched = make_schedule(name, p, m, v)
    assert parse_schedule(format_schedule(sched)) == sched
    assert schedule_from_json(schedule_to_json(sched)) == sched
    lowered = lower(sched, chain_routes(p * v))
    assert schedule_from_json(schedule_to_json(lowered)) == lowered  # JSON keeps the routes
    # the text names a message by its stages and channel only, not its route index
    assert parse_schedule(format_schedule(lowered)) == {
        r: [Action(a.kind, a.stage, a.microbatch, None, a.peer, a.channel) for a in acts]
        for r, acts in lowered.items()}


def test_action_kind_from_text():
    assert Action("F", 0, 1) == Action(Kind.F, 0, 1) and Action("OPT", 2).kind is Kind.OPT
    with pytest.raises(ValueError, match="'X' is not a valid Kind"):
        Action("X", 0, 1)


def test_action_text():
    for text, action in [("0F3", Action(Kind.F, 0, 3)), ("12B0", Action(Kind.B, 12, 0)),
                         ("0W5", Action(Kind.W, 0, 5)), ("3OPT", Action(Kind.OPT, 3)),
                         ("0SEND_F3>1", Action(Kind.SEND, 0, 3, peer=1, channel="F")),
                         ("1RECV_FB3<0", Action(Kind.RECV, 1, 3, peer=0, channel="FB")),
                         ("2SEND_B10>1", Action(Kind.SEND, 2, 10, peer=1, channel="B"))]:
        assert parse_action(text) == action and str(action) == text
    assert schedule_to_json({0: [Action(Kind.SEND, 0, 3, 2, 1, "F"), Action(Kind.OPT, 0)]}) == (
        '{"0": [{"kind": "SEND", "stage": 0, "microbatch": 3, "route": 2, "peer": 1, "channel": "F"}, '
        '{"kind": "OPT", "stage": 0}]}')


@pytest.mark.parametrize("text", ["0X3", "F3", "0F", "0OPT1", "0SEND_F3<1", "1RECV_F3>0", "0SEND_X3>1", "", " 0F3"])
def test_bad_action_text(text):
    message = f"not an action: {text!r} (expected e.g. 0F3, 1B0, 0W5, 0OPT, 0SEND_F3>1, 1RECV_F3<0)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_action(text)


def test_bad_schedule_text():
    assert parse_schedule("\nrank 1: 1F0 1B0\n\nrank 0:\n") == {1: [Action(Kind.F, 1, 0), Action(Kind.B, 1, 0)], 0: []}
    with pytest.raises(ValueError, match=re.escape("not a schedule line: 'stage 0: 0F0' (expected 'rank <n>: <actions>')")):
        parse_schedule("stage 0: 0F0")
    with pytest.raises(ValueError, match=re.escape("rank 0 has two lines")):
        parse_schedule("rank 0: 0F0\nrank 0: 0B0")
    with pytest.raises(ValueError, match=re.escape("not an action: '0Q0'")):
        parse_schedule("rank 0: 0F0 0Q0")
    with pytest.raises(ValueError, match=re.escape("not an action: {'kind': 'Z', 'stage': 0}")):
        schedule_from_json('{"0": [{"kind": "Z", "stage": 0}]}')
    with pytest.raises(ValueError, match=re.escape("a JSON schedule is an object mapping each rank to a list")):
        schedule_from_json('[1, 2]')


# ----------------------------------------------------------------------------- validator errors

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
