"""Every schedule, cost-aware plans too, trains like single-device training; traced steps give timelines."""
from __future__ import annotations

import json
import math
import re
import time
from functools import partial

import pytest

import staticpipe
from models import build_gpt, build_mlp, build_resnet
from pipeline_util import assert_same_training, gradient_merge_twins, minimize, op_vars, train_twins
from schedule_util import HEAVY_MIDDLE
from staticpipe._paddle import np, paddle
from staticpipe.ir import is_pir_program
from staticpipe.schedule import Kind, ScheduleError, format_schedule
from staticpipe.schedule.gantt import COLORS

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {
    "F-then-B": ["gpu:0", "gpu:1", "gpu:2"],
    "1F1B": ["gpu:0", "gpu:1", "gpu:2"],
    "interleaved": ["gpu:0", "gpu:1", "gpu:0", "gpu:1"],
    "ZB-H1": ["gpu:0", "gpu:1", "gpu:2"],
    "ZB-V": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "V-Min": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "V-Half": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "ZB-2P": ["gpu:0", "gpu:1", "gpu:2"],
    "Eager1F1B": ["gpu:0", "gpu:1", "gpu:2"],
    "DualPipeV": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
}
MICROBATCHES = {"Eager1F1B": 8}  # it needs 2 x devices - 1 = 5 or more; the others run 4


def momentum():
    return paddle.optimizer.Momentum(0.1, momentum=0.9)


@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
def test_every_schedule_equals_single_device(schedule, program_ir):
    devices = LAYOUTS[schedule]
    builder = partial(build_mlp, num_stages=len(devices), stage_devices=devices)
    twin = train_twins(builder, momentum, num_microbatches=MICROBATCHES.get(schedule, 4), schedule=schedule)
    assert_same_training(twin)
    assert is_pir_program(twin.plan.stages[0].sections["forward"].program) == (program_ir == "pir")
    assert twin.plan.schedule == staticpipe.schedule.get_kind(schedule).name
    assert (len(twin.plan.stages), len(twin.plan.ranks)) == (len(devices), len(set(devices)))


@pytest.mark.parametrize("schedule", ["ZB-H1", "ZB-V", "interleaved", "DualPipeV"])
def test_split_and_chunked_schedules_with_batch_norm(schedule):
    """Convolutions, batch norm (statistics per micro-batch) and their split B/W kernels: equal to
    Paddle's gradient merge on one device (one run per micro-batch, so batch-norm statistics per
    micro-batch: the exact single-device reference), running statistics included; and bit-identical to
    the same stages under 1F1B, each on a device of its own."""
    devices = LAYOUTS[schedule]
    builder = partial(build_resnet, depth=50, num_stages=len(devices), width=8, image_size=16, stage_devices=devices)
    _, _, trained = gradient_merge_twins(builder, momentum, microbatches=4, steps=2, batch_size=8, evaluate=False,
                                         schedule=schedule)
    assert any(k in trained for k in op_vars(builder().main, "batch_norm", "Mean"))  # running means are state
    net = build_resnet(depth=50, num_stages=len(devices), width=8, image_size=16)
    minimize(net, momentum(), dict(num_microbatches=4, schedule="1F1B"))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for step in range(2):
        exe.run(net.main, feed=net.random_batch(8, seed=step))
    one_f_one_b = exe.state_dict(net.main)
    exe.close()
    assert one_f_one_b.keys() == trained.keys()
    for name, value in one_f_one_b.items():
        np.testing.assert_array_equal(trained[name], value, err_msg=name)


@pytest.mark.parametrize("schedule", ["1F1B", "interleaved", "ZB-V", "V-Half", "DualPipeV"])
def test_chunked_schedules_with_global_norm_clipping(schedule, program_ir):
    """The clip's sum of squared norms spans every stage: each stage adds its own, one exchange adds the
    stages' parts, and every stage scales by the same global norm (1F1B: a stage per rank). A rank holding
    several stages runs their optimize sections together: the global-norm sum adds the local stages' parts
    before going over the ranks (run one after the other, the first stage's sum would wait forever for the
    second)."""
    devices = LAYOUTS[schedule]
    builder = partial(build_mlp, num_stages=len(devices), stage_devices=devices)

    def clipped():
        return paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05))
    twin = train_twins(builder, clipped, num_microbatches=4, schedule=schedule)
    assert_same_training(twin, rtol=1e-5)
    sums = [ex for ex in twin.plan.exchanges if ex.kind == "sum"]  # one exchange adds the stages' squared norms
    assert len(sums) == 1 and math.prod(sums[0].vars[0].shape) == 1  # a scalar (0-D on PIR)
    assert all(len(stage.sections["optimize"].runs) == 2 for stage in twin.plan.stages)  # split at the exchange


