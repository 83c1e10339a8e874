"""Bottleneck ResNets (50/101/152) as in Paddle's static-graph pipeline tutorial.

Why a ResNet: its many uniform blocks give a deep, evenly splittable pipeline, and its batch norms put
persistable state (moving mean/variance) inside stages.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import staticpipe  # noqa: F401  (settles Paddle's static-IR flag before paddle is used)
import paddle

from .network import Block, Network, Variable, build_classifier

BLOCKS_PER_LEVEL = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
EXPANSION = 4  # a bottleneck's output has 4x the channels of its inner convolutions
SMALL_IMAGE = 64  # up to this size, a stride-1 3x3 stem replaces 7x7/2 + maxpool (CIFAR-style)


def _conv_bn(x: Variable, channels: int, size: int, stride: int = 1, relu: bool = False) -> Variable:
    # paddle.nn's layers, not paddle.static.nn.conv2d / batch_norm: those build legacy programs only, these
    # build both IRs with the same parameter names. No conv bias: the batch norm's shift makes it redundant.
    x = paddle.nn.Conv2D(x.shape[1], channels, size, stride=stride, padding=(size - 1) // 2, bias_attr=False)(x)
    x = paddle.nn.BatchNorm2D(channels)(x)
    return paddle.nn.functional.relu(x) if relu else x


def _stem(x: Variable, width: int, small: bool) -> Variable:
    if small:
        return _conv_bn(x, width, 3, relu=True)
    x = _conv_bn(x, width, 7, stride=2, relu=True)
    return paddle.nn.functional.max_pool2d(x, kernel_size=3, stride=2, padding=1)


def _bottleneck(x: Variable, channels: int, stride: int) -> Variable:
    out = _conv_bn(x, channels, 1, relu=True)
    out = _conv_bn(out, channels, 3, stride=stride, relu=True)
    out = _conv_bn(out, channels * EXPANSION, 1)
    short = x
    if x.shape[1] != channels * EXPANSION or stride != 1:  # projection when the shape changes
        short = _conv_bn(x, channels * EXPANSION, 1, stride=stride)
    return paddle.nn.functional.relu(paddle.add(short, out))


def _head(x: Variable, num_classes: int) -> Variable:
    x = paddle.nn.functional.adaptive_avg_pool2d(x, 1)
    return paddle.static.nn.fc(paddle.flatten(x, start_axis=1), num_classes)


def build_resnet(
    depth: int = 50,
    num_stages: int = 2,
    guarded: bool = True,
    image_size: int = 32,
    num_classes: int = 10,
    width: int = 64,
    seed: int = 1,
    stage_devices: Sequence[str] | None = None,
) -> Network:
    """A bottleneck ResNet of ``depth`` layers on [N, 3, image_size, image_size] images.

    ``width`` is the stem's channel count (64 standard); level i's bottlenecks have ``width * 2**i``
    inner channels. The units split over stages are [stem, every bottleneck, head], e.g. 18 for
    ResNet-50, so stages balance by block count.
    """
    if depth not in BLOCKS_PER_LEVEL:
        raise ValueError(f"depth must be one of {sorted(BLOCKS_PER_LEVEL)}, got {depth}")
    blocks: list[Block] = [partial(_stem, width=width, small=image_size <= SMALL_IMAGE)]
    for level, count in enumerate(BLOCKS_PER_LEVEL[depth]):
        for i in range(count):
            # Levels after the first halve the resolution in their first block.
            stride = 2 if i == 0 and level > 0 else 1
            blocks.append(partial(_bottleneck, channels=width * 2**level, stride=stride))
    blocks.append(partial(_head, num_classes=num_classes))
    return build_classifier(blocks, [3, image_size, image_size], num_stages, guarded, seed,
                            stage_devices=stage_devices)
