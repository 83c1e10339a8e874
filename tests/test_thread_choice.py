"""The trial of thread layouts (``runtime/thread_choice.py``): which layouts are tried, in what order, which
one is kept; and the executor's default ("auto") running a pipeline's first steps on each layout with
the same values, to the bit, as on a thread per rank and as on one device."""
import functools
import logging
import math

import numpy as np
import paddle
import pytest

import staticpipe
from staticpipe.runtime import thread_choice
from staticpipe.runtime.thread_choice import DROP, ROUNDS, WARMUP, ThreadChoice
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
    assert choice.chosen == 1 and choice.threads() == 1


def run_trial(choice, score):
    """Report every step the choice asks for, with wall = ``score(threads)`` and CPU 1; the threads asked for."""
    asked = []
    while choice.chosen is None:
        asked.append(choice.threads())
        choice.measured(asked[-1], score(asked[-1]), 1.0)
    return asked


def test_the_trial_warms_up_on_a_thread_per_rank_then_interleaves_the_candidates():
    asked = run_trial(ThreadChoice(4, 2), lambda n: {4: 1.2, 2: 1.1, 1: 1.0}[n])
    assert WARMUP == 1 and ROUNDS == 3
    assert asked == [4, 4, 2, 1, 4, 2, 1, 4, 2, 1]


def test_a_candidate_far_behind_the_best_is_tried_no_more():
    """DROP = 1.5: once one thread scores 1, a thread per rank (3) and one per core (2) are dropped."""
    choice = ThreadChoice(4, 2)
    assert DROP == 1.5 and run_trial(choice, lambda n: {4: 3.0, 2: 2.0, 1: 1.0}[n]) == [4, 4, 2, 1, 1, 1]
    assert choice.chosen == 1 and choice.scores == {4: 3.0, 2: 2.0, 1: 1.0}


def test_a_candidate_within_drop_of_the_best_stays_in_the_trial():
    choice = ThreadChoice(2, 2)
    assert run_trial(choice, lambda n: {2: 1.49, 1: 1.0}[n]) == [2, 2, 1, 2, 1, 2, 1] and choice.chosen == 1


@pytest.mark.parametrize("scores, chosen", [
    ({2: 5.0, 1: 4.0}, 1),
    ({2: 4.0, 1: 5.0}, 2),
    ({2: 4.0, 1: 4.0}, 2),  # a tie keeps more threads
])
def test_the_layout_with_the_least_wall_times_cpu_is_kept(scores, chosen):
    choice = ThreadChoice(2, 2)
    run_trial(choice, scores.get)
    assert choice.chosen == chosen and choice.threads() == chosen


def test_each_candidate_keeps_its_best_step():
    """One slow step (a slow spell of the machine) does not condemn a layout."""
    choice, walls = ThreadChoice(2, 2), iter([9.0, 3.0, 2.5, 3.0, 9.0, 3.0, 9.0])  # warm-up, then 2, 1, 2, 1, 2, 1
    while choice.chosen is None:
        n = choice.threads()
        choice.measured(n, next(walls), 2.0)
    assert choice.scores == {2: 6.0, 1: 5.0} and choice.chosen == 1


def test_a_step_not_measured_keeps_its_place_in_the_trial():
    """A failed step reports nothing: the next step runs on the same layout; a report for another
    number of threads than the one asked for is not counted."""
    choice = ThreadChoice(2, 2)
    choice.measured(2, 1.0, 1.0)  # warm-up
    assert choice.threads() == 2
    choice.measured(1, 0.1, 0.1)  # not what was asked for
    assert choice.threads() == 2 and choice.scores == {}
    choice.measured(2, 1.0, 1.0)
    assert choice.threads() == 1 and choice.scores == {2: 1.0}


def pipeline(stages=2, **executor):
    net = build_mlp(num_stages=stages, in_dim=8, hidden=16, depth=4)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=4).minimize(net.loss)
    exe = staticpipe.Executor(**executor)
    exe.run(net.startup)
    return net, exe


def test_the_executor_tries_each_layout_then_keeps_the_chosen_one(caplog, monkeypatch):
    monkeypatch.setattr(thread_choice, "DROP", math.inf)  # every round runs, whatever the steps measure
    net, exe = pipeline(stages=2)
    batch = net.random_batch(8)
    caplog.set_level(logging.INFO, logger="staticpipe")
    try:
        layouts = []
        for _ in range(WARMUP + 2 * ROUNDS + 2):
            layouts.append(exe.lanes(net.main))
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
        choice = exe._steps._choices[staticpipe.plan_of(net.main)]
    finally:
        exe.close()
    apart, shared = [["gpu:0"], ["gpu:1"]], [["gpu:0", "gpu:1"]]
    assert layouts[:WARMUP + 2 * ROUNDS] == [apart] + [apart, shared] * ROUNDS
    kept = apart if choice.chosen == 2 else shared
    assert choice.chosen == min([2, 1], key=lambda n: choice.scores[n]) and layouts[-2:] == [kept, kept]
    told = [r.getMessage() for r in caplog.records if "thread(s) from now on" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith(f"staticpipe: the CPU ranks of gpu:0, gpu:1 run on {choice.chosen} "
                                                 "thread(s) from now on")


def test_traced_steps_are_not_measured():
    net, exe = pipeline(stages=2, trace=True)
    batch = net.random_batch(8)
    try:
        for _ in range(WARMUP + 2 * ROUNDS + 1):
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
        assert exe.lanes(net.main) == [["gpu:0"], ["gpu:1"]]
        assert exe._steps._choices[staticpipe.plan_of(net.main)].chosen is None
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
    """Four stages, 1F1B, through the whole trial (each layout tried three times) and past it: the
    losses and parameters of a thread per rank, bit for bit, and the single-device training's."""
    monkeypatch.setattr(thread_choice, "DROP", math.inf)
    builder = functools.partial(build_mlp, num_stages=4, hidden=32)
    steps = WARMUP + 3 * ROUNDS + 2
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
