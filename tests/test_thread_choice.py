"""The trial of thread layouts (``runtime/thread_choice.py``): which layouts are tried, in what order, which
one is kept; and the executor's default ("auto") running a pipeline's first steps on each layout with
the same values, to the bit, as on a thread per rank and as on one device."""
import functools
import logging
import os
import threading

import numpy as np
import paddle
import pytest

import staticpipe
from staticpipe.runtime import thread_choice
from staticpipe.runtime.thread_choice import CLEAR, MAX_ROUNDS, ROUNDS, SHORT_S, SLACK, TIE, WAKE_S, ThreadChoice
from fault_util import build_pipeline, inject
from models import build_mlp
from pipeline_util import assert_same_training, train_twins


def alone(ranks):
    return [[i] for i in range(ranks)]


LAYOUTS = {  # 4 ranks on 2 cores: a thread each, one per core (consecutive ranks share), one thread
    4: alone(4), 2: [[0, 1], [2, 3]], 1: [[0, 1, 2, 3]]}
TWO = {2: alone(2), 1: [[0, 1]]}
SHAPES = ((8, 4),)  # a step's micro-batch shapes, as the trial sees them


def run_trial(choice, wall, cpu=lambda n: 1.0, lane_cpu=lambda n, lanes: [0.0] * len(lanes)):
    """Report every step the choice asks for, with ``wall(threads)``, ``cpu(threads)`` and each lane's
    CPU ``lane_cpu(threads, lanes)``; the threads asked for."""
    asked = []
    while choice.chosen is None:
        n = choice.threads(True)
        asked.append(n)
        choice.measured(n, SHAPES, wall(n), cpu(n), lane_cpu(n, choice.layouts[n]))
    return asked


def test_a_single_layout_has_nothing_to_try():
    choice = ThreadChoice({1: [[0]]}, [0], 4)
    assert choice.chosen == 1 and choice.threads(True) == 1 and not choice.counts("any")


def test_the_first_layout_must_run_each_rank_alone():
    with pytest.raises(ValueError, match=r"the first layout must run each rank alone, got \[\[0, 1\]\]"):
        ThreadChoice({2: [[0, 1]], 1: [[0, 1]]}, [0, 0], 2)


@pytest.mark.parametrize("layouts, wall, rank_cpu", [
    (TWO, 1.0, [0.95, 0.95]),  # two large stages on two cores: one thread would compute 1.9 s
    (LAYOUTS, 1.0, [0.5] * 4),  # four on two cores: a core's two ranks compute 1.0 s, all four 2.0 s
])
def test_large_stages_keep_a_thread_each_without_a_step_on_fewer(layouts, wall, rank_cpu):
    """One unmeasured step and one measured on a thread per rank: every layout with fewer threads is
    bounded by its busiest thread's CPU (less 500 µs a message) at >= 97 % of that step, so not tried."""
    choice = ThreadChoice(layouts, [16] * len(rank_cpu), 2)
    first = max(layouts)
    asked = run_trial(choice, lambda n: wall, lambda n: sum(rank_cpu), lambda n, lanes: rank_cpu)
    assert asked == [first, first] and choice.chosen == first and list(choice.walls) == [first]
    assert WAKE_S == 500e-6 and SLACK == 0.03
    assert choice.bounds == {n: pytest.approx(max(max(sum(rank_cpu[i] - 16 * WAKE_S for i in lane) for lane in lanes),
                                                   sum(c - 16 * WAKE_S for c in rank_cpu) / min(len(lanes), 2)))
                             for n, lanes in layouts.items() if n != first}


def test_a_layout_is_tried_unless_its_bound_is_within_3_percent_of_the_step():
    choice = ThreadChoice(TWO, [0, 0], 2)
    asked = run_trial(choice, {2: 1.0, 1: 2.0}.get, lane_cpu=lambda n, lanes: [0.48, 0.48])  # bound 0.96 < 0.97
    assert asked == [2, 2, 1, 1] and choice.chosen == 2 and choice.bounds == {1: pytest.approx(0.96)}


