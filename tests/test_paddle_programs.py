"""Pipeline programs written the way Paddle's authors write them, ported by names only, train as one
device does: readers of ``paddle.dataset.*`` style (flat samples, int labels) fed as Paddle's DataFeeder
feeds them, a forward value the program marks persistable, and ops guarded "gpu:all" (in threads and in
two launched processes).

Every test trains the same program on one device with Paddle's own loader and executor (the global
batch: a step's micro-batches together) and compares every parameter (rtol 1e-5).
"""
from __future__ import annotations

import contextlib

import pytest

import staticpipe
from pipeline_util import launch_script
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(120)
M, MBS, STEPS = 2, 4, 3  # micro-batches per step, samples per loader batch (one micro-batch), steps


def mnist_like_reader():
    """Like ``paddle.dataset.mnist.train()``: each sample a flat list of floats and an int label."""
    rng = np.random.default_rng(3)
    for _ in range(M * MBS * STEPS):
        yield rng.standard_normal(16).astype(np.float32).tolist(), int(rng.integers(0, 3))


def network(pipelined: bool, persistable_hidden: bool = False):
    guard = staticpipe.device_guard if pipelined else (lambda device: contextlib.nullcontext())
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 5
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with guard("gpu:all"):  # Paddle's: a value every stage that reads it may compute
            half = paddle.full([1], 0.5, "float32")
        with guard("gpu:0"):
            pixel = paddle.static.data("pixel", [-1, 1, 4, 4], "float32")
            label = paddle.static.data("label", [-1, 1], "int64")
            hidden = paddle.static.nn.fc(paddle.flatten(pixel, 1) * half, 8, activation="relu")
            if persistable_hidden:
                hidden.persistable = True  # Paddle warns, and trains
        with guard("gpu:1"):
            logits = paddle.static.nn.fc(hidden, 3) * (half + 1.0)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, label))
        opt = paddle.optimizer.Momentum(0.1, momentum=0.9)
        if pipelined:
            opt = staticpipe.PipelineOptimizer(opt, num_microbatches=M)
        opt.minimize(loss)
    return main, startup, [pixel, label], loss, hidden


def one_device(persistable_hidden: bool = False):
    """Paddle's loader and executor on one device, a step per M * MBS samples: (initial parameters, final
    parameters, the hidden values of the last step)."""
    main, startup, feeds, loss, hidden = network(False, persistable_hidden)
    loader = paddle.base.io.DataLoader.from_generator(feed_list=feeds, capacity=4, iterable=True)
    loader.set_sample_generator(mnist_like_reader, batch_size=M * MBS, places=paddle.CPUPlace())
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(startup, scope=scope)
    names = [p.name for p in main.all_parameters()]
    initial = {n: np.array(scope.find_var(n).get_tensor()) for n in names}
    for batch in loader():
        _, last_hidden = exe.run(main, feed=batch, fetch_list=[loss, hidden], scope=scope)
    return initial, {n: np.array(scope.find_var(n).get_tensor()) for n in names}, last_hidden, scope


def pipeline(initial, persistable_hidden: bool = False):
    """The pipelined program fed by staticpipe's loader as Paddle's pipeline script feeds it (a loader
    batch is a micro-batch), trained with ``train_from_dataset``; (executor, program, hidden variable)."""
    main, startup, feeds, loss, hidden = network(True, persistable_hidden)
    loader = staticpipe.io.DataLoader.from_generator(feed_list=feeds, capacity=4, iterable=False)
    loader.set_sample_generator(mnist_like_reader, batch_size=MBS)
    exe = staticpipe.Executor()
    exe.run(startup)
    exe.set_state_dict(main, initial)
    loader.start()
    exe.train_from_dataset(main)
    return exe, main, feeds, hidden


def test_a_flat_sample_reader_trains_as_on_one_device():
    initial, want, _, _ = one_device()
    exe, main, _, _ = pipeline(initial)
    got = exe.state_dict(main)
    assert exe.global_step == STEPS
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    exe.close()


