"""One initial state in every process of a launched job, after the startup program.

Why: each process runs the startup program itself, so a script that seeds only the GPU's generator (as
GPU pretraining scripts do) or seeds its ranks apart initialises every process differently: replicas
start apart, and a tied parameter's copy on a later stage differs from its owner's, silently (Paddle's
fleet broadcasts every parameter over the data-parallel group at startup). Here every persistable a
stage holds (parameters, optimizer state, the learning rate; not the gradient buffers) becomes the value
of its owner in the first replica: the rank of the first stage that holds it (a shared parameter's
owner). Two rounds of broadcasts, over groups the job's channel has anyway:

1. in the first replica's pipeline group, each rank in turn broadcasts the values it owns that other
   ranks of the pipeline hold too (a tied parameter's copy, the learning rate); ranks that hold none of
   them take part and drop them (the other replicas skip this: step 2 overwrites their state);
2. in each group of the ranks that hold the same stages (one rank per replica), the first replica's
   rank broadcasts its stages' whole state.

A message says its names, dtypes and shapes: a receiver that holds one of them in another dtype or
shape, lacks one or holds one the message lacks has an error naming the variable, and every rank of
the group raises together (an all-reduce of a flag), so none waits for the others. Nothing is written
before the group agrees. Only ``Executor.run(startup)`` does this: state loaded afterwards (a
checkpoint, ``set_state_dict``) is never overwritten. With ZeRO-1 each rank then erases the other shards'
optimizer state (``runtime/sharding.py``).
"""
from __future__ import annotations

from .._paddle import np
from ..plan import Plan
from .devices import Devices
from .state import state_dict


def broadcast_startup_state(devices: Devices, plan: Plan) -> None:
    """Give every process the first replica's owners' values of the state its stages hold (a no-op in
    one process); every process of the job calls it after running the startup program."""
    if devices.world is None:
        return
    channel = devices.channel_for(plan)
    channel.reset()  # between steps: nothing left of a failed one
    pipeline = len(plan.ranks)
    process = devices.world[0]
    replica, me = plan.place_of_process(process)
    owners, holders = _owners(plan)
    for src in range(pipeline if replica == 0 else 0):  # 1. the first replica: a value several ranks hold
        names = sorted(n for n, r in owners.items() if r == src and len(holders[n]) > 1)
        if not names:
            continue
        mine = _values(devices, plan, names if me == src else [n for n in names if me in holders[n]])
        got = channel.pipeline_broadcast(mine if me == src else None, src)
        got = {n: v for n, v in got.items() if me != src and me in holders[n]}
        _agreed(channel, "pipeline", None if me == src else _mismatch(got, mine, f"pipeline rank {src} (its owner)"),
                process)
        _store(devices, plan, got)
    if plan.dp_degree > 1:  # 2. every replica: the first replica's (its tied copies now their owners')
        held, first = state_dict(devices, plan), replica == 0
        got = channel.replica_broadcast(held if first else None)
        _agreed(channel, "replicas", None if first else _mismatch(got, held, f"rank {me} of the first replica"),
                process)
        if not first:
            _store(devices, plan, got)
    shard = plan.shard_of_process(devices.world)  # ZeRO-1: from here on, each rank holds its own shard's state
    for stage in devices.local_stages(plan) if shard is not None else ():
        devices.worker(stage.device).scope.erase(sorted(stage.unheld(shard)))


def _values(devices: Devices, plan: Plan, names: list[str]) -> dict[str, np.ndarray]:
    """This process's values of ``names`` (those its stages hold, initialised)."""
    values = {}
    for stage in devices.local_stages(plan):
        scope = devices.worker(stage.device).scope
        for name in names:
            var = scope.find_var(name) if name in stage.persistables else None
            if var is not None and var.get_tensor()._is_initialized():
                values.setdefault(name, np.array(var.get_tensor()))
    return values


def _owners(plan: Plan) -> tuple[dict[str, int], dict[str, set[int]]]:
    """(state name -> the pipeline rank of the first stage holding it, name -> every rank holding it)."""
    owners: dict[str, int] = {}
    holders: dict[str, set[int]] = {}
    for stage in plan.stages:  # in stage order: the first holder owns
        for name in stage.persistables:
            if name not in stage.grad_buffers:
                owners.setdefault(name, stage.rank)
                holders.setdefault(name, set()).add(stage.rank)
    return owners, holders


def _mismatch(got: dict[str, np.ndarray], mine: dict[str, np.ndarray], source: str) -> str | None:
    """Why this rank's state cannot take ``got`` from ``source`` (different programs), or None."""
    for name in sorted(set(got) | set(mine)):
        if name not in got:
            return f"'{name}' has a value here after the startup program but none on {source}"
        if name not in mine:
            return f"'{name}' has a value on {source} after the startup program but none here"
        theirs, ours = got[name], mine[name]
        if theirs.dtype != ours.dtype or theirs.shape != ours.shape:
            return (f"'{name}' is {theirs.dtype} {list(theirs.shape)} on {source} but {ours.dtype} "
                    f"{list(ours.shape)} here")
    return None


def _agreed(channel, among: str, mismatch: str | None, process: int) -> None:
    """Raise on every rank of the group when any of them found a mismatch (this one naming it)."""
    if channel.agree(mismatch is None, among):
        return
    if mismatch is not None:
        raise ValueError(f"the ranks' startup states differ, rank {process}: {mismatch}; every rank must build "
                         "the same program")
    raise ValueError(f"the ranks' startup states differ: another rank of this rank's ({process}) {among} group "
                     "found a variable it holds in another dtype or shape (its error names it); every rank must "
                     "build the same program")


def _store(devices: Devices, plan: Plan, values: dict[str, np.ndarray]) -> None:
    """Write ``values`` into every local stage's scope that holds each name."""
    for stage in devices.local_stages(plan):
        worker = devices.worker(stage.device)
        for name in stage.persistables:
            if name in values:
                worker.scope.var(name).get_tensor().set(values[name], worker.place)
