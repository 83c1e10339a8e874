"""PIR, zero-bubble schedules: a backward op split into B and W halves when the activation gradient it
computes is one term of a sum (a residual ``h + fc(h)``, a second head, an auxiliary loss on either
stage). Paddle names such a term after the op that makes it, not ``<input>@GRAD``; the halves aborted the
process in ``minimize`` ("Destroyed a op_result that is still in use by builtin.combine") or left the
term unmade at the first step. Each trains as one device does."""
from __future__ import annotations

import pytest

import staticpipe
from staticpipe._paddle import PADDLE_MAJOR, paddle
from test_pir import CLASSES, FEATURES, assert_same, train_twins

pytestmark = pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")


@pytest.fixture(autouse=True)
def _pir():
    with paddle.pir_utils.IrGuard():
        yield


def network(case: str, v_shape: bool):
    """Two devices; ``v_shape``: four stages on gpu:0, gpu:1, gpu:1, gpu:0 (ZB-V, DualPipeV), else two."""
    fc, relu = paddle.static.nn.fc, paddle.nn.functional.relu

    def layers():
        x = paddle.static.data("x", [None, FEATURES], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        with staticpipe.device_guard("gpu:0"):
            h = relu(fc(x, 16))
            aux0 = paddle.mean(fc(h, 1))
        with staticpipe.device_guard("gpu:1"):
            if case == "residual":
                h = h + fc(h, 16)
            h = relu(fc(h, 16))
        if v_shape:
            staticpipe.split_point()
            with staticpipe.device_guard("gpu:1"):
                h = relu(fc(h, 16))
        with staticpipe.device_guard("gpu:0" if v_shape else "gpu:1"):
            h2 = relu(fc(h, 16))
            loss = paddle.mean(paddle.nn.functional.cross_entropy(fc(h2, CLASSES), y))
            if case == "second head":
                loss = loss + paddle.mean(fc(h2, 1))
            elif case == "aux loss, last stage":
                loss = loss + paddle.mean(fc(h, 1))
            elif case == "aux loss, stage 0":
                loss = loss + aux0
        return loss
    return layers


@pytest.mark.parametrize("case, schedule", [
    ("residual", "ZB-H1"), ("second head", "ZB-H1"), ("aux loss, last stage", "ZB-H1"), ("aux loss, stage 0", "ZB-H1"),
    ("residual", "ZB-2P"), ("residual", "ZB-V"), ("second head", "DualPipeV"), ("aux loss, stage 0", "ZB-V"),
])
def test_a_gradient_term_split_into_halves_trains_as_one_device(case, schedule):
    v_shape = staticpipe.schedule.get_kind(schedule).chunks == 2
    *result, opt = train_twins(network(case, v_shape), lambda: paddle.optimizer.SGD(0.1),
                               dict(num_microbatches=4, schedule=schedule))
    assert_same(*result)
    assert opt.plan.num_stages == (4 if v_shape else 2)
