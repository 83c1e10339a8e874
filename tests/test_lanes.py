"""Lanes: several ranks on one thread, each a greenlet that gives way to the others where it would wait
(``runtime/lanes.py``); the channel between ranks of one lane and of several; which ranks share a thread;
and training that is the same, to the bit, whatever the number of worker threads."""
import functools
import threading
import time

import numpy as np
import paddle
import pytest

import staticpipe
from staticpipe._paddle import core
from staticpipe.runtime import lanes
from staticpipe.runtime.channel import InProcessChannel
from staticpipe.runtime.devices import Devices
from staticpipe.runtime.errors import PipelineAborted
from models import build_mlp
from fault_util import build_pipeline, inject
from pipeline_util import assert_same_training, train_twins

JOIN_S = 30  # a bound for a thread that must end; never reached unless the lanes are broken


def nothing():
    pass


def run_lane(calls, channel):
    return lanes.Lane().run([(c, nothing) for c in calls], lambda: channel.abort("interrupted"))


def test_ranks_of_one_lane_take_turns_exactly_where_they_wait():
    channel, log, threads = InProcessChannel(), [], set()

    def ping():
        threads.add(threading.get_ident())
        for k in range(0, 6, 2):
            channel.send(k, {"v": k}, 1)
            log.append(f"A sent {k}")
            log.append(f"A got {channel.recv(k + 1, 1)['v']}")
        return "A"

    def pong():
        threads.add(threading.get_ident())
        for k in range(0, 6, 2):
            log.append(f"B got {channel.recv(k, 0)['v']}")
            channel.send(k + 1, {"v": k + 1}, 0)
            log.append(f"B sent {k + 1}")
        return "B"
    outcomes = run_lane([ping, pong], channel)
    assert outcomes == [("A", None), ("B", None)]
    assert threads == {threading.get_ident()}
    # A runs until its first receive, B until its second: each gives way only where it would wait
    assert log == ["A sent 0", "B got 0", "B sent 1", "A got 1", "A sent 2", "B got 2", "B sent 3", "A got 3",
                   "A sent 4", "B got 4", "B sent 5", "A got 5"]


def test_an_all_reduce_among_ranks_of_one_lane_and_of_another_thread():
    channel = InProcessChannel()
    got = {}

    def rank(r):
        got[r] = channel.allreduce(("opt", 0), r, np.array([r + 1.0]), 3)
        return r
    other = threading.Thread(target=lambda: got.setdefault("lane", run_lane([lambda: rank(2)], channel)))
    other.start()
    assert run_lane([lambda: rank(0), lambda: rank(1)], channel) == [(0, None), (1, None)]
    other.join(JOIN_S)
    assert not other.is_alive() and got["lane"] == [(2, None)]
    assert {r: float(got[r][0]) for r in range(3)} == {0: 6.0, 1: 6.0, 2: 6.0}


def test_a_failing_rank_stops_the_other_ranks_of_its_lane_with_its_reason():
    channel = InProcessChannel()

    def waits():
        return channel.recv(("never", 0), 1)

    def fails():
        channel.abort("stage 1 failed")
        raise ValueError("stage 1 failed")
    (_, first), (_, second) = run_lane([waits, fails], channel)
    assert isinstance(first, PipelineAborted) and str(first) == "stage 1 failed"
    assert isinstance(second, ValueError)


def test_an_interrupt_between_ranks_finishes_every_rank_before_it_is_raised(monkeypatch):
    """Ctrl-C lands in the lane's own loop (between two ranks): the channel is aborted once, every rank
    stops at its wait (none is left suspended, holding its scopes), and then the interrupt is raised."""
    channel, aborts, switches = InProcessChannel(), [], []

    def enter():
        switches.append(1)
        if len(switches) == 3:  # both ranks have started and wait: interrupt the lane as it switches
            raise KeyboardInterrupt

    def waits(key):
        return channel.recv(key, 0)

    def interrupted():
        aborts.append(1)
        channel.abort("interrupted")
    lane = lanes.Lane()
    lets = []
    original = lanes.greenlet.greenlet

    def kept(*args, **kw):
        lets.append(original(*args, **kw))
        return lets[-1]
    monkeypatch.setattr(lanes.greenlet, "greenlet", kept)
    with pytest.raises(KeyboardInterrupt):
        lane.run([(functools.partial(waits, 1), enter), (functools.partial(waits, 2), enter),
                  (functools.partial(waits, 3), enter)], interrupted)
    assert aborts == [1] and len(lets) == 3 and all(g.dead for g in lets)


