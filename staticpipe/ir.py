"""The few facts of a Paddle program that every layer reads, each stated once, for both program IRs.

Why a module of its own: the rewrite, the runtime, partitioning and checkpoints all need a variable's
numpy dtype, an op's real argument names, a tensor's size in bytes, the variables a section declares or
a program without device tags, and the same small rule written in four places drifts. It is also the
seam between the two IRs: what differs for a PIR program (``pir_ir.py``) is answered here for both, so
the layers above ask one question whichever IR the plan was built from.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

from ._paddle import OP_DEVICE, PADDLE_MAJOR, core, framework, np, paddle
from .pir_ir import HANDED_OVER, VIEW, is_pir_program, is_pir_value, section_values, value_name

EMPTY_VAR = core.kEmptyVarName() if hasattr(core, "kEmptyVarName") else "@EMPTY@"
# the legacy all-reduce-sum op: Paddle 3.x removed c_allreduce_sum for all_reduce (reduce_type 0: sum)
ALLREDUCE_SUM = ("c_allreduce_sum", {"ring_id": 0, "use_calc_stream": True}, "X", "Out") if PADDLE_MAJOR < 3 else (
    "all_reduce", {"ring_id": 0, "reduce_type": 0}, "x", "out")


def np_dtype(dtype: Any) -> str:
    """The numpy dtype name ("float32", "int64", ...) of a variable, a Paddle dtype or a tensor's dtype."""
    return paddle.base.data_feeder.convert_dtype(getattr(dtype, "dtype", dtype))


def num_bytes(shape: Any, dtype: Any) -> int:
    """Bytes of a tensor of ``shape`` (a -1 dimension, the batch, counted as 1) and dtype ``dtype`` (as
    ``np_dtype`` takes it)."""
    return int(np.prod([abs(int(d)) for d in shape], dtype=np.int64)) * np.dtype(np_dtype(dtype)).itemsize


