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
from staticpipe.runtime.thread_choice import ROUNDS, ThreadChoice
from fault_util import build_pipeline, inject
from models import build_mlp
from pipeline_util import assert_same_training, train_twins


@pytest.mark.parametrize("ranks, cores, candidates", [
    (2, 2, [2, 1]),
    (4, 2, [4, 2, 1]),
    (8, 16, [8, 1]),
    (3, 1, [3, 1]),
])
def test_the_candidates_are_a_thread_per_rank_one_per_core_and_one(ranks, cores, candidates):
    choice = ThreadChoice(ranks, cores)
    assert choice.candidates == candidates and choice.chosen is None


@pytest.mark.parametrize("ranks", [0, 1])
def test_a_single_shareable_rank_has_nothing_to_try(ranks):
    choice = ThreadChoice(ranks, 4)
    assert choice.chosen == 1 and choice.threads(True) == 1 and not choice.counts("any")


SHAPES = ((8, 4),)  # a step's micro-batch shapes, as the trial sees them


def run_trial(choice, score):
    """Report every step the choice asks for, with wall = ``score(threads)`` and CPU 1; the threads asked for."""
    asked = []
    while choice.chosen is None:
        asked.append(choice.threads(True))
        choice.measured(asked[-1], SHAPES, score(asked[-1]), 1.0)
    return asked


def test_a_warm_up_round_then_interleaved_rounds_of_every_candidate():
    choice = ThreadChoice(4, 2)
    asked = run_trial(choice, lambda n: {4: 3.0, 2: 2.0, 1: 1.0}[n])
    assert ROUNDS == 3 and asked == [4, 2, 1] + [4, 2, 1] * 3
    assert choice.chosen == 1 and choice.scores == {4: 3.0, 2: 2.0, 1: 1.0}


@pytest.mark.parametrize("scores, chosen", [
    ({2: 5.0, 1: 4.0}, 1),
    ({2: 4.0, 1: 5.0}, 2),
    ({2: 4.0, 1: 4.0}, 2),  # a tie keeps more threads
])
def test_the_layout_with_the_least_wall_times_cpu_is_kept(scores, chosen):
    choice = ThreadChoice(2, 2)
    run_trial(choice, scores.get)
    assert choice.chosen == chosen and choice.threads(True) == chosen == choice.threads(False)


def test_warm_up_steps_do_not_count_and_each_candidate_keeps_its_best_step():
    """A layout's first step (new threads, cold caches) and one slow step later (a slow spell of the
    machine) do not condemn it."""
    choice = ThreadChoice(2, 2)
    walls = iter([50.0, 40.0, 3.0, 2.5, 3.0, 9.0, 3.0, 9.0])  # warm-ups 2 and 1, then 2, 1, 2, 1, 2, 1
    while choice.chosen is None:
        n = choice.threads(True)
        choice.measured(n, SHAPES, next(walls), 2.0)
    assert choice.scores == {2: 6.0, 1: 5.0} and choice.chosen == 1


def test_a_step_that_does_not_count_runs_on_the_best_layout_so_far_and_keeps_the_trial_where_it_was():
    choice = ThreadChoice(4, 2)
    assert choice.threads(False) == 4  # nothing measured yet: a thread per rank
    for n, wall in [(4, 9.0), (2, 9.0), (1, 9.0), (4, 3.0), (2, 2.0)]:
        choice.measured(n, SHAPES, wall, 1.0)
    assert choice.threads(False) == 2 and choice.threads(True) == 1
    choice.measured(1, ((2, 4),), 0.1, 0.1)  # other shapes (an evaluation's last, smaller batch): not counted
    choice.measured(2, SHAPES, 0.1, 0.1)  # not the layout the trial asked for: not counted
    assert not choice.counts(((2, 4),)) and choice.counts(SHAPES)
    assert choice.threads(True) == 1 and choice.scores == {4: 3.0, 2: 2.0}