def test_a_sleeping_lane_is_woken_by_a_sender_on_another_thread(monkeypatch):
    monkeypatch.setattr(lanes, "POLL_S", 3600.0)  # no poll: only the wake can end the sleep
    channel, out = InProcessChannel(), {}
    thread = threading.Thread(target=lambda: out.setdefault("outcomes", run_lane(
        [lambda: channel.recv((4, 1), 0)], channel)), daemon=True)
    thread.start()
    while True:
        with channel._lock:
            if (4, 1) in channel._waiting:
                break
    channel.send((4, 1), {"x": 1}, 1)
    assert thread.is_alive()  # the wake waits for this thread's next wake()
    channel.wake()
    thread.join(JOIN_S)
    assert not thread.is_alive() and out["outcomes"] == [({"x": 1}, None)]


@pytest.mark.parametrize("threads, expected", [
    (2, [[0, 1], [2, 3, 4]]),
    (3, [[0], [1, 2], [3, 4]]),
    (1, [[0, 1, 2, 3, 4]]),
    (9, [[0], [1], [2], [3], [4]]),
    (None, [[0], [1], [2], [3], [4]]),
])
def test_cpu_ranks_share_threads_in_consecutive_groups(threads, expected):
    assert Devices().lanes_of([f"gpu:{k}" for k in range(5)], threads) == expected


def test_gpu_ranks_and_every_rank_of_a_launched_job_keep_a_thread_each(monkeypatch):
    devices = Devices()
    # (a stand-in for CUDAPlace, which aborts the process on a CPU build of Paddle)
    monkeypatch.setattr(devices, "place_of", lambda d: "a GPU place" if d == "gpu:1" else core.CPUPlace())
    names = ["gpu:0", "gpu:1", "gpu:2"]
    assert devices.shareable(names) == [0, 2] and devices.lanes_of(names, 1) == [[0, 2], [1]]
    launched = Devices()
    launched.world = (0, 2)  # as in a job started by staticpipe.launch
    assert launched.shareable(names) == [] and launched.lanes_of(names, 1) == [[0], [1], [2]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", "Auto", np.array([2, 3])])
def test_worker_threads_must_be_auto_none_or_a_positive_integer(bad):
    with pytest.raises(ValueError) as err:
        staticpipe.Executor(worker_threads=bad)
    assert str(err.value) == ('worker_threads must be "auto" (tried on the first steps), None (one per rank) or '
                              f"an integer >= 1, got {bad!r}")


def test_any_number_of_worker_threads_trains_the_same_to_the_bit(monkeypatch, program_ir):
    """Four stages, 1F1B, on one, two and four threads: the same losses and parameters, bit for bit, and
    the single-device training's."""
    builder = functools.partial(build_mlp, num_stages=4, hidden=32)
    twins = {}
    for threads in (1, 2, 4):
        monkeypatch.setattr(staticpipe, "Executor", functools.partial(staticpipe.executor.Executor,
                                                                      worker_threads=threads))
        twins[threads] = train_twins(builder, lambda: paddle.optimizer.Momentum(0.1, momentum=0.9),
                                     num_microbatches=8)
    assert_same_training(twins[1])
    for threads in (2, 4):
        assert twins[threads].pipe_losses == twins[1].pipe_losses
        for name, value in twins[1].pipe_params.items():
            np.testing.assert_array_equal(twins[threads].pipe_params[name], value, err_msg=name)


def test_stage_threads_are_named_by_the_devices_they_run():
    net = build_mlp(num_stages=4, hidden=16)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=4).minimize(net.loss)
    exe = staticpipe.Executor(worker_threads=2)
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(8), fetch_list=[net.loss])
    names = {t.name for t in threading.enumerate() if t.name.startswith("staticpipe-gpu")}
    exe.close()
    assert "staticpipe-gpu:2+gpu:3" in names and not any("gpu:0" in n or "gpu:1" in n for n in names)


def test_a_traced_rank_counts_only_its_own_cpu_on_a_shared_thread():
    """On one thread, a receive that gave way while the other ranks computed must not count their CPU:
    the actions' CPU then adds up to no more than the step's."""
    net = build_mlp(num_stages=4, hidden=16)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=8).minimize(net.loss)
    exe = staticpipe.Executor(worker_threads=1, trace=True)
    exe.run(net.startup)
    batch = net.random_batch(16)
    exe.run(net.main, feed=batch, fetch_list=[net.loss])
    records = exe._steps.records
    exe.close()
    wall = max(end for _, _, end, _ in records) - min(start for _, start, _, _ in records)
    assert len(records) > 40 and sum(cpu for *_, cpu in records) <= wall * 1.05 + 1e-3