def test_zb_v_with_a_tied_embedding_owned_and_read_on_one_rank(program_ir):
    """ZB-V puts the GPT's first and last stage on gpu:0: the tied embedding's owner (stage 0) receives
    stage 3's partial gradient from its own rank inside the optimize step."""
    devices = ["gpu:0", "gpu:1", "gpu:1", "gpu:0"]

    def builder(guarded: bool = True):
        net = build_gpt(num_stages=1, guarded=False)
        if guarded:
            staticpipe.auto_place(net.main, devices=devices, policy="uniform", schedule="ZB-V", num_microbatches=4)
        return net
    probe = builder()
    minimize(probe, paddle.optimizer.SGD(0.1), dict(num_microbatches=4, schedule="ZB-V"))
    assert [stages for stages in staticpipe.plan_of(probe.main).shared.values()] == [(0, 3)]
    twin = train_twins(builder, lambda: paddle.optimizer.SGD(0.1), steps=2, batch_size=8, num_microbatches=4,
                       schedule="ZB-V")
    assert_same_training(twin, rtol=1e-5)


def test_zero_bubble_sections_split_weight_gradients(program_ir):
    net = build_mlp(num_stages=2)
    minimize(net, momentum(), dict(num_microbatches=4, schedule="ZB-H1"))
    plan = staticpipe.plan_of(net.main)
    for stage in plan.stages:
        bwd = stage.sections["backward"].program.global_block()
        wgt = stage.sections["weight"].program.global_block()
        if program_ir == "pir":  # each backward op making both kinds of gradient is rebuilt as two halves
            grads_b = [op for op in bwd.ops if op.name() == "pd_op.matmul_grad"]
            grads_w = [op for op in wgt.ops if op.name() == "pd_op.matmul_grad"]
            assert grads_w and all(not op.result(0).initialized() for op in grads_w)  # W: no activation gradient
            assert all(not op.result(1).initialized() for op in grads_b)  # B: no weight gradient
            continue
        # B computes no parameter gradient and accumulates nothing; W does both
        assert not any(n.split("@GRAD")[0] in stage.parameters for op in bwd.ops for n in op.output_arg_names)
        assert sorted(op.output("Out")[0] for op in wgt.ops if op.type == "sum") == sorted(stage.grad_buffers)
    assert "1W0" in format_schedule(plan.actions)


def test_custom_schedule_is_validated_and_runs(program_ir):
    twin = train_twins(partial(build_mlp, num_stages=2), momentum, num_microbatches=2,
                       schedule="rank 0: 0F0 0F1 0B1 0B0 0OPT\nrank 1: 1F0 1B0 1F1 1B1 1OPT")
    assert_same_training(twin)
    assert twin.plan.schedule == "custom"
    deadlock = "rank 0: 0F0 0B0 0F1 0B1 0OPT\nrank 1: 1F0 1F1 1B0 1B1 1OPT"  # rank 0 waits for 1B0 before 0F1
    net = build_mlp(num_stages=2)
    with pytest.raises(ScheduleError, match=r"deadlock"):
        minimize(net, momentum(), dict(num_microbatches=2, schedule=deadlock))


def test_a_custom_schedule_runs_a_v_layout_made_with_split_points(program_ir):
    """``models.build_mlp`` marks each stage boundary with ``split_point``: 4 stages on 2 devices in a V
    (gpu:0, gpu:1, gpu:1, gpu:0), run by a custom schedule."""
    v = LAYOUTS["ZB-V"]
    text = "rank 0: 0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1 0OPT 3OPT\nrank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1OPT 2OPT"
    twin = train_twins(partial(build_mlp, num_stages=4, stage_devices=v), momentum, num_microbatches=2,
                       schedule=text)
    assert_same_training(twin)
    assert twin.plan.devices == v and len(twin.plan.ranks) == 2 and twin.plan.schedule == "custom"


