"""V-Min, V-Half, ZB-2P, Eager1F1B and DualPipeV: exact lists, activation memory and bubbles against the
published results, and their registry entries.

Memory is counted in *chunk activations*: one stage's activations of one micro-batch (``rank_peak``: F
run, last backward action not). On the V a chunk is half of a rank's layers, so 1F1B's peak -- the
first stage's ``p`` micro-batches of a whole stage -- is ``2p`` chunks there. Bubbles are compared at
equal work: F = B = W = 1 per stage (a V's chunks 1/2 each), 1F1B's whole backward 2.
"""
from __future__ import annotations

import re

import pytest

from schedule_util import as_strings, chain_routes, rank_peak
from staticpipe.schedule import (Kind, dualpipe_v, eager_one_f_one_b, get_kind, lower, make_schedule, one_f_one_b,
                                 simulate, v_half, v_min, zb_2p)
from staticpipe.schedule.actions import W

pytestmark = pytest.mark.timeout(120)

HALF = {"F": 0.5, "B": 0.5, "W": 0.5}  # a V's chunk is half a stage
WHOLE = {"F": 1, "B": 2}  # 1F1B: B is the whole backward


def idle(sim):
    """Time a rank idles between its first and its last action, at the longest such span (the papers'
    bubble in time; all ranks here do the same work)."""
    spans = {}
    for r, _, start, end in sim.events:
        first, last = spans.get(r, (start, end))
        spans[r] = (min(first, start), max(last, end))
    return max(e - s for s, e in spans.values()) - max(sim.busy.values())


# ----------------------------------------------------------------------------- V-Min and V-Half

V_MIN_P2_M4 = {
    0: "0F0 3F0 3B0 3W0 0F1 0B0 0W0 3F1 3B1 3W1 0F2 0B1 0W1 3F2 3B2 3W2 0F3 0B2 0W2 3F3 3B3 3W3 0B3 0W3 0OPT 3OPT",
    1: "1F0 2F0 2B0 1B0 1F1 2F1 2W0 1W0 2B1 1B1 1F2 2F2 2W1 1W1 2B2 1B2 1F3 2F3 2W2 1W2 2B3 1B3 2W3 1W3 1OPT 2OPT",
}
V_HALF_P2_M4 = {
    0: "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 0B0 3W1 0W0 3F2 0F3 3B2 0B1 3W2 0W1 3F3 3B3 0B2 3W3 0B3 0W2 0W3 0OPT 3OPT",
    1: "1F0 2F0 1F1 2F1 2B0 2W0 1B0 1W0 1F2 2F2 2B1 2W1 1B1 1W1 1F3 2F3 2B2 1B2 2B3 1B3 2W2 1W2 2W3 1W3 1OPT 2OPT",
}
V_MIN_P3_M3 = {  # 3 divides p: the B's of the block move 2 slots later
    0: "0F0 0F1 0F2 5F0 5B0 5W0 5F1 5B1 5W1 0B0 0W0 5F2 5B2 0B1 5W2 0W1 0B2 0W2 0OPT 5OPT",
    1: "1F0 1F1 4F0 4F1 4B0 4W0 1F2 1B0 1W0 4B1 4W1 4F2 1B1 4B2 1W1 4W2 1B2 1W2 1OPT 4OPT",
    2: "2F0 3F0 2F1 3F1 3B0 2B0 3W0 2W0 2F2 3F2 3B1 2B1 3W1 2W1 3B2 2B2 3W2 2W2 2OPT 3OPT",
}


def test_v_shapes_exact():
    assert as_strings(v_min(2, 4)) == as_strings(make_schedule("V-Min", 2, 4, 2)) == V_MIN_P2_M4
    assert as_strings(v_half(2, 4)) == as_strings(make_schedule("V-Half", 2, 4, 2)) == V_HALF_P2_M4
    assert as_strings(v_min(3, 3)) == V_MIN_P3_M3


def block_peaks(p, m, offsets):
    """Each rank's peak when the building block alone is repeated every 6 slots (no squeezing): the W of
    every B in the first free slot after it, in the order of the B's; activations live from F to W."""
    peaks = []
    for r in range(p):
        at = {t + 6 * mb: (kind, mb) for mb in range(m) for t, kind in zip(offsets(p, r), "FFBB")}
        live = peak = waiting = 0
        for t in range(max(at) + 2 * m + 1):
            kind = at.get(t, ("", 0))[0]
            if kind == "F":
                live += 1
            elif kind == "B":
                waiting += 1
            elif waiting:
                live, waiting = live - 1, waiting - 1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def paper_v_min(p, r):  # F chunk 0, F chunk 1, B chunk 1, B chunk 0; the B's 2 later where 3 divides p
    d = 2 if p % 3 == 0 else 0
    return r, 2 * p - 1 - r, 2 * p + d + r, 4 * p + d - 1 - r


