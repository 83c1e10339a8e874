"""Small builders of Paddle programs from pieces of another program.

A section is a fresh ``Program`` holding copies of some ops of the user's program; the variables those
ops touch are declared again with the same shape, dtype and persistence. Ops are copied at the desc
level (``copy_from``) so that every attribute, the op's device and role included, survives unchanged.
"""
from __future__ import annotations

from typing import Callable, Iterable

from .._paddle import OP_DEVICE, OP_ROLE, core, framework, paddle
from ..plan import COMM_OP_TYPES, CutVar

EMPTY_VAR = core.kEmptyVarName() if hasattr(core, "kEmptyVarName") else "@EMPTY@"


def np_dtype(var: framework.Variable) -> str:
    return paddle.base.data_feeder.convert_dtype(var.dtype)


def declare_var(dst: framework.Block, src: framework.Variable, persistable: bool | None = None) -> None:
    """Declare ``src`` in ``dst`` (once) with the same type, shape, dtype and persistence."""
    if dst.has_var(src.name):
        return
    kwargs = dict(name=src.name, type=src.type, persistable=src.persistable if persistable is None
                  else persistable, stop_gradient=src.stop_gradient)
    if src.type in (core.VarDesc.VarType.LOD_TENSOR, core.VarDesc.VarType.SELECTED_ROWS,
                    core.VarDesc.VarType.LOD_TENSOR_ARRAY):
        kwargs.update(shape=src.shape, dtype=src.dtype)
        if src.type != core.VarDesc.VarType.SELECTED_ROWS:
            kwargs.update(lod_level=src.lod_level)
    dst.create_var(**kwargs)


OpEdit = Callable[[core.OpDesc], None]


def copy_ops(dst: framework.Block, src: framework.Block, op_indices: Iterable[int],
             edit: OpEdit | None = None, persistable: set[str] = frozenset()) -> None:
    """Append copies of ``src.ops[i]`` to ``dst``; ``edit`` may change each copied desc in place.

    Variables named in ``persistable`` are declared persistable in ``dst`` even if they are not in
    ``src`` (gradients kept in the stage scope so their buffers are reused across micro-batches).
    """
    for i in op_indices:
        op = src.ops[i]
        desc = dst.desc.append_op()
        desc.copy_from(op.desc)
        if edit is not None:
            edit(desc)
        for name in desc.input_arg_names() + desc.output_arg_names():
            if name and name != EMPTY_VAR and not dst.has_var(name):
                declare_var(dst, src._var_recursive(name), True if name in persistable else None)
    dst._sync_with_cpp()


def append_comm_op(block: framework.Block, op_type: str, var: CutVar, peer: int, device: str,
                   role: int, micro_batch_size: int | None) -> None:
    """Append a ``send_v2`` or ``recv_v2`` op moving ``var`` to or from stage ``peer``."""
    shape = list(var.shape_for(micro_batch_size))
    attrs = {"ring_id": 0, "peer": peer, "use_calc_stream": True, OP_DEVICE: device, OP_ROLE: role,
             "dynamic_shape": any(d < 1 for d in shape)}  # unknown dims travel with the tensor
    if op_type == "recv_v2":
        attrs.update(out_shape=shape, dtype=block.var(var.name).dtype)
        block.append_op(type=op_type, outputs={"Out": [var.name]}, attrs=attrs)
    else:
        block.append_op(type=op_type, inputs={"X": [var.name]}, attrs=attrs)


def without_comm_ops(program: framework.Program) -> framework.Program:
    """A copy of ``program`` with its send/recv ops removed: what the runtime executes."""
    clone = program.clone()
    block = clone.global_block()
    for idx in reversed(range(len(block.ops))):
        if block.ops[idx].type in COMM_OP_TYPES:
            block._remove_op(idx, sync=False)
    block._sync_with_cpp()
    return clone


def clear_device_tags(program: framework.Program) -> framework.Program:
    """``program`` with every ``op_device`` emptied (in place): for running a tagged program on the CPU,
    where Paddle would warn about each gpu tag."""
    for op in program.global_block().ops:
        if op.has_attr(OP_DEVICE):
            op._set_attr(OP_DEVICE, "")
    return program