def test_a_report_cut_short_after_the_last_step_still_settles_the_choice():
    choice = ThreadChoice(2, 2)
    choice._done, choice.scores = len(choice._trial), {2: 2.0, 1: 1.0}  # counted, then interrupted before choosing
    assert choice.threads(True) == 1 and choice.chosen == 1


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


@pytest.mark.parametrize("scores, kept", [({2: 2.0, 1: 1.0}, 1), ({2: 1.0, 1: 2.0}, 2)])
def test_the_executor_tries_each_layout_then_keeps_the_best(caplog, monkeypatch, scores, kept):
    """Two stages: a warm-up round and three rounds on a thread each and on one thread, then the layout
    that scored best (the steps' measurements replaced by ``scores``) for good; the log says which, and
    the threads of the layout passed over are stopped."""
    measured = ThreadChoice.measured
    monkeypatch.setattr(ThreadChoice, "measured",
                        lambda self, n, shapes, wall, cpu: measured(self, n, shapes, scores[n], 1.0))
    before = staticpipe_threads()
    net, exe = pipeline(stages=2)
    batch = net.random_batch(8)
    caplog.set_level(logging.INFO, logger="staticpipe")
    try:
        layouts = []
        for _ in range(2 * (1 + ROUNDS) + 2):
            layouts.append(exe.lanes(net.main))
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
        alive = staticpipe_threads() - before
    finally:
        exe.close()
    apart, shared = [["gpu:0"], ["gpu:1"]], [["gpu:0", "gpu:1"]]
    assert layouts == [apart, shared] * (1 + ROUNDS) + [apart if kept == 2 else shared] * 2
    assert alive == ({"staticpipe-gpu:1"} if kept == 2 else set())
    told = [r.getMessage() for r in caplog.records if "thread(s) from now on" in r.getMessage()]
    assert told == [f"staticpipe: the CPU ranks of gpu:0, gpu:1 run on {kept} thread(s) from now on (the best "
                    f"step's wall x CPU time on each number of threads tried: {{2: '{scores[2] * 1e6:.3g} ms²', "
                    f"1: '{scores[1] * 1e6:.3g} ms²'}})"]


@pytest.mark.parametrize("executor", [dict(trace=True), dict(check_finite=True)])
def test_traced_or_checked_steps_do_not_count_and_run_on_a_thread_per_rank_before_any_measure(executor):
    net, exe = pipeline(stages=2, **executor)
    batch = net.random_batch(8)
    try:
        for _ in range(2 * (1 + ROUNDS) + 1):
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
        exe.run(net.main, feed=batch, fetch_list=[net.loss])  # the warm-up step on a thread each
        choice = exe._steps._choices[staticpipe.plan_of(net.main)]
        assert choice.threads(True) == 1 and exe.lanes(net.main) == [["gpu:0", "gpu:1"]]
        with inject("1B2"), pytest.raises(staticpipe.StageError):
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
        assert choice._done == 1 and exe.lanes(net.main) == [["gpu:0", "gpu:1"]]
        exe.run(net.main, feed=batch, fetch_list=[net.loss])
        assert choice._done == 2
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
    """Four stages, 1F1B, through the whole trial (a thread each, one per core where fewer, one thread;
    a warm-up round and three more) and past it: the losses and parameters of a thread per rank, bit for
    bit, and the single-device training's."""
    builder = functools.partial(build_mlp, num_stages=4, hidden=32)
    steps = 3 * (1 + ROUNDS) + 2
    twins = {}
    for setting in ("auto", None):
        monkeypatch.setattr(staticpipe, "Executor", functools.partial(staticpipe.executor.Executor,
                                                                      worker_threads=setting))
        twins[setting] = train_twins(builder, lambda: paddle.optimizer.Momentum(0.1, momentum=0.9),
                                     steps=steps, batch_size=8, num_microbatches=8)
    assert_same_training(twins["auto"])
    assert twins["auto"].pipe_losses == twins[None].pipe_losses
    for name, value in twins[None].pipe_params.items():
        np.testing.assert_array_equal(twins["auto"].pipe_params[name], value, err_msg=name)