def as_float(value: Any, dtype: Any) -> np.ndarray:
    """``value`` of a variable of Paddle dtype ``dtype`` as numbers: Paddle hands bfloat16 values out as
    their uint16 bit patterns (its numpy stand-in), which arithmetic must not see; other dtypes as they are."""
    value = np.asarray(value)
    if dtype == core.VarDesc.VarType.BF16 and value.dtype == np.uint16:
        return (value.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return value


def as_fetched(value: np.ndarray, like: np.ndarray, dtype: Any) -> np.ndarray:
    """Numbers ``value`` (from ``as_float``) handed out as ``like`` was: a bfloat16 value as its bit
    patterns, rounded to nearest even (Paddle's fetch gives bfloat16 so); others in ``like``'s dtype."""
    if np.asarray(like).dtype == np.uint16 and dtype == core.VarDesc.VarType.BF16:
        return paddle.static.amp.bf16.amp_utils.convert_float_to_uint16(np.asarray(value, np.float32))
    return np.asarray(value).astype(np.asarray(like).dtype)


@functools.lru_cache(maxsize=None)
def paddle_dtype(name: str) -> Any:
    """Paddle's dtype for a numpy dtype name (the inverse of ``np_dtype``)."""
    return paddle.base.framework.convert_np_dtype_to_dtype_(name)


def arg_names(names: Iterable[str]) -> list[str]:
    """An op's argument names without the empty placeholders Paddle puts in optional slots."""
    return [n for n in names if n and n != EMPTY_VAR]


def var_names(items: Sequence | Any | None, program: Any = None) -> list[str]:
    """Names of variables given as ``Variable`` objects (PIR values of ``program``) or as names (a
    ``fetch_list``); one variable or name alone counts as a list of it, as in Paddle."""
    if items is None:
        return []
    if isinstance(items, str) or isinstance(items, framework.Variable) or is_pir_value(items):
        items = [items]
    names = []
    for k, item in enumerate(items):
        if is_pir_value(item):
            names.append(value_name(program, item, f"fetch_list[{k}]"))
            continue
        if not isinstance(item, (str, framework.Variable)):
            raise ValueError(f"fetch_list[{k}] must be a variable or its name, got {type(item).__name__}: {item!r}")
        names.append(item if isinstance(item, str) else item.name)
    return names


def program_view(program: Any) -> Any:
    """``program`` as the passes read it: itself (legacy IR), or the ``PirView`` its plan was built from
    (a PIR program pipelined by ``PipelineOptimizer.minimize``)."""
    if not is_pir_program(program):
        return program
    view = getattr(program, VIEW, None)
    if view is None:
        raise ValueError("this PIR program was not pipelined by staticpipe.PipelineOptimizer.minimize")
    return view


def variable(program: Any, name: str) -> Any:
    """Variable ``name`` of a pipelined ``program`` as Paddle's APIs take it (a loader's ``feed_list``, a
    fetch list): the legacy ``Variable``, or the PIR value the rewrite named so. A program read back by
    ``load_plan`` has no model code around it to hold its variables; this finds them on either IR."""
    return program_view(program).var(name).value if is_pir_program(program) else program.global_block().var(name)


def fetch_target(program: Any, name: str) -> Any:
    """What Paddle's own executor fetches for variable ``name`` of ``program``: the name (legacy IR), or
    the value the rewrite named so (PIR, whose values mostly have no name of their own)."""
    return program_view(program).var(name).value if is_pir_program(program) else name


def declared(program: Any) -> list[tuple[str, bool]]:
    """(name, persistable) of every variable a section program declares, on either IR."""
    if is_pir_program(program):  # a value handed over to the micro-batch is persistable only on its way there
        handed = set(getattr(program, HANDED_OVER, ()))
        return [(name, bool(v.persistable) and name not in handed) for name, v in section_values(program).items()]
    return [(v.name, v.persistable) for v in program.list_vars()]


def declared_var(program: Any, name: str) -> tuple[tuple[int, ...], Any]:
    """(shape, Paddle dtype) of variable ``name`` of a section program, on either IR."""
    if is_pir_program(program):
        value = section_values(program)[name]
        return tuple(int(d) for d in value.shape), value.dtype
    var = program.global_block()._var_recursive(name)
    return tuple(var.shape), var.dtype


def num_compute_ops(program: Any, comm_types: Sequence[str]) -> int:
    """Ops of a section program that compute (not the ``comm_types`` ops the rewrite added)."""
    ops = program.global_block().ops
    if is_pir_program(program):
        return len(ops)
    return sum(1 for op in ops if op.type not in comm_types)


def tensor_bytes(scope: core._Scope, name: str) -> int:
    """Bytes the tensor ``name`` holds in ``scope`` (0 when it is absent or has no value)."""
    var = scope.find_var(name)
    if var is None:
        return 0
    tensor = var.get_tensor()
    return tensor._numel() * core.size_of_dtype(tensor._dtype()) if tensor._is_initialized() else 0


def tensor_of(scope: core._Scope, name: str, where: object) -> core.LoDTensor:
    """The tensor ``name`` holds in ``scope``; ``RuntimeError`` naming ``where`` it was missing."""
    var = scope.find_var(name)
    tensor = var.get_tensor() if var is not None else None
    if tensor is None or not tensor._is_initialized():
        raise RuntimeError(f"variable '{name}' has no value in {where}")
    return tensor


def clear_device_tags(program: framework.Program) -> framework.Program:
    """``program`` with every ``op_device`` emptied (in place). A worker runs every op of its stage on
    its own place; a "gpu:k" tag would move the op to GPU k (or warn on a CPU build). PIR's executor
    does not read the tag staticpipe writes on PIR ops, but its serializer refuses it: on a PIR program
    the attribute is erased."""
    if is_pir_program(program):
        for op in program.global_block().ops:
            if op.has_attr(OP_DEVICE):
                op.erase_attr(OP_DEVICE)
        return program
    for op in program.global_block().ops:
        if op.has_attr(OP_DEVICE):
            op._set_attr(OP_DEVICE, "")
    return program


def free_scope(scope: core._Scope) -> None:
    """Delete a root scope made by ``core.Scope()``, its variables and its kid scopes.

    Why not leave it to Python: ``core.Scope()`` hands the new scope to Paddle's process-wide
    ``ScopePool``, which owns it until the process exits; the Python object is only a reference (pybind's
    ``reference`` policy), so dropping it frees nothing. An executor's device scopes, the startup
    program's host scope and what they held (parameters, optimizer state, gradient buffers, the
    micro-batch scopes' tensors) stayed allocated after ``Executor.close()`` -- 13-15 MB per executor for
    the 4-stage GPT of the tests -- and so did every profile's, verify's and export's scope.
    ``_remove_from_pool`` takes it out of the pool and deletes it: every handle to it, or to a scope under
    it, is then dangling, so only scopes that nothing uses afterwards are freed here."""
    scope._remove_from_pool()
