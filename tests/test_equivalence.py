"""A pipelined program trains exactly like the unsplit program on one device with the same global batch.

Tolerance: rtol 1e-5 on parameters and losses. The pipeline sums M micro-batch gradients where the
reference reduces the whole batch in one kernel, so float32 rounding differs by a few ulps; atol 1e-6
covers parameters whose values are near zero, where a relative bound means nothing.
"""
from __future__ import annotations

from functools import partial

import pytest

import staticpipe
from models import build_convnet, build_mlp
from pipeline_util import assert_same_training, train_twins
from staticpipe._paddle import paddle

pytestmark = pytest.mark.timeout(300)

OPTIMIZERS = {
    "sgd": lambda: paddle.optimizer.SGD(0.1),
    "momentum": lambda: paddle.optimizer.Momentum(0.1, momentum=0.9),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", ["F-then-B", "1F1B"])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("model", ["mlp", "convnet"])
def test_pipeline_equals_single_device(model, stages, schedule, optimizer, program_ir):
    builder = {"mlp": build_mlp, "convnet": build_convnet}[model]
    twin = train_twins(partial(builder, num_stages=stages), OPTIMIZERS[optimizer],
                       num_microbatches=4, schedule=schedule)
    assert_same_training(twin)
    assert twin.plan.num_stages == stages and twin.plan.schedule == staticpipe.schedule.get_kind(schedule).name


ADAM = {
    "adam": lambda: paddle.optimizer.Adam(0.01),
    "adamw+LinearWarmup+Cosine": lambda: paddle.optimizer.AdamW(
        paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.05, T_max=4), 2, 0.0, 0.05),
        weight_decay=0.01),
}


@pytest.mark.parametrize("optimizer", sorted(ADAM))
@pytest.mark.parametrize("schedule", ["F-then-B", "1F1B"])
def test_a_small_network_trains_with_adam_like_single_device(schedule, optimizer, program_ir):
    """Adam divides each update by sqrt(v) + eps, so a coordinate whose gradient is as small as float32
    rounding moves by up to the learning rate with the order of the sums: a network this small (12 -> 16 -> 4)
    has none, and trains to rtol 1e-5 of one device, the learning-rate schedule stepped once per global step
    (wider ones: test_training_parity's rounding-noise reference)."""
    small = partial(build_mlp, num_stages=2, in_dim=12, hidden=16, depth=2, num_classes=4)
    twin = train_twins(small, ADAM[optimizer], steps=4, batch_size=12, num_microbatches=4, schedule=schedule)
    assert_same_training(twin)
    assert twin.plan.num_stages == 2 and twin.plan.schedule == staticpipe.schedule.get_kind(schedule).name


@pytest.mark.parametrize("microbatches", [1, 2, 8])
def test_any_number_of_microbatches(microbatches, program_ir):
    """1F1B with fewer micro-batches than stages still works: it degenerates to F-then-B."""
    twin = train_twins(partial(build_mlp, num_stages=4), OPTIMIZERS["momentum"],
                       num_microbatches=microbatches, schedule="1F1B")
    assert_same_training(twin)
    assert twin.plan.devices == ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]
