"""The stages' state: initialising it from the startup program, reading it, writing it.

Parameters and optimizer state live in one root scope per device. The startup program runs once on the
host (with its device tags removed) and each stage receives the values of its own persistables on its
own place, so every stage starts from exactly the state one device would. In a job of several processes
each process holds only its own stages' state; ``gathered_state_dict`` brings it to rank 0, which
writes checkpoints.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any

from .._paddle import core, framework, np, paddle
from ..ir import clear_device_tags, declared, declared_var, free_scope, is_pir_program, np_dtype
from ..pir_ir import pir_thread
from ..plan import Plan, Stage
from .devices import Devices


def run_startup(devices: Devices, startup: framework.Program, plan: Plan) -> None:
    """Run ``startup`` on the host and give each stage its persistables, each in the dtype the stage's
    programs declare: pure low-precision AMP (fp16 O2, ``decorate_bf16(use_pure_bf16=True)``) declares
    parameters float16/bfloat16 while the startup program makes float32 values, which Paddle's
    ``amp_init`` casts afterwards on one device; here every stage's copy is cast as it is placed (the
    float32 master weights are the optimizer's own persistables, initialised by the startup program)."""
    stages = devices.runnable_stages(plan)  # refused before anything runs
    host = core.Scope()
    try:
        on_host = clear_device_tags(startup.clone())
        on_host.random_seed = startup.random_seed
        with pir_thread() if is_pir_program(startup) else contextlib.nullcontext():
            paddle.static.Executor(core.CPUPlace()).run(on_host, scope=host)
        for stage in stages:
            worker = devices.worker(stage.device)
            dtypes = {name: declared_var(section.program, name)[1] for section in stage.sections.values()
                      for name, persistable in declared(section.program) if persistable}
            for name in stage.persistables:
                var = host.find_var(name)
                if var is not None and var.get_tensor()._is_initialized():
                    value = np.array(var.get_tensor())
                    worker.scope.var(name).get_tensor().set(_low_precision(value, dtypes.get(name)), worker.place)
            worker.init_stage(stage)
    finally:  # the stages hold copies: the host's values, the whole model's state, are freed (free_scope)
        free_scope(host)


def _low_precision(value: np.ndarray, dtype: Any) -> np.ndarray:
    """A float32 ``value`` of a variable declared float16 or bfloat16, cast as ``amp_init`` casts it."""
    if value.dtype != np.float32 or dtype not in (core.VarDesc.VarType.FP16, core.VarDesc.VarType.BF16):
        return value
    if dtype == core.VarDesc.VarType.FP16:
        return value.astype(np.float16)
    return paddle.static.amp.bf16.amp_utils.convert_float_to_uint16(value)


def set_learning_rate(devices: Devices, program: framework.Program, plan: Plan) -> None:
    """Give every stage the scheduler's current learning rate, as Paddle's executor does before each
    run; the scheduler advances only when ``step()`` is called (by the user or ``lr_step``)."""
    scheduler = getattr(program, "lr_scheduler", None)
    if scheduler is None:
        return
    name = getattr(program, "lr_name", None) or scheduler._var_name  # PIR's, legacy's
    for s in plan.stage_of_var(name):
        worker = devices.worker(plan.stages[s].device)
        tensor = worker.scope.var(name).get_tensor()
        held = tensor._is_initialized()
        dtype, shape = (np_dtype(tensor._dtype()), tuple(tensor.shape())) if held else ("float32", ())
        tensor.set(np.full(shape, scheduler(), dtype=dtype), worker.place)  # Paddle's 0-D learning rate stays 0-D


def state_dict(devices: Devices, plan: Plan) -> dict[str, np.ndarray]:
    """Every parameter and optimizer state this process's stages hold (not the gradient buffers)."""
    state = {}
    for stage in devices.local_stages(plan):
        scope = devices.worker(stage.device).scope
        for name in stage.persistables:
            var = scope.find_var(name)
            if name not in stage.grad_buffers and var is not None and var.get_tensor()._is_initialized():
                state.setdefault(name, np.array(var.get_tensor()))
    return state


def gathered_state_dict(devices: Devices, plan: Plan, step: int) -> dict[str, np.ndarray] | None:
    """``state_dict`` of every stage, in the process that writes checkpoints: rank 0 of a job of several
    processes receives the other pipeline ranks' state (the other replicas hold the same bits) and the
    others return None; in one process, simply ``state_dict``."""
    state = state_dict(devices, plan)
    if devices.world is None:
        return state
    rank, pipeline = devices.world[0], len(plan.ranks)
    replica = plan.place_of_process(rank)[0]
    channel, key = devices.channel_for(plan), ("state", step)
    if plan.sharding_degree > 1 and replica < plan.sharding_degree:  # ZeRO-1: the first group's shards
        sharded = {n for st in devices.local_stages(plan) for n in st.state_shards}
        pooled = channel.shard_exchange({n: v for n, v in state.items() if n in sharded})
        state.update(pooled if replica == 0 else {})
    if rank == 0:
        for peer in range(1, pipeline):
            state.update(channel.recv(key, next(s.index for s in plan.stages if s.rank == peer)))
        return state
    if replica == 0:
        channel.send(key, state, 0)
        channel.flush()
    return None


