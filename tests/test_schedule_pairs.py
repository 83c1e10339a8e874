"""The paired FB action (DualPipe's overlapped F&B): text and JSON, validation, lowering, the dry run, the
simulator's prices, the Gantt chart, and the runtime running its halves back to back."""
from __future__ import annotations

import re

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import minimize
from schedule_util import as_strings, chain_routes
from staticpipe._paddle import paddle
from staticpipe.runtime import worker
from staticpipe.schedule import (Action, Kind, ScheduleError, format_schedule, lower, make_schedule, parse_action,
                                 parse_schedule, schedule_from_json, schedule_to_json, simulate, validate)
from staticpipe.schedule.actions import B, F, FB

pytestmark = pytest.mark.timeout(120)

V = [0, 1, 1, 0]  # the V's stage -> rank, for 2 ranks


def parsed(lines):
    return {r: [parse_action(t) for t in text.split()] for r, text in lines.items()}


def test_text_json_and_halves():
    pair = FB(0, 3, 7, 1)
    assert pair == Action(Kind.FB, 0, 3, b_stage=7, b_microbatch=1)
    assert str(pair) == "0F3&7B1" and parse_action("0F3&7B1") == pair
    assert pair.halves() == (F(0, 3), B(7, 1)) and F(0, 3).halves() == (F(0, 3),)
    assert schedule_to_json({0: [pair]}) == '{"0": [{"kind": "FB", "stage": 0, "microbatch": 3, "b_stage": 7, ' \
                                            '"b_microbatch": 1}]}'
    sched = make_schedule("DualPipeV", 3, 7, 2)
    assert parse_schedule(format_schedule(sched)) == sched == schedule_from_json(schedule_to_json(sched))
    for text in ("0F3&7W1", "0B3&7F1", "0F3&", "0F3&7B", "F3&7B1"):
        with pytest.raises(ValueError, match=f"^{re.escape(f'not an action: {text!r}')}"):
            parse_action(text)


def test_lowering_receives_both_halves_before_and_sends_both_after():
    lowered = lower(make_schedule("DualPipeV", 2, 4, 2), chain_routes(4))
    text = as_strings(lowered)[1]
    assert "2RECV_F2<1 1RECV_B0<2 2F2&1B0 2SEND_F2>3 1SEND_B0>0 1W0" in text
    assert "1RECV_F3<0 2RECV_B1<3 1F3&2B1 1SEND_F3>2 2SEND_B1>1 2W1" in text
    validate(lowered, 4, 4, V, split_backward=True, collectives=True)


def raises(schedule, message, m=2, split=True, stage_ranks=V):
    with pytest.raises(ScheduleError, match=f"^{re.escape(message)}$") as info:
        validate(schedule, len(stage_ranks), m, stage_ranks, split_backward=split)
    return info.value


def test_validation_counts_and_places_each_half():
    good = {0: "0F0 0F1 3F0 3B0 3W0 3F1&0B0 0W0 3B1 3W1 0B1 0W1 0OPT 3OPT",
            1: "1F0 2F0 1F1 2F1 2B0 2W0 1B0 1W0 2B1 2W1 1B1 1W1 1OPT 2OPT"}
    validate(parsed(good), 4, 2, V, split_backward=True)
    # the B half on another rank's stage; the error names the pair as written
    err = raises(parsed({**good, 0: good[0].replace("3F1&0B0", "3F1&1B0")}),
                 "rank 0, step 5, action 3F1&1B0: stage 1 is placed on rank 1, not rank 0")
    assert str(err.action) == "3F1&1B0"
    raises(parsed({**good, 0: good[0].replace("3F1&0B0 0W0", "3F1&0B0 0B0 0W0")}),
           "rank 0, step 6, action 0B0: stage 0 runs B of micro-batch 0 twice")
    raises(parsed({**good, 0: good[0].replace("3F1&0B0", "3F1&0B5")}),
           "rank 0, step 5, action 3F1&0B5: micro-batch 5 does not exist (micro-batches 0..1)")
    # neither half may need the other: the pair's B of the F it runs
    raises(parsed({0: "0F0 3F0 0F1 3F1&3B1 3B0 3W0 3W1 0B0 0W0 0B1 0W1 0OPT 3OPT",
                   1: "1F0 2F0 1F1 2F1 2B0 2W0 1B0 1W0 2B1 2W1 1B1 1W1 1OPT 2OPT"}),
           "rank 0, step 3, action 3F1&3B1: B of micro-batch 1 comes before its F on stage 3")