def test_tiny_stages_try_one_thread_next_and_when_it_is_10_percent_faster_nothing_between():
    """The bounds (tiny CPU, less 500 µs a message) rule nothing out; a thread per rank is measured, then
    one thread, > 10 % faster: a thread per rank is out, and so is 2 threads, untried; one thread is
    kept without a second round."""
    choice = ThreadChoice(LAYOUTS, [32] * 4, 2)
    asked = run_trial(choice, {4: 1.3, 2: 1.0, 1: 1.0}.get, lane_cpu=lambda n, lanes: [0.003] * len(lanes))
    assert CLEAR == 0.10 and asked == [4, 4, 1, 1] and choice.chosen == 1 and choice.open == [1]


def test_a_layout_10_percent_slower_than_the_fastest_step_is_out_after_one_step():
    choice = ThreadChoice(LAYOUTS, [32] * 4, 2)
    asked = run_trial(choice, {4: 1.0, 2: 1.2, 1: 1.05}.get)
    assert asked == [4, 4, 1, 1, 2, 2, 1, 4] and choice.open == [4, 1] and choice.chosen == 4


def test_layouts_within_10_percent_get_two_steps_each_interleaved():
    choice = ThreadChoice(LAYOUTS, [32] * 4, 2)
    asked = run_trial(choice, {4: 1.0, 2: 1.5, 1: 1.05}.get)
    assert ROUNDS == 2 and asked == [4, 4, 1, 1, 2, 2, 1, 4] and choice.walls == {4: [1.0, 1.0], 1: [1.05, 1.05], 2: [1.5]}


def test_layouts_of_short_steps_get_more_steps_until_they_add_up_to_50_ms():
    choice = ThreadChoice(TWO, [0, 0], 2)
    asked = run_trial(choice, {2: 0.010, 1: 0.0105}.get)
    assert (SHORT_S, MAX_ROUNDS) == (0.05, 4) and asked == [2, 2, 1, 1, 1, 2, 1, 2, 1, 2] and choice.chosen == 2
    choice = ThreadChoice(TWO, [0, 0], 2)
    assert run_trial(choice, {2: 0.030, 1: 0.031}.get) == [2, 2, 1, 1, 1, 2] and choice.chosen == 2


@pytest.mark.parametrize("walls, cpus, kept", [
    ({2: 1.0, 1: 1.05}, {2: 2.0, 1: 1.0}, 2),  # 5 % faster for twice the CPU: the time the user waits first
    ({2: 1.0, 1: 1.01}, {2: 2.0, 1: 1.0}, 1),  # within 2 %: the layout with less CPU
    ({2: 1.01, 1: 1.0}, {2: 1.0, 1: 1.0}, 2),  # and on equal CPU, more threads
    ({2: 1.08, 1: 1.0}, {2: 1.0, 1: 2.0}, 1),
])
def test_the_fastest_layout_is_kept_and_cpu_breaks_ties(walls, cpus, kept):
    choice = ThreadChoice(TWO, [0, 0], 2)
    run_trial(choice, walls.get, cpus.get)
    assert TIE == 0.02 and choice.chosen == kept and choice.threads(True) == kept == choice.threads(False)


def test_warm_up_steps_do_not_count_and_each_layout_keeps_its_fastest_step():
    """The plan's first step (it prepares the runs), each other layout's first step (cold caches) and
    one slow step later (a slow spell of the machine) do not condemn a layout."""
    choice = ThreadChoice(TWO, [0, 0], 2)
    steps = iter([(2, 50.0), (2, 3.0), (1, 40.0), (1, 3.1), (1, 9.0), (2, 3.2)])  # 2 and 1 after a warm-up each
    while choice.chosen is None:
        n, wall = next(steps)
        assert choice.threads(True) == n
        choice.measured(n, SHAPES, wall, 2.0 if n == 2 else 1.0, [0.0] * len(TWO[n]))
    assert choice.walls == {2: [3.0, 3.2], 1: [3.1, 9.0]} and choice.chosen == 2


def test_a_layouts_cold_first_step_counts_when_a_slow_spell_hits_its_measured_one():
    """Tiny stages (measured on M4): one thread's cold first step took 11 ms, its measured one 16 ms (the
    machine busy meanwhile), a thread per rank's 13 ms. One thread's fastest step is the cold one: it is
    > 10 % faster, so it is kept at once, without steps on 2 threads or more rounds."""
    choice = ThreadChoice(LAYOUTS, [32] * 4, 2)
    steps = iter([(4, 0.020), (4, 0.013), (1, 0.011), (1, 0.016)])
    while choice.chosen is None:
        n, wall = next(steps)
        assert choice.threads(True) == n
        choice.measured(n, SHAPES, wall, wall, [0.003] * len(LAYOUTS[n]))
    assert choice.chosen == 1 and choice.walls == {4: [0.013], 1: [0.016]} and choice.cold == {1: (0.011, 0.011)}
    assert next(steps, None) is None