def gathered_positions(devices: Devices, plan: Plan, mine: dict | None) -> list[dict | None] | None:
    """Where every process's data stands (``mine``: this one's, JSON values), in rank order, on rank 0 of a
    job of several processes (the others return None; every one calls it); in one process, ``[mine]``."""
    if devices.world is None:
        return [mine]
    every = devices.channel_for(plan).gather_bytes(json.dumps(mine).encode())
    return [json.loads(b) for b in every] if devices.world[0] == 0 else None


def set_state_dict(devices: Devices, plan: Plan, state: dict[str, Any], strict: bool = True) -> None:
    """Write ``state`` (name -> array) into every local stage that holds each name. Names no stage holds
    are an error, or skipped with ``strict=False``; so is a value whose dtype is not the variable's, and
    writing before the startup program ran (it would overwrite what is written)."""
    unknown = [n for n in state if not plan.stage_of_var(n)]
    if unknown and strict:
        raise KeyError(f"set_state_dict: no stage holds {unknown}")
    stages = devices.local_stages(plan)
    for stage in stages:
        missing = uninitialised(devices, plan, stage)
        if missing:
            raise ValueError(f"set_state_dict before the startup program: stage {stage.index} ({stage.device}) has "
                             f"no value for {missing[0]!r} yet, and exe.run(startup) would overwrite what is set "
                             "now; run the startup program first")
    state = {name: _as_stored(devices, plan, name, value) for name, value in state.items()}
    local, shard = {st.index for st in stages}, plan.shard_of_process(devices.world)
    for name, value in state.items():
        for s in plan.stage_of_var(name):
            if s in local and plan.stages[s].holds(name, shard):  # ZeRO-1: not another member's state
                worker = devices.worker(plan.stages[s].device)
                worker.scope.var(name).get_tensor().set(np.asarray(value), worker.place)


def _as_stored(devices: Devices, plan: Plan, name: str, value: Any) -> np.ndarray:
    """``value`` in the dtype the stages hold ``name`` in: cast when the cast changes no number (a 0-d
    float32 plus 1 is float64 in numpy), else ``ValueError`` naming the variable and both dtypes."""
    value = np.asarray(value)
    for s in plan.stage_of_var(name):
        var = devices.worker(plan.stages[s].device).scope.find_var(name)
        if var is None or not var.get_tensor()._is_initialized():
            continue
        have = np.dtype(np_dtype(var.get_tensor()._dtype()))
        shape = tuple(var.get_tensor().shape())
        if value.shape != shape and not (value.size == 1 and int(np.prod(shape)) == 1):
            raise ValueError(f"set_state_dict: '{name}' has shape {list(shape)} in the program, but the value "
                             f"given has shape {list(value.shape)}")
        value = value.reshape(shape)  # a scalar saved as [1] (a learning rate before 0-D) is held as the program's
        if value.dtype != have:
            cast = value.astype(have)
            if value.dtype.kind != have.kind or not np.array_equal(cast, value):
                raise ValueError(f"set_state_dict: '{name}' is {have} in the program, but the value given is "
                                 f"{value.dtype} and does not convert exactly")
            value = cast
    return value


def uninitialised(devices: Devices, plan: Plan, stage: Stage) -> list[str]:
    """The persistables of ``stage`` (its state, not the gradient buffers, not other shards' optimizer state)
    its device's scope has no value for."""
    scope, shard = devices.worker(stage.device).scope, plan.shard_of_process(devices.world)
    return [n for n in stage.persistables if n not in stage.grad_buffers and stage.holds(n, shard) and not (
        (var := scope.find_var(n)) is not None and var.get_tensor()._is_initialized())]


def copy_stage_state(devices: Devices, program: framework.Program, scope: core._Scope, place: core.Place) -> None:
    """Copy the values the stages hold into ``scope`` for every persistable of ``program``, so that a
    program without a plan (an evaluation clone, ``main.clone(for_test=True)``) sees the trained state."""
    for var in program.list_vars():
        if not var.persistable:
            continue
        for worker in devices.workers.values():
            found = worker.scope.find_var(var.name)
            if found is not None and found.get_tensor()._is_initialized():
                scope.var(var.name).get_tensor().set(np.array(found.get_tensor()), place)
                break


def scope_state(program: framework.Program, scope: core._Scope) -> dict[str, np.ndarray]:
    """Every initialised persistable of ``program`` that ``scope`` holds."""
    state = {}
    for v in program.list_vars():
        found = scope.find_var(v.name) if v.persistable else None
        if found is not None and found.get_tensor()._is_initialized():
            state[v.name] = np.array(found.get_tensor())
    return state