def test_schedule_layout_errors_name_the_fix():
    net = build_mlp(num_stages=2)
    with pytest.raises(ValueError, match=re.escape(
            "schedule ZB-V cannot run this program: it needs 4 stages on the 2 devices ['gpu:0', 'gpu:1'] in the "
            "order ['gpu:0', 'gpu:1', 'gpu:1', 'gpu:0'], but the program's guards give 2 stages on "
            "['gpu:0', 'gpu:1']; separate consecutive stages on one device with staticpipe.split_point()")):
        minimize(net, momentum(), dict(num_microbatches=4, schedule="ZB-V"))
    net = build_mlp(num_stages=4, stage_devices=LAYOUTS["interleaved"])
    with pytest.raises(ValueError, match=re.escape(
            "interleaved 1F1B needs num_microbatches to be a multiple of the number of devices (2); got 5: "
            "use 4 or 6")):
        minimize(net, momentum(), dict(num_microbatches=5, schedule="interleaved"))
    net = build_mlp(num_stages=4, stage_devices=LAYOUTS["DualPipeV"])
    with pytest.raises(ValueError, match=re.escape(
            "schedule DualPipeV needs num_microbatches >= 4 on 2 devices (2 x devices: every rank fills both of its "
            "chunks before its first paired F&B); got 3")):
        minimize(net, momentum(), dict(num_microbatches=3, schedule="DualPipeV"))