@pytest.mark.parametrize("target", ["0F1", "1B2", "0SEND_F1>1", "1OPT"])
def test_a_failing_rank_on_a_shared_thread_stops_the_step_and_the_next_step_trains(target):
    """Both ranks of a 1F1B pipeline on one thread: the failing rank's error is raised (the other rank,
    waiting on the same thread, stopped with it), and the next step trains."""
    net = build_pipeline("1F1B")
    exe = staticpipe.Executor(worker_threads=1)
    exe.run(net.startup)
    batch = net.random_batch(8)
    try:
        with inject(target), pytest.raises(staticpipe.StageError) as err:
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
        assert str(err.value).startswith(f"stage {target[0]} (gpu:{target[0]}) failed in action {target}: "
                                         f"InjectedFault: injected fault at {target}")
        (loss,) = exe.run(net.main, feed=batch, fetch_list=[net.loss])
        assert np.isfinite(loss)
    finally:
        exe.close()


def test_a_wake_up_lost_to_an_interrupt_costs_a_poll_not_a_hang(monkeypatch):
    """An interrupt between the channel taking a waiter and making it ready loses the wake-up: the lane's
    poll makes its ranks look again, and the waiting rank finds its message."""
    monkeypatch.setattr(lanes, "POLL_S", 0.01)
    channel, lost = InProcessChannel(), []
    ready = lanes.Lane.ready

    def loses_the_first(self, g):
        if not lost:
            lost.append(g)
            return False  # as if interrupted before the greenlet was queued
        return ready(self, g)
    monkeypatch.setattr(lanes.Lane, "ready", loses_the_first)
    other = threading.Thread(target=lambda: (time.sleep(0.05), channel.send("m", {"v": 1}, 0), channel.wake()))
    other.start()
    assert run_lane([lambda: channel.recv("m", 1)["v"], lambda: 2], channel) == [(1, None), (2, None)]
    other.join(JOIN_S)
    assert len(lost) == 1


def test_an_interrupt_before_a_lane_starts_leaves_no_lane_on_its_thread(monkeypatch):
    def interrupted_start(*args, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(lanes.greenlet, "greenlet", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        run_lane([nothing, nothing], InProcessChannel())
    assert getattr(lanes._local, "lane", None) is None and lanes.current()._hub is None


def test_a_second_interrupt_still_lets_every_rank_clean_up():
    """Ctrl-C twice: the first as the lane switches ranks, the second inside the abort it calls. The run
    raises, and no rank is left suspended holding its scopes: each rank's own cleanup has run."""
    channel, held, switches = InProcessChannel(), set(), []

    def rank(name, key):
        def run():
            held.add(name)
            try:
                return channel.recv(key, 0)
            finally:
                held.discard(name)
        return run

    def enter():
        switches.append(1)
        if len(switches) == 2:
            raise KeyboardInterrupt("first")

    def interrupted():
        raise KeyboardInterrupt("second")
    with pytest.raises(KeyboardInterrupt):
        lanes.Lane().run([(rank("r0", "a"), enter), (rank("r1", "b"), enter)], interrupted)
    assert held == set() and getattr(lanes._local, "lane", None) is None


def test_ranks_of_one_thread_run_with_their_own_intra_op_budgets(monkeypatch):
    """A thread that runs stages of different ``threads_per_stage`` budgets sets the budget of the rank it
    switches to; the losses are those of a thread per stage."""
    from staticpipe.runtime import devices as devices_mod
    budgets = {"gpu:0": 2, "gpu:1": 1}
    losses, set_to = {}, []
    for threads in (None, 1):
        net = build_pipeline("1F1B")
        exe = staticpipe.Executor(worker_threads=threads, threads_per_stage=budgets)
        exe.run(net.startup)
        exe.set_state_dict(net.main, {n: np.full_like(v, 0.01) for n, v in exe.state_dict(net.main).items()})
        if threads == 1:
            real = devices_mod.core.set_num_threads
            monkeypatch.setattr(devices_mod.core, "set_num_threads", lambda n: (set_to.append(n), real(n))[1])
        losses[threads] = [float(exe.run(net.main, feed=net.random_batch(8, seed), fetch_list=[net.loss])[0])
                           for seed in range(2)]
        exe.close()
    assert losses[1] == losses[None]
    assert set(set_to) == {1, 2} and set_to.count(1) > 2 and set_to.count(2) > 2