def test_dry_run_waits_for_both_halves_and_names_them():
    """An FB waits for both its inputs: here rank 0's pair needs 1B0 (never coming: rank 1 first waits for
    the pair's own forward) -- and the deadlock says which of the pair's inputs are missing."""
    stuck = parsed({0: "0F0 0F1&0B0 0B1 0OPT", 1: "1F1 1F0 1B0 1B1 1OPT"})
    with pytest.raises(ScheduleError, match=re.escape("deadlock: rank 0 at step 1 (0F1&0B0) waits for 1B0; "
                                                      "rank 1 at step 0 (1F1) waits for 0F1")):
        validate(stuck, 2, 2, [0, 1])


def test_simulator_prices_a_pair_as_its_halves_unless_told():
    sched = make_schedule("DualPipeV", 2, 4, 2)
    pairs = sum(a.kind is Kind.FB for acts in sched.values() for a in acts)
    plain = simulate(sched, {"F": 1, "B": 2, "W": 1})
    assert plain.busy == {0: 32, 1: 32}  # 4 micro-batches x 2 chunks x (F + B + W)
    overlapped = simulate(sched, {"F": 1, "B": 2, "W": 1, "FB": 2.5})  # half the F hidden under the B
    assert sum(overlapped.busy.values()) == sum(plain.busy.values()) - 0.5 * pairs
    assert overlapped.total < plain.total
    assert simulate(sched, lambda a: 3.0 if a.kind is Kind.FB else 1.0).busy == {
        r: sum(3.0 if a.kind is Kind.FB else 1.0 for a in acts) for r, acts in sched.items()}  # OPTs priced 1 too
    # each half counts where it runs: stage 0 holds all 4 micro-batches before its first backward returns
    assert plain.peak_inflight == {0: 4, 1: 3, 2: 2, 3: 1}


def test_gantt_draws_a_pair_as_one_box(tmp_path):
    import numpy as np
    from matplotlib.image import imread

    from staticpipe.schedule.gantt import COLORS, draw_gantt
    path = tmp_path / "dualpipe.png"
    draw_gantt({"DualPipeV": simulate(make_schedule("DualPipeV", 2, 4, 2))}, str(path))
    image = imread(str(path))
    rgb = np.array([int(COLORS[Kind.FB][i:i + 2], 16) / 255 for i in (1, 3, 5)])
    assert (np.abs(image[..., :3] - rgb).max(axis=-1) < 0.02).sum() > 500


def test_runtime_runs_both_halves_and_names_the_failing_one(monkeypatch):
    """Rank 1 of a 2-device DualPipeV runs 2F2&1B0: its scopes are kept and released per half, and a
    failure in the B half is stage 1's, named with the pair."""
    net = build_mlp(num_stages=4, stage_devices=["gpu:0", "gpu:1", "gpu:1", "gpu:0"], in_dim=8, hidden=16)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=4, schedule="DualPipeV"))
    plan = staticpipe.plan_of(net.main)
    program = worker.RankProgram.of(plan, 1)
    at = next(i for i, a in enumerate(program.actions) if str(a) == "2F2&1B0")
    assert program.last_use.get(at) is None  # the B's W and the F's B come later
    assert program.last_use[next(i for i, a in enumerate(program.actions) if str(a) == "1W0")] == ((1, 0),)
    ran = []
    compute = worker.DeviceWorker._compute

    def recording(self, job, a, scope, result):
        if str(a) == "1B0":
            raise RuntimeError("boom")
        ran.append(str(a))
        return compute(self, job, a, scope, result)
    monkeypatch.setattr(worker.DeviceWorker, "_compute", recording)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    with pytest.raises(staticpipe.StageError, match=re.escape(
            "stage 1 (gpu:1) failed in action 2F2&1B0: RuntimeError: boom")) as info:
        exe.run(net.main, feed=net.random_batch(8))
    assert (info.value.stage, str(info.value.action)) == (1, "2F2&1B0")
    assert "2F2" in ran  # the F half ran first
    exe.close()