def chrome_events(path):
    """The Chrome trace's thread names and, per thread (rank), its complete events sorted by start."""
    events = json.loads(path.read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    by_rank = {}
    for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"]):
        by_rank.setdefault(e["tid"], []).append(e)
    assert len(events) == len(threads) + sum(map(len, by_rank.values()))  # nothing else
    return threads, by_rank


def colored_pixels(image, kind):
    """How many pixels of ``image`` (RGBA floats) have the Gantt chart's colour for ``kind``."""
    rgb = np.array([int(COLORS[kind][i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < 0.02).sum())


def test_traced_step_exports_a_timeline(tmp_path, capsys):
    net = build_mlp(num_stages=2)
    minimize(net, momentum(), dict(num_microbatches=4, schedule="ZB-H1"))
    exe = staticpipe.Executor(trace=True)
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(16))  # the first step also prepares the stages' programs
    started = time.perf_counter()
    exe.run(net.main, feed=net.random_batch(16, seed=1))
    wall = time.perf_counter() - started
    timeline = exe.timeline(net.main)  # the last traced step
    plan = staticpipe.plan_of(net.main)
    assert len(timeline.events) == sum(len(a) for a in plan.actions.values())
    assert 0.0 < timeline.total <= wall
    assert timeline.predicted().total <= timeline.total * 1.001  # the bound never exceeds the measurement

    # Chrome trace: one thread per rank, one event per action, in the order the rank ran its actions,
    # each inside the step and after the previous one ended
    trace = tmp_path / "step.json"
    timeline.to_chrome(str(trace))
    threads, by_rank = chrome_events(trace)
    assert threads == {r: f"rank {r} ({d})" for r, d in enumerate(plan.ranks)}
    assert sorted(by_rank) == sorted(plan.actions)
    for rank, events in by_rank.items():
        assert [e["name"] for e in events] == [str(a) for a in plan.actions[rank]], rank
        for e, action in zip(events, plan.actions[rank]):
            assert e["cat"] == action.kind.value
            assert e["args"] == {"stage": action.stage, "microbatch": action.microbatch}
            assert e["ts"] >= 0 and e["dur"] >= 0 and e["ts"] + e["dur"] <= timeline.total * 1e6 + 1e-3  # µs
        for before, after in zip(events, events[1:]):
            assert after["ts"] >= before["ts"] + before["dur"] - 1e-3, (before, after)
    assert min(e["ts"] for events in by_rank.values() for e in events) == 0.0
    # busy time and bubble recomputed from the trace's events
    end = max(e["ts"] + e["dur"] for events in by_rank.values() for e in events)
    busy = {r: sum(e["dur"] for e in events if e["cat"] in ("F", "B", "W", "OPT")) for r, events in by_rank.items()}
    assert timeline.total * 1e6 == pytest.approx(end, rel=1e-9)
    assert {r: b * 1e6 for r, b in timeline.busy().items()} == pytest.approx(busy, rel=1e-9)
    assert timeline.bubble() == pytest.approx(1 - sum(busy.values()) / (len(plan.ranks) * end), rel=1e-9, abs=1e-12)
    assert 0.0 < timeline.bubble() < 1.0

    # PNG: decodes to 12 x (0.5 + (0.45 x 2 ranks + 0.8) x 2 panels) inches at 100 dpi; the measured
    # (upper) and the predicted (lower) panel both hold F, B and W boxes (the legend's patches, top right,
    # are left out; a few hundred to 20,000 pixels each, fewer when a stall squeezes the boxes)
    png = tmp_path / "step.png"
    timeline.to_png(str(png))
    from matplotlib.image import imread
    image = imread(str(png))
    assert image.shape == (390, 1200, 4)
    height = image.shape[0]
    measured, predicted = image[height // 10:height // 2], image[height // 2:]
    for half, name in ((measured, "measured"), (predicted, "predicted")):
        counts = {k: colored_pixels(half, k) for k in (Kind.F, Kind.B, Kind.W, Kind.OPT)}
        assert min(counts[Kind.F], counts[Kind.B], counts[Kind.W]) > 20, (name, counts)
    # measured transfers (thin bars: a rank waiting in RECV) are drawn; the simulation gives them no time
    assert colored_pixels(measured, Kind.RECV) > 20
    assert colored_pixels(predicted, Kind.RECV) == colored_pixels(predicted, Kind.SEND) == 0

    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
    loader.set_sample_generator(net.sample_reader(32), batch_size=4)  # 2 steps of 4 micro-batches
    untraced = staticpipe.Executor()
    untraced.run(net.startup)
    untraced.train_from_dataset(net.main, loader, debug=True, print_period=1)
    assert not untraced.trace
    assert re.search(r"^step 2 timeline: step [\d.]+ s, bubble [\d.]+, schedule bound [\d.]+ s; busy rank 0: ",
                     capsys.readouterr().err, re.M)


def test_traced_dualpipe_v_step_times_each_pair_as_one_action(tmp_path):
    """A paired FB is one traced action: one Chrome event, busy time, the bound replays it at its measured
    time, and the chart draws it in its own colour."""
    devices = LAYOUTS["DualPipeV"]
    net = build_mlp(num_stages=len(devices), stage_devices=devices)
    minimize(net, momentum(), dict(num_microbatches=4, schedule="DualPipeV"))
    exe = staticpipe.Executor(trace=True)
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(16))
    timeline = exe.timeline(net.main)
    plan = staticpipe.plan_of(net.main)
    pairs = [str(a) for acts in plan.actions.values() for a in acts if a.kind is Kind.FB]
    assert sorted(str(a) for _, a, _, _ in timeline.events if a.kind is Kind.FB) == sorted(pairs) and len(pairs) == 6
    assert timeline.predicted().total <= timeline.total * 1.001
    assert 0.0 < timeline.bubble() < 1.0
    trace = tmp_path / "step.json"
    timeline.to_chrome(str(trace))
    _, by_rank = chrome_events(trace)
    assert sorted(e["name"] for events in by_rank.values() for e in events if e["cat"] == "FB") == sorted(pairs)
    png = tmp_path / "step.png"
    timeline.to_png(str(png))
    from matplotlib.image import imread
    assert colored_pixels(imread(str(png)), Kind.FB) > 20
    exe.close()


# ----------------------------------------------------------------------------- cost-aware plans

def test_pipeline_optimizer_checks_schedule_costs():
    opt = paddle.optimizer.SGD(0.1)
    with pytest.raises(ValueError, match=re.escape("unknown action kind 'w' in schedule_costs; kinds: F, B, W")):
        staticpipe.PipelineOptimizer(opt, 4, "ZB-H1", schedule_costs={"w": 0.5})
    with pytest.raises(ValueError, match=re.escape("schedule_costs is for the schedules that plan by measured costs "
                                                   "(ZB-H1, ZB-V, V-Min, V-Half, ZB-2P); schedule interleaved does not "
                                                   "use it")):
        staticpipe.PipelineOptimizer(opt, 4, "interleaved", schedule_costs={"W": 0.5})
    with pytest.raises(ValueError, match=re.escape("schedule_costs plans the order of a named schedule (ZB-H1, ZB-V, "
                                                   "V-Min, V-Half, ZB-2P); a custom schedule gives its own order")):
        staticpipe.PipelineOptimizer(opt, 1, "rank 0: 0F0 0B0 0OPT", schedule_costs={"W": 0.5})
    net = build_mlp(num_stages=2)
    with pytest.raises(ValueError, match=re.escape("schedule_costs['F'] has 3 values for 2 stages: [1, 1, 2]")):
        minimize(net, opt, dict(num_microbatches=4, schedule="ZB-H1", schedule_costs={"F": [1, 1, 2]}))


@pytest.mark.parametrize("schedule, m, rank1", [
    ("ZB-H1", 2, "1F0 1F1 1B0 1B1 1W0 1W1"),
    ("ZB-2P", 3, "1F0 1F1 1F2 1B0 1B1 1B2 1W0 1W1 1W2"),
])
def test_cost_aware_plan_trains_like_one_device(schedule, m, rank1, program_ir):
    builder = partial(build_mlp, num_stages=3)
    twin = train_twins(builder, momentum, batch_size=6 * m, num_microbatches=m, schedule=schedule,
                       schedule_costs=HEAVY_MIDDLE)
    assert_same_training(twin)
    net = builder()
    minimize(net, momentum(), dict(num_microbatches=m, schedule=schedule, schedule_costs=HEAVY_MIDDLE))
    compute = {r: [a for a in acts if a.kind in (Kind.F, Kind.B, Kind.W)]
               for r, acts in staticpipe.plan_of(net.main).actions.items()}
    assert " ".join(map(str, compute[1])) == rank1  # the cost-aware order, not the unit one


@pytest.mark.parametrize("schedule", ["ZB-V", "V-Min", "V-Half", "ZB-2P"])
def test_a_plan_made_for_costs_and_latency_trains_like_one_device(schedule, program_ir):
    """The portfolio's order for these costs and this latency (not the unit plan) runs and trains as one
    device does."""
    devices = ["gpu:0", "gpu:1"] if schedule == "ZB-2P" else LAYOUTS[schedule]
    costs, comm = {"F": 1, "B": 2, "W": 1}, 0.5
    builder = partial(build_mlp, num_stages=len(devices), stage_devices=devices)
    twin = train_twins(builder, momentum, num_microbatches=4, schedule=schedule, schedule_costs=costs,
                       schedule_comm=comm)
    assert_same_training(twin)
    kind = staticpipe.schedule.get_kind(schedule)
    planned = staticpipe.schedule.make_schedule(schedule, 2, 4, kind.chunks, costs, comm)
    assert planned != staticpipe.schedule.make_schedule(schedule, 2, 4, kind.chunks)
    assert {r: [a for a in acts if a.kind in (Kind.F, Kind.B, Kind.W)] for r, acts in twin.plan.actions.items()} == {
        r: [a for a in acts if a.kind in (Kind.F, Kind.B, Kind.W)] for r, acts in planned.items()}


def test_timeline_action_costs_are_each_actions_cpu_seconds():
    """On CPU devices an action's cost alone is its worker thread's CPU time from the end of the rank's
    action before to the end of this one and its upkeep (a micro-batch's scope freed after its last action):
    never more than the wall time from the end of the action before to the start of the next, and a
    receive's wait for its message is not in it."""
    net = build_mlp(num_stages=2)
    minimize(net, momentum(), dict(num_microbatches=4))
    exe = staticpipe.Executor(trace=True)
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(16))
    timeline = exe.timeline(net.main)
    exe.close()
    costs = timeline.action_costs()
    plan = staticpipe.plan_of(net.main)
    assert set(costs) == {a for acts in plan.actions.values() for a in acts}
    by_rank = {}
    for rank, a, start, end in timeline.events:
        by_rank.setdefault(rank, []).append((start, end, a))
    for events in by_rank.values():
        events.sort(key=lambda e: e[0])
        for i, (start, end, a) in enumerate(events):
            before = events[i - 1][1] if i else start
            after = events[i + 1][0] if i + 1 < len(events) else end + 1e-3  # the last one's upkeep
            assert 0 <= costs[a] <= after - before + 1e-4, a
            if a.kind in (Kind.F, Kind.B):
                assert costs[a] > 0, a


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
