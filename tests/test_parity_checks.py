"""The parity checks themselves fail on planted bugs: a wrong tensor under Adam, stages clipping by their
local gradient norm.

The Adam-family check compares every tensor with the single-device reference up to the reference's own
rounding noise (pipeline_util.adam_family_mismatches). The check it replaced let up to 0.5 % of all
coordinates differ by up to steps x lr: on the 3-stage MLP (216,586 coordinates) that hid a whole wrong
bias vector. The clipping tests train with a clip that is active on every step, with parameters on every
stage; a pipeline whose stages clip by their local norm must fail them.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from models import build_gpt, build_mlp
from pipeline_util import (adam_family_mismatches, assert_adam_family_training, assert_clipping_matters,
                           assert_same_training, dense_layers, train_twins)
from staticpipe._paddle import paddle
from staticpipe.runtime.channel import InProcessChannel
from test_training_parity import tied_lm

pytestmark = pytest.mark.timeout(120)
P, LR = paddle.optimizer, paddle.optimizer.lr
STEPS, LEARNING_RATE = 3, 0.01


def former_check(twin) -> bool:
    """The Adam-family check this suite used before: at most 0.5 % of all coordinates beyond rtol 1e-5 /
    atol 1e-6, none by more than steps x lr."""
    off = total = 0
    for name, ref in twin.ref_params.items():
        got = twin.pipe_params[name]
        off += int((~np.isclose(got, ref, rtol=1e-5, atol=1e-6)).sum())
        total += ref.size
        if np.max(np.abs(got - ref)) > STEPS * LEARNING_RATE:
            return False
    return off <= total // 200


@pytest.fixture(scope="module")
def adam_twin():
    twin = train_twins(partial(build_mlp, num_stages=3), lambda: P.Adam(LEARNING_RATE), steps=STEPS,
                       num_microbatches=4, noise=True)
    assert adam_family_mismatches(twin.ref_params, twin.pipe_params, twin.ref_noise) == []
    return twin


def shifted_bias(params, bias):  # the whole hidden bias wrong by just under what the former check allowed
    params[bias] = params[bias] + 0.99 * STEPS * LEARNING_RATE


def one_coordinate(params, bias):  # one coordinate of a bias wrong by lr / 100
    params[bias] = params[bias].copy()
    params[bias][7] += LEARNING_RATE / 100


def scaled_weight(params, weight):  # a weight matrix 1e-4 (relative) off
    params[weight] = params[weight] * np.float32(1 + 1e-4)


WEIGHT, BIAS = 0, 1


@pytest.mark.parametrize("plant, layer, part, former_catches", [(shifted_bias, 1, BIAS, False),
                                                                (one_coordinate, 3, BIAS, False),
                                                                (scaled_weight, 2, WEIGHT, True)],
                         ids=["bias-vector", "one-coordinate", "scaled-weight"])
def test_adam_family_check_fails_on_a_wrong_tensor(adam_twin, plant, layer, part, former_catches):
    tensor = dense_layers(build_mlp(num_stages=3).main)[layer][part]
    planted = dict(adam_twin.pipe_params)
    plant(planted, tensor)
    twin = type(adam_twin)(**{**vars(adam_twin), "pipe_params": planted})
    assert former_check(twin) is not former_catches  # the former check let the first two through
    with pytest.raises(AssertionError) as failure:
        assert_adam_family_training(twin)
    assert [line.split(":")[0] for line in str(failure.value).splitlines()] in ([tensor], [tensor, tensor])
    assert "beyond the reference's own rounding noise" in str(failure.value)


def test_a_tensor_noisy_everywhere_cannot_hide_a_wrong_value():
    """Noise allows single coordinates, not a whole tensor: where the reference disagrees with itself on
    every coordinate, a pipeline off everywhere still fails (more than 1 % of the tensor beyond rtol)."""
    ref = {"b": np.linspace(-1, 1, 200, dtype=np.float32)}
    noise = {"b": np.full(200, 0.1)}
    assert adam_family_mismatches(ref, {"b": ref["b"] + np.float32(0.05)}, noise) == [
        "b: 200 of 200 coordinates differ beyond rtol 1e-05, atol 1e-06 (at most 1% may)"]
    assert adam_family_mismatches(ref, {"b": ref["b"] + np.float32(0.05) * (np.arange(200) < 2)}, noise) == []
    assert adam_family_mismatches(ref, {"b": ref["b"] + np.float32(0.05) * (np.arange(200) < 3)}, noise) == [
        "b: 3 of 200 coordinates differ beyond rtol 1e-05, atol 1e-06 (at most 1% may)"]


@pytest.fixture
def local_norm_clipping(monkeypatch):
    """A planted bug: the optimize step's cross-stage sums (the global-norm clip's sum of squares) return
    each rank its own part, so every stage clips by its local norm."""
    real = InProcessChannel.allreduce

    def local_part(self, key, rank, value, ranks):
        total = real(self, key, rank, value, ranks)
        return total if key == ("opt", "ready") else value
    monkeypatch.setattr(InProcessChannel, "allreduce", local_part)


def test_gpt_parity_fails_when_stages_clip_by_their_local_norm(local_norm_clipping):
    """test_training_parity's GPT case (AdamW, warm-up and cosine, clip 0.1) with the bug planted: the
    clip is active and the local norms matter, and every parameter tensor (not only the loss) fails."""
    clip = 0.1

    def make():
        sched = LR.LinearWarmup(LR.CosineAnnealingDecay(0.01, T_max=8), 2, 0.0, 0.01)
        return P.AdamW(sched, weight_decay=0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip))

    twin = train_twins(partial(build_gpt, num_stages=2), make, steps=4, batch_size=8, num_microbatches=4, noise=True)
    assert_clipping_matters(twin.ref_grad_squares, twin.plan, clip)
    with pytest.raises(AssertionError):
        assert_adam_family_training(twin)
    wrong = {line.split(":")[0] for line in adam_family_mismatches(twin.ref_params, twin.pipe_params, twin.ref_noise)}
    assert wrong == set(twin.ref_params)


def test_tied_embedding_parity_fails_when_stages_clip_by_their_local_norm(local_norm_clipping):
    clip = 0.1
    twin = train_twins(partial(tied_lm, num_stages=2, head=True),
                       lambda: P.SGD(0.5, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip)),
                       steps=4, batch_size=8, num_microbatches=4)
    assert_clipping_matters(twin.ref_grad_squares, twin.plan, clip)
    with pytest.raises(AssertionError):
        assert_same_training(twin)
