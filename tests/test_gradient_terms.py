"""Zero-bubble schedules on both IRs: a backward op split into B and W halves when the activation gradient
it computes is one term of a sum (a residual ``h + fc(h)``, a second head, an auxiliary loss on either
stage). On PIR, Paddle names such a term after the op that makes it, not ``<input>@GRAD``; the halves
once aborted the process in ``minimize`` ("Destroyed a op_result that is still in use by
builtin.combine") or left the term unmade at the first step. Each trains as one device does."""
from __future__ import annotations

import contextlib
from functools import partial

import pytest

import staticpipe
from models.network import Network, fresh_names
from pipeline_util import assert_same_training, train_twins
from staticpipe._paddle import paddle

FEATURES, CLASSES = 12, 4


def gradient_term_net(case: str, v_shape: bool, guarded: bool = True) -> Network:
    """Two devices; ``v_shape``: four stages on gpu:0, gpu:1, gpu:1, gpu:0 (ZB-V, DualPipeV), else two."""
    fc, relu = paddle.static.nn.fc, paddle.nn.functional.relu

    def on(device):
        return staticpipe.device_guard(device) if guarded else contextlib.nullcontext()

    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 3
    with paddle.static.program_guard(main, startup), fresh_names():
        x = paddle.static.data("x", [None, FEATURES], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        with on("gpu:0"):
            h = relu(fc(x, 16))
            aux0 = paddle.mean(fc(h, 1))
        with on("gpu:1"):
            if case == "residual":
                h = h + fc(h, 16)
            h = relu(fc(h, 16))
        if v_shape:
            if guarded:
                staticpipe.split_point()
            with on("gpu:1"):
                h = relu(fc(h, 16))
        with on("gpu:0" if v_shape else "gpu:1"):
            h2 = relu(fc(h, 16))
            logits = fc(h2, CLASSES)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, y))
            if case == "second head":
                loss = loss + paddle.mean(fc(h2, 1))
            elif case == "aux loss, last stage":
                loss = loss + paddle.mean(fc(h, 1))
            elif case == "aux loss, stage 0":
                loss = loss + aux0
    devices = (["gpu:0", "gpu:1", "gpu:1", "gpu:0"] if v_shape else ["gpu:0", "gpu:1"]) if guarded else []
    return Network(main, startup, [x, y], loss, {"logits": logits}, devices)


@pytest.mark.parametrize("case, schedule", [
    ("residual", "ZB-H1"), ("second head", "ZB-H1"), ("aux loss, last stage", "ZB-H1"), ("aux loss, stage 0", "ZB-H1"),
    ("residual", "ZB-2P"), ("residual", "ZB-V"), ("second head", "DualPipeV"), ("aux loss, stage 0", "ZB-V"),
])
def test_a_gradient_term_split_into_halves_trains_as_one_device(case, schedule, program_ir):
    v_shape = staticpipe.schedule.get_kind(schedule).chunks == 2
    twin = train_twins(partial(gradient_term_net, case, v_shape), lambda: paddle.optimizer.SGD(0.1),
                       num_microbatches=4, schedule=schedule)
    assert_same_training(twin)
    assert twin.plan.num_stages == (4 if v_shape else 2) and twin.plan.schedule == schedule
