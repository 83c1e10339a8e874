"""staticpipe.schedule.simulate against known results, the Gantt chart, and the command line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from schedule_util import chain_routes
from staticpipe.schedule import (Action, Kind, ScheduleError, lower, make_schedule, parse_action, schedule_from_json,
                                 simulate)
from staticpipe.schedule.__main__ import main
from staticpipe.schedule.gantt import draw_gantt

pytestmark = pytest.mark.timeout(120)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[1]


def idle(sim):
    """Rank-time left idle: the bubble in time units rather than as a fraction of the step."""
    return len(sim.busy) * sim.total - sum(sim.busy.values())


# ----------------------------------------------------------------------------- known results

@pytest.mark.parametrize("name", ["F-then-B", "1F1B"])
@pytest.mark.parametrize("costs", [None, {"F": 1, "B": 2}], ids=["F=B=1", "F=1,B=2"])
def test_plain_schedules_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, costs):
    step = 2 if costs is None else 3
    for p in range(1, 6):
        for m in range(1, 9):
            sim = simulate(make_schedule(name, p, m), costs)
            assert sim.total == pytest.approx((m + p - 1) * step, abs=1e-9)
            assert sim.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-9), (p, m)
            assert sim.busy == {r: m * step for r in range(p)}


def test_peak_inflight():
    for p in range(1, 6):
        for m in range(p, 10):
            assert simulate(make_schedule("1F1B", p, m)).peak_inflight == {s: p - s for s in range(p)}
            assert simulate(make_schedule("F-then-B", p, m)).peak_inflight == dict.fromkeys(range(p), m)
            # W keeps the activations: ZB-H1 holds up to p on every stage, 1F1B's first-stage peak
            assert simulate(make_schedule("ZB-H1", p, m)).peak_inflight == dict.fromkeys(range(p), p)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_cuts_the_idle_time_by_v(p, v):
    """Each chunk costs 1/v of a stage: the fill and drain, (p - 1)(F + B) per rank, shrink v-fold.
    The bubble *fraction* shrinks less (the step gets shorter too): for p=4, m=8, v=2 it is 0.158
    against 1F1B's 0.273, not 0.136."""
    for m in (p, 2 * p, 4 * p):
        one = simulate(make_schedule("1F1B", p, m), {"F": 1, "B": 2})
        sim = simulate(make_schedule("interleaved", p, m, v), {"F": 1 / v, "B": 2 / v})
        assert idle(sim) == pytest.approx(idle(one) / v, abs=1e-9), m
        assert sim.total == pytest.approx(3 * m + 3 * (p - 1) / v, abs=1e-9)


def test_zb_h1_has_a_third_of_1f1b_idle_time():
    """Unit F = B = W = 1 against 1F1B with B + W as one backward of 2: 3m + p - 1 steps instead of
    3(m + p - 1), i.e. a third of the idle time; the bubble fraction is 0.111 against 0.273, 0.407 x."""
    for p in range(1, 6):
        for m in range(p, 3 * p + 1):
            zb = simulate(make_schedule("ZB-H1", p, m))
            one = simulate(make_schedule("1F1B", p, m), {"F": 1, "B": 2})
            assert zb.total == 3 * m + p - 1 and one.total == 3 * (m + p - 1)
            assert idle(zb) == pytest.approx(idle(one) / 3, abs=1e-9)
    zb, one = simulate(make_schedule("ZB-H1", 4, 8)), simulate(make_schedule("1F1B", 4, 8), {"F": 1, "B": 2})
    assert (zb.bubble, one.bubble) == (pytest.approx(3 / 27), pytest.approx(9 / 33))
    assert zb.bubble <= 0.41 * one.bubble


def test_zb_v_bubble():
    """Chunks cost half a stage (F = B = W = 1/2). ZB-V idles about (p - 1) / 2 per rank, a sixth of
    1F1B's 3 (p - 1); at p=4, m=8 its bubble is 1.5 / 25.5 = 0.059."""
    half = {"F": 0.5, "B": 0.5, "W": 0.5}
    sim = simulate(make_schedule("ZB-V", 4, 8, 2), half)
    assert (sim.total, sim.bubble) == (25.5, pytest.approx(1.5 / 25.5))
    for p in range(2, 5):
        for m in range(p, 2 * p + 3):
            sim = simulate(make_schedule("ZB-V", p, m, 2), half)
            assert 3 * m + (p - 1) / 2 <= sim.total <= 3 * m + (p - 1), (p, m)


