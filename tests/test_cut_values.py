"""Every kind of value a stage may hand to another crosses correctly: a 0-D value (an auxiliary loss made
on one stage and added to the loss on another, as MoE balancing losses and per-stage regularizers are),
an integer, a boolean, a float16 and a bfloat16 value, and a value read by several later stages. Each
is checked against single-device training of the same program (rtol 1e-5), in threads and launched.
"""
from __future__ import annotations

import pytest

import staticpipe
from models.network import Network, fresh_names
from pipeline_util import assert_same_training, launch_script, train_twins
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(300)


def kinds_net(guarded: bool = True) -> Network:
    """Three stages; stage 0 hands over h (read by stages 1 and 2), a 0-D auxiliary loss (read on stage 2
    only: it passes stage 1 by), int64 arg-maxes, a boolean mask and float16/bfloat16 copies of h."""
    def on(device):
        return staticpipe.device_guard(device) if guarded else _nothing()

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 7
    with paddle.static.program_guard(main, startup), fresh_names():
        with on("gpu:0"):
            x = paddle.static.data("features", [None, 6], "float32")
            h = paddle.static.nn.fc(x, 8, activation="tanh")
            aux = paddle.mean(h * h)  # 0-D
            top = paddle.argmax(h, axis=1, keepdim=True)  # int64 [-1, 1]
            mask = h > 0.2  # bool
            half = paddle.cast(h, "float16")
            brain = paddle.cast(h, "bfloat16")
        with on("gpu:1"):
            back = paddle.cast(half, "float32") + paddle.cast(brain, "float32")
            g = paddle.static.nn.fc(back * paddle.cast(mask, "float32") + h, 8, activation="tanh")
            g = g + 0.1 * paddle.cast(top, "float32")
        with on("gpu:2"):
            label = paddle.static.data("label", [None, 1], "int64")
            logits = paddle.static.nn.fc(g + h, 3)
            ce = paddle.mean(paddle.nn.functional.cross_entropy(logits, label, reduction="none"))
            loss = ce + 0.05 * aux + 0.01 * paddle.mean(paddle.cast(top, "float32"))
    return Network(main, startup, [x, label], loss, {"logits": logits}, ["gpu:0", "gpu:1", "gpu:2"] if guarded else [])


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("schedule", ["1F1B", "F-then-B", "ZB-H1"])
def test_every_kind_of_value_crosses_stages_like_one_device(schedule, program_ir):
    twin = train_twins(kinds_net, lambda: paddle.optimizer.Momentum(0.1, momentum=0.9), steps=3, batch_size=8,
                       num_microbatches=4, schedule=schedule)
    assert_same_training(twin)
    crossing = {v.name: v for r in twin.plan.routes if r.src.kind == "forward" for v in r.vars}
    dtypes = sorted({v.dtype for v in crossing.values()})
    assert dtypes == ["bool", "float16", "float32", "int64", "uint16"], dtypes  # uint16: bfloat16
    assert any(v.shape == () for v in crossing.values())  # the 0-D auxiliary loss


SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import numpy as np
import staticpipe
from pipeline_util import minimize
from test_cut_values import kinds_net
net = kinds_net()
minimize(net, staticpipe._paddle.paddle.optimizer.Momentum(0.1, momentum=0.9), dict(num_microbatches=4))
exe = staticpipe.Executor()
exe.run(net.startup)
for step in range(3):
    exe.run(net.main, feed=net.random_batch(8, seed=step))
rank = os.environ.get("PADDLE_TRAINER_ID", "single")
np.savez(os.path.join({out!r}, f"state_{{rank}}.npz"), **exe.state_dict(net.main))
"""


def test_every_kind_of_value_crosses_processes(tmp_path):
    """Three launched processes (gloo) train exactly as the threaded run does, bit for bit."""
    for nprocs in (1, 3):
        launch_script(tmp_path, SCRIPT, nprocs)
    single = dict(np.load(tmp_path / "state_single.npz"))
    launched = {}
    for rank in range(3):
        launched.update(np.load(tmp_path / f"state_{rank}.npz"))
    assert sorted(launched) == sorted(single)
    for name, value in single.items():
        np.testing.assert_array_equal(launched[name], value, err_msg=name)


def data_linear_net(guarded: bool = True) -> Network:
    """Stage 1 is a bias-free linear on a data feed: its backward has nothing to compute (no activation
    gradient is needed), its weight half reads the gradient stage 2 sends."""
    def on(device):
        return staticpipe.device_guard(device) if guarded else _nothing()

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 2
    with fresh_names(), paddle.static.program_guard(main, startup):
        with on("gpu:0"):
            x = paddle.static.data("features", [None, 6], "float32")
            a = paddle.static.nn.fc(x, 6, activation="tanh")
        with on("gpu:1"):
            z = paddle.static.data("side", [None, 6], "float32")
            h = paddle.matmul(z, paddle.static.create_parameter([6, 6], "float32"))
        with on("gpu:2"):
            label = paddle.static.data("label", [None, 1], "int64")
            logits = paddle.static.nn.fc(h + a, 3)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, label, reduction="none"))
    return Network(main, startup, [x, z, label], loss, {"logits": logits},
                   ["gpu:0", "gpu:1", "gpu:2"] if guarded else [])


@pytest.mark.parametrize("schedule", ["ZB-H1", "ZB-2P", "1F1B"])
def test_a_gradient_for_a_weight_half_alone_is_received_with_its_backward(schedule, program_ir):
    """It was refused ("schedules move cut variables only between forward and backward sections"): the
    gradient now travels to stage 1's B, which keeps it for its W."""
    twin = train_twins(data_linear_net, lambda: paddle.optimizer.Momentum(0.1, momentum=0.9), steps=3,
                       batch_size=8, num_microbatches=4, schedule=schedule)
    assert_same_training(twin)
    into_stage_1 = [r for r in twin.plan.routes if r.dst.stage == 1 and r.src.stage == 2]
    assert [r.dst.kind for r in into_stage_1] == ["backward"]
