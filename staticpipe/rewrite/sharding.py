"""ZeRO stage 1 in the rewrite: which member of a sharding group updates which parameter.

With ``sharding_degree`` k, the k data-parallel replicas of a sharding group each keep the optimizer
state (moments, velocities, master weights, beta powers) of about 1/k of every stage's parameters. All
replicas still average their gradients (an all-reduce: each then holds the whole gradient, which a
global-norm clip needs anyway), each updates only its own parameters, and the new values are broadcast
from their owners to the group after the update (runtime/sharding.py).

Why each shard gets an optimize section of its own, in the plan: a rank must never declare, create or
read another shard's state, or it would hold it after all. So shard j's section is the stage's
optimize ops without the update ops of other shards' parameters and without the ops only those read
(a clip's scaled gradient, a weight decay's term); what every shard needs (the learning rate, a clip's
norm over all gradients, its cross-stage sum, AMP's checks) stays in every section, and the exchanges
are the same. The plan states, per stage, which shard owns each parameter and each state variable;
nothing is decided while training.

Parameters go to shards by size, largest first onto the least-loaded shard (ties: the lower shard),
as Paddle's static sharding balances by element count; a tied parameter's copy on a later stage
follows its owner's shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._paddle import framework
from ..ir import num_bytes
from .optimize import Reduction, StageSlice
from .stages import StageAssignment

# slots of an update op that are not the parameter's own state (PIR spells them in snake case)
NOT_STATE = frozenset({"param", "grad", "learningrate", "learning_rate", "skipupdate", "skip_update"})


@dataclass(frozen=True)
class StageShards:
    """One stage's sharding: each shard's optimize op list, and the owner shard of each parameter (and
    tied copy) and of each optimizer state variable."""

    ops: tuple[list, ...]  # shard -> the stage's optimize items (op indices, reductions, slices) it runs
    params: dict[str, int]  # parameter (or tied copy) -> the shard that updates it
    state: dict[str, int]  # optimizer state variable -> the shard that holds it


def updated_parameter(op: Any) -> str | None:
    """The parameter an optimizer's update op writes (its "Param" slot), or None for another op."""
    names = op.input("Param") if "Param" in op.input_names else op.input("param") if "param" in op.input_names else []
    return names[0] if len(names) == 1 else None


def shard_stages(block: framework.Block, assignment: StageAssignment, placed: dict[int, list],
                 k: int) -> list[StageShards]:
    """Every stage's ``StageShards`` over ``k`` shards; ``placed``: each stage's optimize items
    (``place_optimize_ops``)."""
    owners: dict[str, int] = {}  # parameter -> shard, decided on its owner stage
    result = []
    for s in range(len(assignment.devices)):
        updates = {i: p for i in placed[s] if isinstance(i, int) for p in (updated_parameter(block.ops[i]),)
                   if p is not None and assignment.param_stage.get(p) == s}
        state = {i: [n for slot in block.ops[i].input_names if slot.lower() not in NOT_STATE
                     for n in block.ops[i].input(slot) if _is_state(block, n)] for i in updates}
        owners.update(_balanced({p: sum(_bytes(block, n) for n in [p, *state[i]]) for i, p in updates.items()}, k))
        params = {p: owners[p] for p in updates.values()}
        params.update({p: owners[p] for p, readers in assignment.shared.items() if s in readers and p in owners})
        holders: dict[str, set[int]] = {}  # state variable -> the shards of the parameters whose update reads it
        for i, names in state.items():
            for n in names:
                holders.setdefault(n, set()).add(owners[updates[i]])
        mixed = next((n for n, shards in holders.items() if len(shards) > 1), None)
        if mixed is not None:
            readers = sorted(p for i, p in updates.items() if mixed in state[i])
            raise ValueError(f"sharding: the optimizer state '{mixed}' of stage {s} is read by the updates of "
                             f"{readers}, which go to different shards; staticpipe shards state that belongs to "
                             "one parameter")
        held = {n: min(shards) for n, shards in holders.items()}
        result.append(StageShards(tuple(_without(block, placed[s], {n for n, j2 in held.items() if j2 != j})
                                        for j in range(k)), params, held))
    return result


def _is_state(block: framework.Block, name: str) -> bool:
    """A persistable variable, not a constant (PIR's operand-free ``full`` values look persistable to the passes)."""
    var = block._var_recursive(name)
    return var.persistable and not getattr(var, "constant", False)


def _balanced(sizes: dict[str, int], k: int) -> dict[str, int]:
    """Each name onto a shard: largest first onto the least-loaded shard (ties: the lower index)."""
    loads, shard = [0] * k, {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # sorted is stable: equal sizes keep program order
        j = min(range(k), key=lambda i: (loads[i], i))
        shard[name] = j
        loads[j] += sizes[name]
    return shard


def _bytes(block: framework.Block, name: str) -> int:
    var = block._var_recursive(name)
    return num_bytes(var.shape, var)


def _without(block: framework.Block, items: list, others: set[str]) -> list:
    """``items`` without the ops that read ``others`` (another shard's state: its updates) and the ops whose
    outputs only those (or nothing kept later) read. An op stays whatever reads it where it writes state: a
    persistable output (legacy IR), or in place (PIR's ``adam_``, whose outputs are new values)."""
    kept, live = [], set()
    for item in reversed(items):
        i = item.op if isinstance(item, (Reduction, StageSlice)) else item
        op = block.ops[i]
        if isinstance(item, int):
            outs = op.output_arg_names
            writes = op.type.endswith("_") or any(block._var_recursive(n).persistable for n in outs)
            if others.intersection(op.input_arg_names) or (outs and not writes and live.isdisjoint(outs)):
                continue
        live.update(item.inputs if isinstance(item, Reduction) else op.input_arg_names)
        kept.append(item)
    return kept[::-1]