def test_lowered_schedules_simulate_like_compute_only_ones():
    for name, v in [("1F1B", 1), ("interleaved", 2), ("ZB-V", 2)]:
        sched = make_schedule(name, 2, 4, v)
        plain, lowered = simulate(sched), simulate(lower(sched, chain_routes(2 * v)))
        assert (lowered.total, lowered.busy, lowered.peak_inflight) == (plain.total, plain.busy, plain.peak_inflight)
        slow = simulate(lower(sched, chain_routes(2 * v)), {"SEND": 0.25, "RECV": 0.25})
        assert slow.total > plain.total and slow.busy == plain.busy  # messages are not busy time


def test_per_action_costs_and_events():
    sched = make_schedule("F-then-B", 2, 1)
    price = {"0F0": 1, "1F0": 2, "1B0": 3, "0B0": 4, "0OPT": 0.5, "1OPT": 0}
    sim = simulate(sched, lambda a: price[str(a)])
    assert [(r, str(a), s, e) for r, a, s, e in sim.events] == [
        (0, "0F0", 0, 1), (1, "1F0", 1, 3), (1, "1B0", 3, 6), (0, "0B0", 6, 10), (1, "1OPT", 6, 6),
        (0, "0OPT", 10, 10.5)]  # by start time, then rank
    assert (sim.total, sim.busy, sim.bubble) == (10.5, {0: 5.5, 1: 5}, pytest.approx(1 - 10.5 / 21))


def test_bad_costs_and_deadlock():
    with pytest.raises(ValueError, match=re.escape("unknown action kind 'X' in costs; kinds: F, B, W, OPT, SEND, RECV")):
        simulate(make_schedule("1F1B", 2, 2), {"X": 1})
    stuck = {0: [Action(Kind.B, 0, 0), Action(Kind.F, 0, 0)], 1: [Action(Kind.F, 1, 0), Action(Kind.B, 1, 0)]}
    with pytest.raises(ScheduleError, match=re.escape("deadlock: rank 0 at step 0 (0B0) waits for 1B0; "
                                                      "rank 1 at step 0 (1F0) waits for 0F0")):
        simulate(stuck)


# ----------------------------------------------------------------------------- Gantt chart

