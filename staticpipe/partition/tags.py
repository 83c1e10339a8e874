"""How ``auto_place`` reads a program and writes its answer into it: the split points it must respect, and
each stage's device on its ops. A PIR program is read through a ``PirView`` (its ops in the legacy terms
the passes use) and tagged on its own operations, so placement itself knows one IR."""
from __future__ import annotations

from typing import Any, Sequence

from .._paddle import OP_DEVICE, framework
from ..ir import is_pir_program
from ..pir_ir import Gradients
from ..pir_view import PirView
from ..placement import SPLIT_POINTS
from ..rewrite.stages import op_label
from .layers import Layer


def readable(program: Any) -> Any:
    """``program`` as the passes read it: a PIR program through a ``PirView`` (its forward ops, before
    minimize), whose op indices and value names a PIR program's ``Profile`` uses too (``pir_profile.py``)."""
    return PirView(program, Gradients(), None) if is_pir_program(program) else program


def split_starts(block: framework.Block, fwd: list[int], split_points: Sequence[Any]) -> set[int]:
    """The forward op after the producer of each split-point variable: it must start a stage."""
    starts = set()
    for point in split_points:
        name = getattr(point, "name", point)
        if not isinstance(name, str) or name not in block.vars:
            raise ValueError(f"split point {name!r} is not a variable of the program")
        writers = [i for i in fwd if name in block.ops[i].output_arg_names]
        if not writers:
            raise ValueError(f"split point '{name}' is produced by no op (a data variable or a parameter); "
                             "name an op's output to cut after that op")
        later = [i for i in fwd if i > writers[-1]]
        if not later:
            raise ValueError(f"split point '{name}' is written by the last op, "
                             f"{op_label(writers[-1], block.ops[writers[-1]])}: no op is left for a later stage")
        starts.add(later[0])
    return starts


def tag(program: framework.Program, read: Any, layers: list[Layer], bounds: list[int], devices: list[str]) -> None:
    """Write each stage's device into its ops (``read``: ``program`` as the passes read it, a ``PirView`` of a
    PIR program); where two consecutive stages share a device (ZB-V's V), mark a split point so the rewrite
    still separates them (a PIR program's: the op before the stage's first, as ``placement.split_point``)."""
    ops = read.global_block().ops
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for layer in layers[a:b]:
            for i in layer.ops:
                for op in (ops[i].ops if isinstance(read, PirView) else [ops[i]]):
                    (op.set_str_attr if isinstance(read, PirView) else op._set_attr)(OP_DEVICE, devices[k])
        if k and devices[k] == devices[k - 1]:
            first = layers[a].ops[0]
            if isinstance(read, PirView):
                setattr(program, SPLIT_POINTS, [*getattr(program, SPLIT_POINTS, []), ops[first - 1].ops[-1]])
            else:
                setattr(program, SPLIT_POINTS, getattr(program, SPLIT_POINTS, set()) | {first})
