"""A plain multi-layer perceptron: the cheapest model whose stages can be split anywhere."""
from __future__ import annotations

from functools import partial
from typing import Sequence

import staticpipe  # noqa: F401  (settles Paddle's static-IR flag before paddle is used)
import paddle

from .network import Block, Network, Variable, build_classifier


def _dense(x: Variable, size: int, act: str | None) -> Variable:
    return paddle.static.nn.fc(x, size, activation=act)


def build_mlp(
    num_stages: int = 2,
    guarded: bool = True,
    in_dim: int = 64,
    hidden: int = 256,
    depth: int = 4,
    num_classes: int = 10,
    seed: int = 1,
    stage_devices: Sequence[str] | None = None,
) -> Network:
    """``depth`` Linear+ReLU layers of width ``hidden``, then a Linear to ``num_classes`` logits.

    The ``depth`` hidden layers are the units split over stages (the small classifier joins the last
    one, so 8 layers on 2 stages give 4 + 4 equal stages); the input feed is named "features".
    """
    blocks: list[Block] = [partial(_dense, size=hidden, act="relu") for _ in range(depth - 1)]
    blocks.append(lambda x: _dense(_dense(x, hidden, "relu"), num_classes, None))
    return build_classifier(blocks, [in_dim], num_stages, guarded, seed, input_name="features",
                            stage_devices=stage_devices)