def test_a_step_that_does_not_count_runs_on_the_fastest_layout_so_far_and_keeps_the_trial_where_it_was():
    choice = ThreadChoice(LAYOUTS, [0] * 4, 2)
    assert choice.threads(False) == 4  # nothing measured yet: a thread per rank
    for n, wall in [(4, 9.0), (4, 3.0), (1, 5.0), (1, 2.9)]:
        choice.measured(n, SHAPES, wall, 1.0, [0.0] * len(LAYOUTS[n]))
    assert choice.threads(False) == 1 and choice.threads(True) == 2
    choice.measured(2, ((2, 4),), 0.1, 0.1, [0.0, 0.0])  # other shapes (an evaluation's last, smaller batch)
    choice.measured(4, SHAPES, 0.1, 0.1, [0.0] * 4)  # not the layout the trial asked for
    assert not choice.counts(((2, 4),)) and choice.counts(SHAPES)
    assert choice.threads(True) == 2 and choice.walls == {4: [3.0], 1: [2.9]}


def test_cores_is_the_affinity_capped_by_a_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    quota = tmp_path / "cpu.max"
    real_open = open

    def fake_open(path, *args, **kwargs):
        return real_open(quota if path == "/sys/fs/cgroup/cpu.max" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    for text, expected in [("250000 100000", 3), ("max 100000", 8), ("50000 100000", 1)]:
        quota.write_text(text)
        assert thread_choice.cores() == expected, text
    quota.unlink()
    assert thread_choice.cores() == 8


def pipeline(stages=2, **executor):
    net = build_mlp(num_stages=stages, in_dim=8, hidden=16, depth=4)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=4).minimize(net.loss)
    exe = staticpipe.Executor(**executor)
    exe.run(net.startup)
    return net, exe


def staticpipe_threads():
    return {t.name for t in threading.enumerate() if t.name.startswith("staticpipe-")}


@pytest.mark.parametrize("walls, kept", [({2: 0.004, 1: 0.002}, 1), ({2: 0.002, 1: 0.004}, 2)])
def test_the_executor_tries_the_layouts_then_keeps_the_fastest(caplog, monkeypatch, walls, kept):
    """Two stages: an unmeasured and a measured step on a thread each, and on one thread (the steps' walls
    replaced by ``walls``, each lane's CPU by 0: no layout is ruled out without a step), the slower
    one is > 10 % slower and out: the faster runs for good; the log says which, and the threads of the
    layout passed over are stopped. Each step reports its wall, the process's CPU and each lane's own."""
    measured, reports = ThreadChoice.measured, []

    def report(self, n, shapes, wall, cpu, lane_cpu):
        reports.append((n, wall, cpu, list(lane_cpu)))
        measured(self, n, shapes, walls[n], 0.001, [0.0] * len(lane_cpu))
    monkeypatch.setattr(ThreadChoice, "measured", report)
    before = staticpipe_threads()
    net, exe = pipeline(stages=2)
    batch = net.random_batch(8)
    caplog.set_level(logging.INFO, logger="staticpipe")
    try:
        layouts = []
        for _ in range(6):
            layouts.append(exe.lanes(net.main))
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
        alive = staticpipe_threads() - before
    finally:
        exe.close()
    apart, shared = [["gpu:0"], ["gpu:1"]], [["gpu:0", "gpu:1"]]
    assert layouts == [apart, apart, shared, shared] + [apart if kept == 2 else shared] * 2
    assert alive == ({"staticpipe-gpu:1"} if kept == 2 else set())
    assert [(n, len(lane_cpu)) for n, *_, lane_cpu in reports] == [(2, 2), (2, 2), (1, 1), (1, 1)]
    for n, wall, cpu, lane_cpu in reports:  # each lane's thread CPU: part of the process's, at most its wall
        assert all(0 < c <= wall * 1.05 + 1e-3 for c in lane_cpu) and sum(lane_cpu) <= cpu * 1.05 + 1e-3
    told = [r.getMessage() for r in caplog.records if "thread(s) from now on" in r.getMessage()]
    assert told == [f"staticpipe: the CPU ranks of gpu:0, gpu:1 run on {kept} thread(s) from now on (fastest step, ms "
                    f"of wall / CPU, on each number of threads tried: {{2: '{walls[2] * 1e3:.3g} / 1', 1: "
                    f"'{walls[1] * 1e3:.3g} / 1'}}; not tried, ruled out by their bound or by one thread's lead: none)"]


