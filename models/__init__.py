"""Model zoo for staticpipe: forward networks built guarded (one device per stage) or unguarded.

``BUILDERS`` maps a short name to a builder taking ``num_stages``, ``guarded`` and ``seed``, so
benchmarks and tests can loop over the zoo.
"""
from functools import partial

from .convnet import build_convnet
from .mlp import build_mlp
from .network import Network, stage_of
from .resnet import BLOCKS_PER_LEVEL, build_resnet

BUILDERS = {
    "mlp": build_mlp,
    "convnet": build_convnet,
    **{f"resnet{depth}": partial(build_resnet, depth=depth) for depth in BLOCKS_PER_LEVEL},
}

__all__ = ["BUILDERS", "Network", "build_convnet", "build_mlp", "build_resnet", "stage_of"]