def test_a_persistable_activation_trains_as_an_activation_and_is_fetched_whole():
    initial, want, last_hidden, scope = one_device(persistable_hidden=True)
    exe, main, feeds, hidden = pipeline(initial, persistable_hidden=True)
    got = exe.state_dict(main)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert hidden.persistable  # the user's program keeps its flag (it is the single-device reference)
    plan = staticpipe.plan_of(main)
    assert hidden.name not in plan.stages[0].persistables and plan.outliving == (hidden.name,)
    # left where one device leaves it: in the scope of the stage that computes it, the last step's batch
    last = np.array(exe.scope_of("gpu:0").find_var(hidden.name).get_tensor())
    np.testing.assert_allclose(last, last_hidden, rtol=1e-5, atol=1e-6)
    # fetched: the whole step's value, as one device's run of the same global batch gives it
    batch = {"pixel": np.ones((M * MBS, 1, 4, 4), np.float32), "label": np.zeros((M * MBS, 1), np.int64)}
    before = exe.state_dict(main)
    [fetched] = exe.run(main, feed=batch, fetch_list=[hidden])
    ref_main, _, _, ref_loss, ref_hidden = network(False, persistable_hidden=True)
    for name, value in before.items():
        scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())
    [expected] = paddle.static.Executor(paddle.CPUPlace()).run(ref_main, feed=batch, fetch_list=[ref_hidden],
                                                               scope=scope)
    np.testing.assert_allclose(fetched, expected, rtol=1e-6)
    assert last_hidden.shape == (M * MBS, 8)
    exe.close()


def all_devices_network(pipelined: bool):
    """Paddle's "gpu:all": a constant and a value computed from it, read on both stages."""
    guard = staticpipe.device_guard if pipelined else (lambda device: contextlib.nullcontext())
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 5
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with guard("gpu:all"):
            temperature = paddle.full([1], 2.0, "float32")
            inverse = 1.0 / temperature
        with guard("gpu:0"):
            x = paddle.static.data("x", [-1, 6], "float32")
            label = paddle.static.data("label", [-1, 1], "int64")
            hidden = paddle.static.nn.fc(x, 8, activation="tanh") * inverse
        with guard("gpu:1"):
            logits = paddle.static.nn.fc(hidden, 3) * inverse
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, label))
        opt = paddle.optimizer.Momentum(0.1, momentum=0.9)
        if pipelined:
            opt = staticpipe.PipelineOptimizer(opt, num_microbatches=M)
        opt.minimize(loss)
    return main, startup, loss


def test_gpu_all_ops_run_where_their_values_are_needed():
    ref_main, ref_startup, ref_loss = all_devices_network(False)
    main, startup, loss = all_devices_network(True)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(ref_startup, scope=scope)
    names = [p.name for p in ref_main.all_parameters()]
    pipe = staticpipe.Executor()
    pipe.run(startup)
    pipe.set_state_dict(main, {n: np.array(scope.find_var(n).get_tensor()) for n in names})
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        batch = {"x": rng.standard_normal((M * MBS, 6)).astype(np.float32),
                 "label": rng.integers(0, 3, (M * MBS, 1)).astype(np.int64)}
        [want] = exe.run(ref_main, feed=batch, fetch_list=[ref_loss], scope=scope)
        [got] = pipe.run(main, feed=batch, fetch_list=[loss])
        np.testing.assert_allclose(got, want, rtol=1e-5)
    state = pipe.state_dict(main)
    for name in names:
        np.testing.assert_allclose(state[name], np.array(scope.find_var(name).get_tensor()), rtol=1e-5, atol=1e-7)
    plan = staticpipe.plan_of(main)
    assert plan.devices == ["gpu:0", "gpu:1"]  # "gpu:all" names no stage of its own
    pipe.close()


LAUNCHED = """
import os, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import numpy as np
import staticpipe
from staticpipe._paddle import paddle
from test_paddle_programs import pipeline, one_device
paddle.enable_static()
initial, _, _, _ = one_device(persistable_hidden=True)
exe, main, feeds, hidden = pipeline(initial, persistable_hidden=True)
rank = os.environ.get("PADDLE_TRAINER_ID", "single") if int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1 else "single"
np.savez(os.path.join({out!r}, f"state_{{rank}}.npz"), **exe.state_dict(main))
"""


def test_a_flat_reader_and_a_persistable_activation_launched_train_as_on_one_device(tmp_path):
    """The same program in 2 launched processes (gloo): each rank's loader feeds as Paddle's DataFeeder,
    the persistable activation crosses processes as an activation; the state equals one device's."""
    launch_script(tmp_path, LAUNCHED, 2)
    _, want, _, _ = one_device(persistable_hidden=True)
    got = {**np.load(tmp_path / "state_0.npz"), **np.load(tmp_path / "state_1.npz")}
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