def test_draw_gantt(tmp_path, monkeypatch):
    """The chart shows the timelines: one panel per timeline, one bar per event, in its rank's row, from its
    start to its end (raw events shifted to start at 0), in its kind's colour (a rank's later chunk drawn
    lighter); the legend names the kinds drawn. Then the PNG itself, decoded: its size, and at the centre of
    every compute box wide enough to sample (above its micro-batch label), the box's colour blended as
    drawn onto the white canvas. The figure is taken from ``savefig`` to map data to pixels."""
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    from staticpipe.schedule.gantt import COLORS, THIN

    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), savefig(fig, *a, **k))[1])
    path = tmp_path / "gantt.png"
    sim = simulate(lower(make_schedule("ZB-V", 2, 4, 2), chain_routes(4)), {"SEND": 0.1, "RECV": 0.1})
    raw = [(0, "0F0", 100.0, 100.5), (1, parse_action("1F0"), 100.5, 101.25), (1, "1B0", 101.25, 102.0)]
    draw_gantt({"measured": raw, "simulated": sim}, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC
    panels = {"measured": [(0, parse_action("0F0"), 0.0, 0.5), (1, parse_action("1F0"), 0.5, 1.25),
                           (1, parse_action("1B0"), 1.25, 2.0)],
              "simulated": sim.events}
    later_chunk = {(0, 3), (1, 2)}  # ZB-V on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    (fig,) = figures
    fig.set_dpi(100)  # the dpi it was saved with, so that transData maps to the PNG's pixels
    image = imread(str(path))  # RGBA floats, row 0 at the top
    assert image.shape == (390, 1200, 4)  # 12 x (0.5 + (0.45 * 2 ranks + 0.8) * 2 panels) inches at 100 dpi
    legend = fig.legends[0].get_window_extent()
    sampled = {}
    assert len(fig.axes) == len(panels)
    for ax, (name, events) in zip(fig.axes, panels.items()):
        assert ax.get_title(loc="left") == name
        assert len(ax.collections) == len(events)
        for bars, (r, a, s, e) in zip(ax.collections, events):
            (x0, y0), (x1, y1) = bars.get_paths()[0].get_extents().get_points()
            assert (x0, x1) == (pytest.approx(s, abs=1e-9), pytest.approx(e, abs=1e-9)), (name, r, str(a))
            assert r - 0.5 < y0 < y1 < r + 0.5, (name, r, str(a), y0, y1)  # inside its rank's row
            assert (y1 - y0 < 0.2) == (a.kind in THIN), (name, str(a))
            alpha = 1.0 if (r, a.stage) not in later_chunk else 0.55
            rgba = bars.get_facecolor()[0]
            assert tuple(rgba[:3]) == pytest.approx(to_rgb(COLORS[a.kind]), abs=1e-6), (name, str(a))
            assert bars.get_alpha() == pytest.approx(alpha), (name, str(a))
            left, top = ax.transData.transform(((s + e) / 2, r - 0.25))  # box spans r-0.35..r+0.25; label at r-0.05
            width = ax.transData.transform((e, r))[0] - ax.transData.transform((s, r))[0]
            if a.kind in THIN or width < 6 or legend.contains(left, top):
                continue
            blended = alpha * np.array(to_rgb(COLORS[a.kind])) + (1 - alpha)  # over the white background
            pixel = image[int(image.shape[0] - top), int(left)]  # display y counts from the bottom
            assert pixel[:3] == pytest.approx(blended, abs=0.02), (name, str(a), pixel, blended)
            sampled[a.kind] = sampled.get(a.kind, 0) + 1
    assert sampled.keys() == {Kind.F, Kind.B, Kind.W} and sum(sampled.values()) >= 20, sampled
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["F", "B", "W", "OPT", "SEND", "RECV"]
    white = (image[..., :3] > 0.99).all(axis=-1).mean()
    assert 0.3 < white < 0.95, white  # neither a blank canvas nor a flood


# ----------------------------------------------------------------------------- command line

CLI_1F1B = """\
rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3 0OPT
rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1OPT
simulated total: 10
bubble: 0.2000
span bubble: 0.2000
bound: 10 (the shortest step any order could have: the plan is 1.000x it)
peak in flight: stage 0: 2, stage 1: 1
"""


def test_cli_subprocess():
    out = subprocess.run([sys.executable, "-m", "staticpipe.schedule", "--schedule", "1F1B", "--stages", "2",
                          "--microbatches", "4"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out == CLI_1F1B


def test_cli(capsys, tmp_path):
    main(["--schedule", "interleaved", "--stages", "2", "--microbatches", "4", "--chunks", "2",
          "--png", str(tmp_path / "s.png")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 0OPT 2OPT",
                         "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 1OPT 3OPT"]
    assert lines[2:6] == ["simulated total: 9", "bubble: 0.1111", "span bubble: 0.1111",  # chunks cost 1/2 each
                          "bound: 9 (the shortest step any order could have: the plan is 1.000x it)"]
    assert lines[7] == f"wrote {tmp_path / 's.png'}"
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC

    main(["--schedule", "ZB-V", "--stages", "2", "--microbatches", "4", "--json", "--costs", "F=1,B=1,W=1"])
    out = capsys.readouterr().out.splitlines()
    assert schedule_from_json(out[0]) == make_schedule("ZB-V", 2, 4, 2)
    assert json.loads(out[0])["0"][0] == {"kind": "F", "stage": 0, "microbatch": 0}
    assert out[1:3] == ["simulated total: 25", "bubble: 0.0400"]


@pytest.mark.parametrize("args, error", [
    (["--schedule", "ZB-V", "--stages", "3", "--microbatches", "4", "--chunks", "1"],
     "schedule ZB-V needs 2 chunks per device (stages = 2 x devices); the program has 3 stages on 3 devices"),
    (["--schedule", "nope", "--stages", "2", "--microbatches", "4"], "unknown schedule 'nope'"),
    (["--stages", "2", "--microbatches", "4", "--costs", "F:1"], "costs must look like F=1,B=2; got 'F:1'"),
])
def test_cli_errors(capsys, args, error):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert error in capsys.readouterr().err


def test_schedule_package_imports_neither_paddle_nor_matplotlib():
    """Loaded on its own (a bare parent package instead of staticpipe/__init__, which imports Paddle)."""
    code = ("import sys, types; pkg = types.ModuleType('staticpipe'); pkg.__path__ = ['staticpipe']; "
            "sys.modules['staticpipe'] = pkg; import staticpipe.schedule, staticpipe.schedule.gantt; "
            "import staticpipe.schedule.__main__; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('paddle', 'matplotlib', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"
