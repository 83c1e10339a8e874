"""Layers: the contiguous groups of forward ops that partitioning moves between stages as a whole.

Why not the ``paddle.nn.Layer`` calls: in static mode Paddle 2.6 records no trace of them (every op of
``paddle.nn.Linear(...)(x)`` has ``op_namescope`` "/"); only ``paddle.static.name_scope`` leaves a mark.
So a layer is found from what every program has, its parameters:

- an op inside a name scope belongs to the layer of that scope (its full ``op_namescope`` path);
- an op outside any scope that reads parameters belongs to the layer of their *owners*, the part of a
  parameter's name before its last dot (``fc_0`` for ``fc_0.w_0`` and ``fc_0.b_0``, ``batch_norm_3`` for
  its scale, shift and statistics), so a matmul and its bias add stay together;
- an op reading no parameter (activation, reshape, residual add, loss) joins the layer before it; ops
  before the first parameter join the first layer.

A new layer starts wherever the key (scope or owners) changes, at every ``staticpipe.split_point()``
marker, at every change of ``op_device`` (a layer never straddles two guards), and at the caller's
``starts``. Ops that must run on one stage never split: every op that writes a variable another op also
writes (in-place updates), and every op between them, joins one layer, because the rewrite refuses a
variable produced on two stages. Every forward op belongs to exactly one layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .._paddle import framework
from ..ir import EMPTY_VAR
from ..placement import SPLIT_POINTS, op_device
from ..rewrite.stages import FWD, op_label, role_of

ROOT_SCOPE = "/"


@dataclass(frozen=True)
class Layer:
    index: int
    name: str  # the scope, the parameter owners ("fc_0"), or "<type>#<op>" for a layer of parameter-free ops
    ops: tuple[int, ...]  # indices into the program's global block, in order
    parameters: tuple[str, ...]  # parameters its ops read, in order of first use


def forward_ops(program: framework.Program) -> list[int]:
    """Indices of the forward ops of ``program`` (not backward, optimizer or learning-rate ops)."""
    return [i for i, op in enumerate(program.global_block().ops) if role_of(op, i) == FWD]


def parameter_owner(name: str) -> str:
    """``fc_0`` for ``fc_0.w_0``: Paddle names a layer's parameters ``<layer>.<kind>_<k>``."""
    return name.rsplit(".", 1)[0] if "." in name else name


def group_layers(program: framework.Program, starts: Iterable[int] = ()) -> list[Layer]:
    """Group the forward ops of ``program`` into layers (module docstring); ``starts`` are op indices
    that must begin a new layer (cuts the caller needs)."""
    block = program.global_block()
    ops = block.ops
    fwd = forward_ops(program)
    params = {p.name for p in block.all_parameters()}
    forced = set(starts) | marker_starts(program, fwd)
    forced |= {i for prev, i in zip(fwd, fwd[1:]) if op_device(ops[i]) != op_device(ops[prev])}
    groups: list[list[int]] = []
    keys: list[object] = []
    for i in fwd:
        key = _key(ops[i], params)
        if groups and i not in forced and (key is None or keys[-1] is None or key == keys[-1]):
            groups[-1].append(i)
            keys[-1] = key if keys[-1] is None else keys[-1]
        else:
            groups.append([i])
            keys.append(key)
    groups = _merge_inplace(block, fwd, groups, forced)
    layers = []
    for k, members in enumerate(groups):
        read = [n for i in members for n in ops[i].input_arg_names if n in params]
        layers.append(Layer(k, _name(ops, members, params), tuple(members), tuple(dict.fromkeys(read))))
    return layers


def marker_starts(program: framework.Program, fwd: list[int]) -> set[int]:
    """First forward op at or after each ``split_point()`` marker; markers before the first forward op
    or after the last separate nothing and are skipped."""
    starts = set()
    for marker in getattr(program, SPLIT_POINTS, ()):
        later = [i for i in fwd if i >= marker]
        if later and later[0] != fwd[0]:
            starts.add(later[0])
    return starts


def _key(op: framework.Operator, params: set[str]) -> object:
    scope = op.attr("op_namescope") if op.has_attr("op_namescope") else ""
    if scope and scope != ROOT_SCOPE:
        return ("scope", scope)
    owners = frozenset(parameter_owner(n) for n in op.input_arg_names if n in params)
    return ("params", owners) if owners else None


def _name(ops: list, members: list[int], params: set[str]) -> str:
    for i in members:
        key = _key(ops[i], params)
        if key is not None:
            return key[1].strip("/") if key[0] == "scope" else "+".join(sorted(key[1]))
    return f"{ops[members[0]].type}#{members[0]}"


def _merge_inplace(block: framework.Block, fwd: list[int], groups: list[list[int]], forced: set[int]
                   ) -> list[list[int]]:
    """Join the layers from the first to the last writer of every variable written by several ops."""
    writers: dict[str, list[int]] = {}
    for i in fwd:
        for name in block.ops[i].output_arg_names:
            if name and name != EMPTY_VAR and i not in writers.setdefault(name, []):
                writers[name].append(i)
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    spans = []
    for name, ws in writers.items():
        if len(ws) < 2:
            continue
        cut = [i for i in forced if ws[0] < i <= ws[-1]]
        if cut:
            raise ValueError(
                f"{op_label(ws[0], block.ops[ws[0]])} and {op_label(ws[-1], block.ops[ws[-1]])} both write "
                f"variable '{name}' and must run on one stage, but a required cut (a split point or a change "
                f"of op_device) before "
                f"{op_label(min(cut), block.ops[min(cut)])} separates them")
        spans.append((group_of[ws[0]], group_of[ws[-1]]))
    joins = [False] * len(groups)  # group g joins the group before it
    for first, last in spans:
        for g in range(first + 1, last + 1):
            joins[g] = True
    merged: list[list[int]] = []
    for g, members in enumerate(groups):
        if joins[g]:
            merged[-1].extend(members)
        else:
            merged.append(list(members))
    return merged
