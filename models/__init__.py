"""Model zoo for staticpipe: forward networks built guarded (one device per stage) or unguarded.

``BUILDERS`` maps a short name to a builder taking ``num_stages``, ``guarded`` and ``seed``, so
benchmarks and tests can loop over the zoo. Guarded builds declare their stage devices in
``Network.devices``: "gpu:0", "gpu:1", ... except for "dlrm", whose stage 0 is "cpu".
``models.seed_resnet`` is apart: the seed job's network (``examples/train_resnet50_seed.py``), built
with its loader and optimizer by its own ``build(args)``.
"""
from functools import partial

from .convnet import build_convnet
from .dlrm import build_dlrm
from .mlp import build_mlp
from .network import Network, stage_of
from .resnet import BLOCKS_PER_LEVEL, build_resnet
from .transformer import build_gpt

BUILDERS = {
    "mlp": build_mlp,
    "convnet": build_convnet,
    **{f"resnet{depth}": partial(build_resnet, depth=depth) for depth in BLOCKS_PER_LEVEL},
    "gpt": build_gpt,
    "dlrm": build_dlrm,  # needs num_stages >= 2: stage 0 is "cpu"
}

__all__ = ["BUILDERS", "Network", "build_convnet", "build_dlrm", "build_gpt", "build_mlp", "build_resnet",
           "stage_of"]
