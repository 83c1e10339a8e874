"""Paddle's own save and load calls on a pipelined program: ``paddle.distributed.io.save_persistables`` /
``load_persistables``, ``paddle.static.save_vars`` / ``load_vars``, ``save_inference_model``, and
``paddle.static.save`` after ``exe.flush()``.

Why a module of its own: those functions never see the stages. On the legacy IR, ``save_vars`` builds a
program of ``save`` / ``save_combine`` ops over the variables it names and calls ``exe.flush()`` then
``exe.run(save_program)``; ``load_vars`` runs a program of ``load`` / ``load_combine`` ops and then reads
the loaded parameters back from ``paddle.static.global_scope()`` to check their shapes; ``paddle.static.save``
(and, on PIR, ``save_vars`` and ``save_inference_model``) read ``global_scope()`` without calling the executor. staticpipe keeps each
device's state in a scope of its own (``Executor.scope_of``), and a launched process holds only its own
stages'. So:
- ``publish`` (what ``Executor.flush`` does: Paddle's "flush all trainer params to root scope") writes the
  whole model's state, gathered from every stage (launched: the first replica's ranks send theirs to rank
  0, as ``staticpipe.save`` gathers), into ``global_scope()`` of the process that holds it; the other
  processes publish nothing, so no rank writes a partial model;
- a save program writes the files one device writes: one file of several variables (``filename=``) from
  the process that gathered the state; one file per variable from the process running its owner (the first
  stage holding it, in the first replica; a ZeRO-1 shard's optimizer state, in the first sharding group's
  member holding it), so a program naming only some stages' state (a section program,
  ``main._pipeline_opt['section_program']``, on each rank) is written whole too. Gradient buffers a
  section program holds are not written (one device has none) nor read;
- a load program runs in every process into ``global_scope()`` (as on one device: Paddle checks the
  parameters there), and every local stage takes the values it holds (replicas and tied copies too).
"""
from __future__ import annotations

import weakref
from typing import Any

from .._paddle import core, framework, np, paddle
from ..ir import free_scope, is_pir_program
from ..plan import FORWARD_ONLY, Plan
from . import state
from .devices import Devices

SAVES, LOADS = frozenset({"save", "save_combine"}), frozenset({"load", "load_combine"})


def io_kind(program: framework.Program) -> str | None:
    """"save" or "load" for a legacy program of only Paddle's save (load) ops, as ``save_vars``
    (``load_vars``) builds it; None for any other program."""
    if is_pir_program(program):
        return None
    ops = {op.type for block in program.blocks for op in block.ops}
    return "save" if ops and ops <= SAVES else "load" if ops and ops <= LOADS else None


def publish(devices: Devices, plan: Plan | None, step: int, scope: Any) -> bool:
    """Write every stage's state into ``scope`` (host copies) in the process that gathers it; whether this
    process did (False: another rank of a launched job holds the whole model)."""
    if plan is None:
        return True  # nothing pipelined ran on this executor: the scope is the program's own
    gathered = state.gathered_state_dict(devices, plan, step)
    _FLUSHED[plan] = (None if gathered is None else weakref.ref(scope), weakref.ref(devices))
    if gathered is None:
        return False
    for name, value in gathered.items():
        scope.var(name).get_tensor().set(value, core.CPUPlace())
    return True


_FLUSHED: Any = weakref.WeakKeyDictionary()  # plan -> (the scope its last flush wrote, or None; its devices)


def stale(plan: Plan, scope: Any) -> str | None:
    """Why ``scope`` (``global_scope()``, what ``paddle.static.save`` reads) does not hold ``plan``'s current
    state, as far as this process can tell; None when it does. An evaluation program's forward-only plan
    holds no state of its own: the flush of a training plan whose stages hold its values counts (of
    several such plans -- other executors', other programs built alike -- the one whose flush holds)."""
    if plan.schedule == FORWARD_ONLY:
        names = {n for st in plan.stages for n in st.persistables}
        why = [_stale(p, scope) for p in list(_FLUSHED.keys()) if any(p.stage_of_var(n) for n in names)]
        return None if None in why else why[0] if why else _stale(plan, scope)
    return _stale(plan, scope)