def paper_v_half(p, r):  # the B's 3 later for even p
    d = 3 if p % 2 == 0 else 0
    return 2 * r, 3 * p - 2 - r, 3 * p + d - 1 + 2 * r, 6 * p + d - 2 - r


@pytest.mark.parametrize("name, offsets, published", [
    ("V-Min", paper_v_min, lambda p: (p + 4) // 3), ("V-Half", paper_v_half, lambda p: (p + 2) // 2)])
def test_v_shapes_hold_the_building_blocks_peak(name, offsets, published):
    """Per rank, exactly the activations the paper's building block holds when repeated (squeezing the
    fill and the drain never raises a rank's peak); its largest is the published ``(p + 4) // 3``
    (V-Min) or ``(p + 2) // 2`` (V-Half) micro-batches of a whole rank, i.e. twice that in chunks,
    against 1F1B's 2p: a third and a half of it as p grows (p = 8: 8 and 10 chunks against 16)."""
    for p in range(1, 9):
        for m in (p, 2 * p, 3 * p):
            peaks = [rank_peak(acts) for acts in make_schedule(name, p, m, 2).values()]
            assert peaks == block_peaks(p, m, offsets), (p, m)
            assert max(peaks) == 2 * published(p) <= 2 * p + 2, (p, m)
    assert [rank_peak(a) for a in v_min(4, 8).values()] == [4, 4, 4, 4]  # 1F1B: 8
    assert [rank_peak(a) for a in v_min(5, 10).values()] == [4, 6, 6, 4, 6]  # 1F1B: 10
    assert [rank_peak(a) for a in v_half(4, 8).values()] == [6, 6, 6, 6]
    assert [rank_peak(a) for a in v_half(6, 12).values()] == [8] * 6  # 1F1B: 12


def test_v_shapes_bubble_against_the_papers():
    """Published bubbles, as fractions of 1F1B's B = (p-1)/(m+p-1) (Qi et al. 2024): V-Min about 2B/3
    (plus a constant), V-Half B/2. In idle time per rank at equal work, 1F1B idles 3 (p - 1); V-Min at
    most 2 (p - 1), V-Half at most 3 (p - 1) / 2, at every m (the block repeats, its idle time does not).
    Throughput: both at or above 1F1B's at every p and m."""
    for p in range(2, 9):
        for m in (p, 2 * p, 3 * p):
            one = simulate(one_f_one_b(p, m), WHOLE)
            v_min_sim, v_half_sim = simulate(v_min(p, m), HALF), simulate(v_half(p, m), HALF)
            assert idle(one) == pytest.approx(3 * (p - 1))
            assert idle(v_min_sim) <= 2 * (p - 1) + 1e-9, (p, m)
            assert idle(v_half_sim) <= 1.5 * (p - 1) + 1e-9, (p, m)
            assert v_half_sim.total <= v_min_sim.total <= one.total, (p, m)
    sims = {name: simulate(make_schedule(name, 4, 8, 2), HALF) for name in ("V-Min", "V-Half")}
    assert {n: (s.total, round(s.bubble, 4)) for n, s in sims.items()} == {"V-Min": (29.5, 0.1864),
                                                                             "V-Half": (26.5, 0.0943)}
    assert round(simulate(one_f_one_b(4, 8), WHOLE).bubble, 4) == 0.2727  # B = 3/11


# ----------------------------------------------------------------------------- ZB-2P

ZB_2P_P3_M6 = {  # warm-up of 2 (p - s) - 1 forwards; the W's wait for the forwards to run out
    0: "0F0 0F1 0F2 0F3 0F4 0B0 0F5 0B1 0W0 0B2 0W1 0B3 0W2 0B4 0W3 0B5 0W4 0W5 0OPT",
    1: "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1W0 1B4 1W1 1B5 1W2 1W3 1W4 1W5 1OPT",
    2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4 2F5 2B5 2W0 2W1 2W2 2W3 2W4 2W5 2OPT",
}


def test_zb_2p_exact_and_zero_bubble_at_twice_the_memory():
    """The paper's ZB-2P: no rank idles between its first and last action once m >= 2p - 1 (the
    published bubble 0; ZB-H1, its 1F1B-memory sibling, idles p - 1 per rank), every rank holding 2p
    micro-batches' activations, twice 1F1B's first stage; the step still takes 3m + p - 1 (the last
    rank starts p - 1 late)."""
    assert as_strings(zb_2p(3, 6)) == as_strings(make_schedule("ZB-2P", 3, 6)) == ZB_2P_P3_M6
    for p in range(1, 9):
        for m in range(p, 4 * p):
            sched = make_schedule("ZB-2P", p, m)
            sim = simulate(sched)
            assert sim.total == 3 * m + p - 1, (p, m)
            assert (sim.span_bubble == 0) == (m >= 2 * p - 1), (p, m, sim.span_bubble)
            assert [rank_peak(a) for a in sched.values()] == [min(2 * p, m)] * p, (p, m)
            if m >= 2 * p - 1:
                assert idle(simulate(make_schedule("ZB-H1", p, m))) == pytest.approx(p - 1)


# ----------------------------------------------------------------------------- Eager1F1B

def paddle_eager_order(p, m, s):
    """Paddle's Eager1F1B job list for stage s, as its pass writes it: 2 (p - s) - 1 forwards, then a
    backward and a forward while forwards remain, then the backwards."""
    warmup = 2 * (p - s) - 1
    jobs = [f"{s}F{i}" for i in range(warmup)]
    for k in range(m - warmup):
        jobs += [f"{s}B{k}", f"{s}F{warmup + k}"]
    return " ".join(jobs + [f"{s}B{k}" for k in range(m - warmup, m)] + [f"{s}OPT"])


def test_eager_1f1b_is_paddles_order():
    assert as_strings(eager_one_f_one_b(3, 6)) == {
        0: "0F0 0F1 0F2 0F3 0F4 0B0 0F5 0B1 0B2 0B3 0B4 0B5 0OPT",
        1: "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5 1OPT",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4 2F5 2B5 2OPT"}
    for p in range(1, 6):
        for m in range(2 * p - 1, 3 * p + 2):
            assert as_strings(make_schedule("Eager1F1B", p, m)) == {s: paddle_eager_order(p, m, s) for s in range(p)}
            assert simulate(make_schedule("Eager1F1B", p, m)).peak_inflight == {s: 2 * (p - s) - 1 for s in range(p)}


def test_eager_1f1b_overlaps_messages():
    """Without message costs exactly 1F1B's step; with them (a SEND or RECV occupying its rank) the extra
    warm-up hides part of them from p = 3 on: p = 4, m = 8, 0.25 per message: 40 units against 42.5."""
    for p in range(2, 5):
        for m in (2 * p, 4 * p):
            routes = chain_routes(p)
            for cost in (0, 0.25, 0.5):
                costs = dict(WHOLE, SEND=cost, RECV=cost)
                one = simulate(lower(make_schedule("1F1B", p, m), routes), costs).total
                eager = simulate(lower(make_schedule("Eager1F1B", p, m), routes), costs).total
                assert eager == one if cost == 0 or p == 2 else eager < one, (p, m, cost)
    costs = dict(WHOLE, SEND=0.25, RECV=0.25)
    assert [simulate(lower(make_schedule(n, 4, 8), chain_routes(4)), costs).total
            for n in ("1F1B", "Eager1F1B")] == [42.5, 40.0]


# ----------------------------------------------------------------------------- DualPipeV

DUALPIPE_V_P2_M4 = {
    0: "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3&3B1 3W1 3F2&0B0 0W0 3B2 3W2 3F3&0B1 0W1 3B3 3W3 0B2 0W2 0B3 0W3 0OPT 3OPT",
    1: "1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2&1B0 1W0 1F3&2B1 2W1 2F3&1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3 1OPT 2OPT",
}
DUALPIPE_V_P3_M6_RANK1 = ("1F0 1F1 1F2 4F0 1F3 4F1 4B0 4W0 4F2 1F4&4B1 4W1 4F3&1B0 1W0 1F5&4B2 4W2 4F4&1B1 1W1 "
                          "4B3 4W3 4F5&1B2 1W2 4B4 4W4 1B3 1W3 4B5 1B4 4W5 1B5 1W4 1W5 1OPT 4OPT")


def test_dualpipe_v_exact():
    assert as_strings(dualpipe_v(2, 4)) == as_strings(make_schedule("DualPipeV", 2, 4, 2)) == DUALPIPE_V_P2_M4
    assert as_strings(dualpipe_v(3, 6))[1] == DUALPIPE_V_P3_M6_RANK1


def test_dualpipe_v_pairs_and_steps():
    """Rank r pairs chunk 0's F with chunk 1's B and back (2 (m - 2p + r + 1) + p - r - 1 pairs; the last
    rank's first F and B unpaired), each paired B a full backward (its W right after); every F of chunk
    0 comes before any B of chunk 0 can return, the first 2 (p - r - 1) + r + 1 of them unpaired."""
    for p in range(1, 6):
        for m in range(2 * p, 3 * p + 2):
            for r, acts in dualpipe_v(p, m).items():
                pairs = [i for i, a in enumerate(acts) if a.kind is Kind.FB]
                assert len(pairs) == 2 * (m - 2 * p + r + 1) + p - r - 1 - (r == p - 1), (p, m, r)
                for i in pairs:
                    f, b = acts[i].halves()
                    assert {f.stage, b.stage} == {r, 2 * p - 1 - r}
                    assert acts[i + 1] == W(b.stage, b.microbatch)
                assert [a.kind for a in acts[:2 * (p - r - 1) + 1]] == [Kind.F] * (2 * (p - r - 1) + 1)


def test_dualpipe_v_memory_and_bubble_against_its_readme():
    """DualPipe's README: activations PP + 1 per device (PP = 2p stages, in chunks) and a bubble of
    (PP/2 - 1)(F&B + B - 3W) per device, B a full backward and F&B an overlapped forward and full
    backward: here FB + W. The simulator's idle time stays within it at any costs (at unit chunk costs
    p - 1 against the README's 2 (p - 1)); priced as overlapped ({"FB": 1.5}), the step gets shorter."""
    for p in range(1, 7):
        for m in (2 * p, 3 * p):
            assert max(rank_peak(a) for a in dualpipe_v(p, m).values()) == 2 * p + 1, (p, m)
            for f, b, w, fb in ((1, 1, 1, None), (1, 2, 1, None), (1, 1, 0.5, None), (2, 1, 1, None),
                                (1, 1, 1, 1.5)):
                costs = {"F": f, "B": b, "W": w} | ({"FB": fb} if fb else {})
                sim = simulate(dualpipe_v(p, m), costs)
                paired = fb if fb else f + b
                readme = (p - 1) * ((paired + w) + (b + w) - 3 * w)
                assert sim.total - max(sim.busy.values()) <= readme + 1e-9, (p, m, costs)
    unit, overlapped = simulate(dualpipe_v(4, 8), HALF), simulate(dualpipe_v(4, 8), dict(HALF, FB=0.75))
    assert (unit.total, round(unit.bubble, 4), overlapped.total) == (25.5, 0.0588, 23.75)


# ----------------------------------------------------------------------------- registry

def test_new_kinds():
    assert [(k.name, k.split_backward, k.chunks, k.layout(3, k.chunks)) for k in map(get_kind, [
        "V-Min", "V-Half", "ZB-2P", "Eager1F1B", "DualPipeV"])] == [
        ("V-Min", True, 2, [0, 1, 2, 2, 1, 0]), ("V-Half", True, 2, [0, 1, 2, 2, 1, 0]), ("ZB-2P", True, 1, [0, 1, 2]),
        ("Eager1F1B", False, 1, [0, 1, 2]), ("DualPipeV", True, 2, [0, 1, 2, 2, 1, 0])]


@pytest.mark.parametrize("name, p, m, v, message", [
    ("V-Min", 2, 4, 1, "schedule V-Min needs 2 chunks per device (stages = 2 x devices); "
                       "the program has 2 stages on 2 devices"),
    ("V-Half", 3, 4, 3, "schedule V-Half needs 2 chunks per device (stages = 2 x devices); "
                        "the program has 9 stages on 3 devices"),
    ("DualPipeV", 2, 4, 1, "schedule DualPipeV needs 2 chunks per device (stages = 2 x devices); "
                           "the program has 2 stages on 2 devices"),
    ("ZB-2P", 2, 4, 2, "schedule ZB-2P needs 1 chunk per device (stages = devices); "
                       "the program has 4 stages on 2 devices"),
    ("Eager1F1B", 2, 4, 2, "schedule Eager1F1B needs 1 chunk per device (stages = devices); "
                           "the program has 4 stages on 2 devices"),
    ("Eager1F1B", 4, 6, 1, "schedule Eager1F1B needs num_microbatches >= 7 on 4 devices (2 x devices - 1: "
                           "stage 0's warm-up forwards, as Paddle's Eager1F1B pass requires); got 6"),
    ("DualPipeV", 3, 5, 2, "schedule DualPipeV needs num_microbatches >= 6 on 3 devices (2 x devices: every rank "
                           "fills both of its chunks before its first paired F&B); got 5"),
    ("DualPipeV", 1, 1, 2, "schedule DualPipeV needs num_microbatches >= 2 on 1 device (2 x devices: every rank "
                           "fills both of its chunks before its first paired F&B); got 1"),
])
def test_new_kinds_constraints(name, p, m, v, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make_schedule(name, p, m, v)
