"""The small CIFAR convnet of PyTorch's model-parallel tutorial, so results compare with that one."""
from __future__ import annotations

from functools import partial

import staticpipe  # noqa: F401  (settles Paddle's static-IR flag before paddle is used)
import paddle

from .network import Network, Variable, build_classifier


def _conv_pool(x: Variable, out_channels: int) -> Variable:
    x = paddle.nn.functional.relu(paddle.nn.Conv2D(x.shape[1], out_channels, 5)(x))  # a layer that builds both IRs
    return paddle.nn.functional.max_pool2d(x, kernel_size=2, stride=2)


def _dense(x: Variable, size: int, act: str | None, flatten: bool = False) -> Variable:
    if flatten:  # inside the fc block, so it always runs under that block's stage guard
        x = paddle.flatten(x, start_axis=1)
    return paddle.static.nn.fc(x, size, activation=act)


def build_convnet(num_stages: int = 2, guarded: bool = True, seed: int = 1) -> Network:
    """[N, 3, 32, 32] -> conv(6,5) pool -> conv(16,5) pool -> fc 120 -> fc 84 -> fc 10.

    The five blocks (conv1, conv2, fc1, fc2, fc3) are the units split over 1 to 5 stages.
    """
    blocks = [
        partial(_conv_pool, out_channels=6),
        partial(_conv_pool, out_channels=16),
        partial(_dense, size=120, act="relu", flatten=True),
        partial(_dense, size=84, act="relu"),
        partial(_dense, size=10, act=None),
    ]
    return build_classifier(blocks, [3, 32, 32], num_stages, guarded, seed)