def _stale(plan: Plan, scope: Any) -> str | None:
    flushed, devices = _FLUSHED.get(plan, (None, None))
    if devices is None:
        return "no staticpipe.Executor flushed this pipelined program's state there"
    if flushed is None:
        return ("exe.flush() returned False in this process: another rank of the launched job (rank 0) holds "
                "the whole model; call paddle.static.save where exe.flush() returned True")
    if flushed() is not scope:
        return "exe.flush() wrote this program's state into another scope than the current global_scope()"
    if devices() is None or not devices().workers:  # closed since: nothing can have changed since the flush
        return None
    differ = [n for n, v in state.state_dict(devices(), plan).items() if (found := scope.find_var(n)) is None
              or np.array(found.get_tensor()).tobytes() != np.ascontiguousarray(v).tobytes()]  # NaN too
    return f"the stages changed since the last exe.flush() ({', '.join(differ[:3])}, ...)" if differ else None


def run(kind: str, devices: Devices, plan: Plan | None, step: int, plain: Any, program: framework.Program,
        scope: Any) -> list:
    """Run Paddle's save or load ``program`` against the pipeline's state (``plan``: the executor's last
    pipelined training plan, None before any: then it is a plain program)."""
    scope = scope if scope is not None else paddle.static.global_scope()
    if plan is None:
        return plain.run(program, scope=scope)
    program = _without_gradients(program, plan)  # a section program's (``_pipeline_opt``) gradient buffers
    if kind == "load":
        result = plain.run(program, scope=scope)
        loaded = {n: np.array(scope.find_var(n).get_tensor()) for n in _names(program) if plan.stage_of_var(n)}
        state.set_state_dict(devices, plan, loaded, strict=False)
        return result
    if devices.world is None or any(op.type == "save_combine" for op in program.global_block().ops):
        if not publish(devices, plan, step, scope):  # one file: rank 0 gathers every stage and writes
            return []
        return _save(plain, program, scope)
    if unknown := [n for n in _names(program) if not plan.stage_of_var(n)]:
        raise _not_held(unknown)
    owned = _owned(devices, plan, _names(program))  # one file a variable: each by the process of its owner
    program, local = _only(program, owned), state.state_dict(devices, plan)
    own_scope = core.Scope()
    try:
        for name in owned:
            own_scope.var(name).get_tensor().set(local[name], core.CPUPlace())
        return _save(plain, program, own_scope) if owned else []
    finally:
        free_scope(own_scope)


def _save(plain: Any, program: framework.Program, scope: Any) -> list:
    missing = [n for n in _names(program) if not ((v := scope.find_var(n)) is not None
                                                    and v.get_tensor()._is_initialized())]
    if missing:
        raise _not_held(missing)
    return plain.run(program, scope=scope)


def _not_held(names: list[str]) -> ValueError:
    return ValueError(f"Paddle's save program names {names}, which no stage of the pipelined program holds (a "
                      "parameter or optimizer state of another program?)")


def _names(program: framework.Program) -> list[str]:
    return [n for op in program.global_block().ops for n in (op.input("X") if op.type in SAVES else op.output("Out"))]


def _owned(devices: Devices, plan: Plan, names: list[str]) -> list[str]:
    """The ``names`` whose owner -- the first stage holding it, in the first replica (ZeRO-1: another shard's
    optimizer state in the replica of the first sharding group that holds it) -- this process runs."""
    return [n for n in names if (held := plan.stage_of_var(n)) and devices.world[0] == plan.process_of(
        plan.stages[held[0]].state_shards.get(n, 0), plan.stages[held[0]].rank)]


def _without_gradients(program: framework.Program, plan: Plan) -> framework.Program:
    """``program`` without the gradients it names that no stage holds as state: the persistable gradient
    buffers of a section program (``main._pipeline_opt['section_program']``), which one device has not."""
    buffers = {n for st in plan.stages for n in st.grad_buffers}
    state_names = {n for st in plan.stages for n in st.persistables if n not in st.grad_buffers}
    drop = {n for n in _names(program) if n in buffers or ("@GRAD" in n and n not in state_names)}
    return _only(program, [n for n in _names(program) if n not in drop]) if drop else program


def _only(program: framework.Program, keep: list[str]) -> framework.Program:
    """A copy of the save (load) ``program`` writing (reading) only ``keep``."""
    program, keep = program.clone(), set(keep)
    block = program.global_block()
    for i in reversed(range(len(block.ops))):
        op = block.ops[i]
        slot = "X" if op.type in SAVES else "Out"
        names = op.input(slot) if slot == "X" else op.output(slot)
        kept = [n for n in names if n in keep]
        if not kept:
            block._remove_op(i)
        elif len(kept) < len(names):
            (op.desc.set_input if slot == "X" else op.desc.set_output)(slot, kept)
    program._sync_with_cpp()
    return program


__all__ = ["io_kind", "publish", "run", "stale"]
