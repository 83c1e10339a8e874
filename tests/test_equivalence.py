"""A pipelined program trains exactly like the unsplit program on one device with the same global batch.

Tolerance: rtol 1e-5 on parameters and losses. The pipeline sums M micro-batch gradients where the
reference reduces the whole batch in one kernel, so float32 rounding differs by a few ulps; atol 1e-6
covers parameters whose values are near zero, where a relative bound means nothing.
"""
from __future__ import annotations

from functools import partial

import pytest

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


@pytest.mark.parametrize("microbatches", [1, 2, 8])
def test_any_number_of_microbatches(microbatches, program_ir):
    """1F1B with fewer micro-batches than stages still works: it degenerates to F-then-B."""
    twin = train_twins(partial(build_mlp, num_stages=4), OPTIMIZERS["momentum"],
                       num_microbatches=microbatches, schedule="1F1B")
    assert_same_training(twin)
