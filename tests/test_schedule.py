"""Schedule generators (F-then-B, 1F1B, interleaved, ZB-H1, ZB-V): exact lists, invariants, and the registry."""
from __future__ import annotations

import re

import pytest

from schedule_util import as_strings, rank_peak
from staticpipe.schedule import (Action, Kind, ScheduleError, canonical_name, check_microbatches, f_then_b, get_kind,
                                 interleaved, make_schedule, one_f_one_b, parse_action, validate)

pytestmark = pytest.mark.timeout(120)

KNOWN = ("F-then-B (aliases FThenB, GPipe), 1F1B, interleaved (aliases Interleaved1F1B, interleaved-1F1B), "
         "ZB-H1, ZB-V, V-Min, V-Half, ZB-2P, Eager1F1B, DualPipeV")


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


@pytest.mark.parametrize("name", ["1F1", "rank 0: 0F0 0B0 0OPT"])
def test_one_action_or_a_whole_custom_text_is_an_unknown_name(name):
    """Text that reads as actions without its rank lines is refused as such (test_schedule_text.py)."""
    with pytest.raises(ValueError, match=f"^{re.escape(f'unknown schedule {name!r}; known schedules: {KNOWN}')}$"):
        canonical_name(name)


def parsed(text: dict) -> dict:
    return {r: [parse_action(t) for t in line.split()] for r, line in text.items()}


# the backward not split: stage 1's actions for 4 micro-batches, as 1F1B runs them on the last of 2 ranks
LAST = "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1OPT"


SPLITS = ("a W action splits the backward (with none, a B runs the whole backward), so every stage needs a W of each "
          "micro-batch after its B")


@pytest.mark.parametrize("rank0, step, problem", [
    # one W in a schedule of whole backwards: it splits them all, and is named first
    ("0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0W0 0OPT", 8, f"{SPLITS}; stage 0 lacks W of micro-batches 1, 2, 3"),
    ("0F0 0F1 0F2 0F3 0W0 0B0 0B1 0B2 0B3 0OPT", 4, f"{SPLITS}; stage 0 lacks W of micro-batches 1, 2, 3"),
    # a W where its B should be: the W has no B
    ("0F0 0F1 0F2 0F3 0W0 0B1 0B2 0B3 0OPT", 4,
     "W of micro-batch 0 has no B on stage 0 (stage 0 lacks B of micro-batch 0)"),
    # a B whose F is missing
    ("0F0 0F2 0F3 0B0 0B1 0B2 0B3 0OPT", 4,
     "B of micro-batch 1 has no F on stage 0 (stage 0 lacks F of micro-batch 1)"),
])
def test_a_missing_action_is_reported_after_the_action_at_fault(rank0, step, problem):
    action = rank0.split()[step]
    message = f"rank 0, step {step}, action {action}: {problem}"
    with pytest.raises(ScheduleError, match=f"^{re.escape(message)}$") as err:
        validate(parsed({0: rank0, 1: LAST}), 2, 4, [0, 1], split_backward="W" in rank0)
    assert (err.value.rank, err.value.step, str(err.value.action)) == (0, step, action)


def test_a_missing_action_with_no_action_at_fault_names_the_stage():
    """No W at all, or every stage but one with all its W's: the stage that lacks them is the fault."""
    whole = "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0OPT"
    with pytest.raises(ScheduleError, match=r"^stage 0 lacks W of micro-batches 0, 1, 2, 3$"):
        validate(parsed({0: whole, 1: LAST}), 2, 4, [0, 1], split_backward=True)
    split = "1F0 1B0 1W0 1F1 1B1 1W1 1F2 1B2 1W2 1F3 1B3 1W3 1OPT"
    with pytest.raises(ScheduleError, match=r"^stage 0 lacks W of micro-batches 1, 2, 3$") as err:
        validate(parsed({0: whole.replace("0B3", "0B3 0W0"), 1: split}), 2, 4, [0, 1], split_backward=True)
    assert (err.value.rank, err.value.step, err.value.action) == (0, None, None)


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


def layout(name, p, v):
    return get_kind(name).layout(p, v)


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