@pytest.mark.parametrize("executor", [dict(trace=True), dict(check_finite=True)])
def test_traced_or_checked_steps_do_not_count_and_run_on_a_thread_per_rank_before_any_measure(executor):
    net, exe = pipeline(stages=2, **executor)
    batch = net.random_batch(8)
    try:
        for _ in range(4):
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
            assert exe.lanes(net.main) == [["gpu:0"], ["gpu:1"]]
        assert exe._steps._choices[staticpipe.plan_of(net.main)].chosen is None
    finally:
        exe.close()


def test_a_step_that_fails_in_the_trial_does_not_count_and_the_next_one_takes_its_place():
    net = build_pipeline("1F1B")
    exe = staticpipe.Executor()
    exe.run(net.startup)
    batch = net.random_batch(8)
    try:
        exe.run(net.main, feed=batch, fetch_list=[net.loss])  # the unmeasured first step, on a thread each
        choice = exe._steps._choices[staticpipe.plan_of(net.main)]
        assert choice.warmed and choice.threads(True) == 2 and exe.lanes(net.main) == [["gpu:0"], ["gpu:1"]]
        with inject("1B2"), pytest.raises(staticpipe.StageError):
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
        assert not choice.walls and exe.lanes(net.main) == [["gpu:0"], ["gpu:1"]]
        exe.run(net.main, feed=batch, fetch_list=[net.loss])
        assert len(choice.walls[2]) == 1
    finally:
        exe.close()


@pytest.mark.parametrize("setting, lanes", [(None, [["gpu:0"], ["gpu:1"], ["gpu:2"]]),
                                            (1, [["gpu:0", "gpu:1", "gpu:2"]])])
def test_a_number_of_threads_given_is_kept_from_the_first_step(setting, lanes):
    net, exe = pipeline(stages=3, worker_threads=setting)
    try:
        assert exe.lanes(net.main) == lanes
        exe.run(net.main, feed=net.random_batch(8), fetch_list=[net.loss])
        assert exe.lanes(net.main) == lanes and not exe._steps._choices
    finally:
        exe.close()


def test_training_through_the_trial_is_the_same_to_the_bit(monkeypatch, program_ir):
    """Four stages, 1F1B, through the whole trial (every step's measures made equal, so that each layout
    runs an unmeasured and two measured steps: a thread each, one per core where fewer, one thread) and
    past it: the losses and parameters of a thread per rank, bit for bit, and the single-device
    training's."""
    builder = functools.partial(build_mlp, num_stages=4, hidden=32)
    measured, ran = ThreadChoice.measured, []

    def equal(self, n, shapes, wall, cpu, lane_cpu):
        ran.append(n)
        measured(self, n, shapes, 1.0, 1.0, [0.0] * len(lane_cpu))
    monkeypatch.setattr(ThreadChoice, "measured", equal)
    monkeypatch.setattr(staticpipe.runtime.step, "cores", lambda: 2)  # three layouts on any machine
    steps = 1 + 3 + 3 * ROUNDS + 2
    twins = {}
    for setting in ("auto", None):
        monkeypatch.setattr(staticpipe, "Executor", functools.partial(staticpipe.executor.Executor,
                                                                      worker_threads=setting))
        twins[setting] = train_twins(builder, lambda: paddle.optimizer.Momentum(0.1, momentum=0.9),
                                     steps=steps, batch_size=8, num_microbatches=8)
    assert ran[:3 + 3 * ROUNDS] == [4, 4, 1, 1, 2, 2, 1, 2, 4]
    assert_same_training(twins["auto"])
    assert twins["auto"].pipe_losses == twins[None].pipe_losses
    for name, value in twins[None].pipe_params.items():
        np.testing.assert_array_equal(twins["auto"].pipe_params[name], value, err_msg=name)
