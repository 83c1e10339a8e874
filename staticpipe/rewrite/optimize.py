"""Placement of the once-per-step ops: learning rate, regularization, clipping, optimizer updates.

Why a pass of its own: these ops are not tied to one stage the way forward ops are. Paddle tags the
update ops (sgd, momentum, adam, ...) with their parameter's device, but the ops of learning-rate
schedules and of ``ClipGradByGlobalNorm`` carry no device, and global-norm clipping sums the squared
norms of every stage's gradients. The rule here is data flow:

- an op with a device runs on that stage; an op reading values of one stage runs there;
- an op reading only stage-free values (the learning rate, constants) is *global*: it is copied to every
  stage that needs its result;
- a ``sum`` reading values of several stages is a *cross-stage reduction*: each stage sums its own
  inputs and an all-reduce (``c_allreduce_sum``) across all stages gives every stage the total;
- AMP's loss-scaling ops (``check_finite_and_unscale``, ``update_loss_scaling``) read and write every
  stage's gradients: each stage runs them on its own gradients (a ``StageSlice``), the overflow flag is
  or-ed over all stages (a cast to float and the same all-reduce), and the loss-scale state, which every
  stage holds, changes on every stage alike because every stage sees the same flag (on a device holding
  several stages, one scope, only its first stage's copy updates the state);
- any other op mixing stages is an error naming it.

Shared parameters (read by several stages' forward) are updated once, on their owner (the first stage):
each other stage accumulates its partial gradient locally and sends the sum once per step; after the
update the owner sends the new value back (see ``SharedPartial``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .._paddle import framework
from ..placement import op_device
from .stages import BWD, LR, OPT, StageAssignment, op_label

GLOBAL = -1


@dataclass(frozen=True)
class Reduction:
    """Op ``op`` is a cross-stage sum; on each stage only ``inputs`` are local."""

    op: int
    output: str
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class StageSlice:
    """Loss-scaling op ``op`` restricted to one stage's gradients ``grads`` (its ``X`` and ``Out``);
    ``updates_state``: False where another stage of the same device (scope) updates the loss-scale state."""

    op: int
    grads: tuple[str, ...]
    updates_state: bool = True


LOSS_SCALING_OPS = ("check_finite_and_unscale", "update_loss_scaling")


@dataclass(frozen=True)
class SharedPartial:
    """Stage ``stage`` holds the partial gradient ``name`` of shared parameter ``param`` (owner: ``owner``)."""

    param: str
    name: str
    stage: int
    owner: int


@dataclass
class OptimizePlacement:
    ops: dict[int, list[int | Reduction | StageSlice]]  # stage -> ops to copy (index), reductions, slices
    replicated: dict[int, str]  # op -> why it runs on several stages


def place_optimize_ops(block: framework.Block, assignment: StageAssignment,
                       grads: dict[str, str]) -> OptimizePlacement:
    """Decide where every learning-rate and optimizer op runs; see the module docstring."""
    p = len(assignment.devices)
    op_ids = [i for i, r in enumerate(assignment.role) if r in (OPT, LR)]
    home: dict[str, int] = {name: s for name, s in assignment.param_stage.items()}
    home.update({g: assignment.param_stage[param] for param, g in grads.items()})
    placed: dict[int, int] = {}
    reductions: dict[int, dict[int, list[str]]] = {}
    slices: dict[int, dict[int, list[str]]] = {}  # loss-scaling op -> stage -> its gradients there
    for i in op_ids:
        op = block.ops[i]
        dev = op_device(op)
        if op.type in LOSS_SCALING_OPS:
            where = GLOBAL
            slices[i] = {s: [n for n in op.input("X") if home.get(n) == s] for s in range(p)}
        elif dev is not None and assignment.devices.count(dev) == 1:  # a device of several chunks names none
            where = assignment.devices.index(dev)
        else:
            stages = sorted({home[n] for n in op.input_arg_names if home.get(n, GLOBAL) != GLOBAL})
            if not stages:
                where = GLOBAL
            elif len(stages) == 1:
                where = stages[0]
            elif op.type == "sum":
                where = GLOBAL
                reductions[i] = {s: [n for n in op.input("X") if home.get(n) == s] for s in range(p)}
            else:
                raise ValueError(
                    f"optimizer {op_label(i, op)} combines values of stages {stages} "
                    f"({', '.join(f'{n}: stage {home[n]}' for n in op.input_arg_names if home.get(n, GLOBAL) != GLOBAL)}); "
                    "only a sum across stages can be split into per-stage sums and an all-reduce")
        placed[i] = where
        for name in op.output_arg_names:
            if home.get(name, where) != where and where != GLOBAL:
                raise ValueError(f"optimizer {op_label(i, op)} on stage {where} writes '{name}', "
                                 f"which belongs to stage {home[name]}")
            home.setdefault(name, where)

    # global ops run where their results are needed (persistable state: everywhere); reductions everywhere
    needed: list[set[str]] = [set() for _ in range(p)]
    first_on_device = [assignment.devices.index(d) == s for s, d in enumerate(assignment.devices)]
    run_on: dict[int, list[int]] = {}
    for i in reversed(op_ids):
        op = block.ops[i]
        if i in reductions or i in slices or (placed[i] == GLOBAL and any(
                block._var_recursive(n).persistable for n in op.output_arg_names)):
            targets = list(range(p))
        elif placed[i] == GLOBAL:
            targets = [s for s in range(p) if needed[s].intersection(op.output_arg_names)]
        else:
            targets = [placed[i]]
        run_on[i] = targets
        state = [n for n in op.output_arg_names if block._var_recursive(n).persistable]
        if placed[i] == GLOBAL and i not in slices and state and not all(first_on_device):
            devices = assignment.devices
            shared = next(d for d in devices if devices.count(d) > 1)
            raise ValueError(f"optimizer {op_label(i, op)} updates '{state[0]}', which every stage holds; {shared} holds "
                             f"stages {[k for k, d in enumerate(devices) if d == shared]} in one scope, where it would "
                             "run once per stage: staticpipe cannot place such an op with several stages on a device")
        for s in targets:
            if i in slices:
                needed[s].update(n for n in op.input_arg_names if n not in op.input("X") or n in slices[i][s])
            else:
                needed[s].update(reductions[i][s] if i in reductions else op.input_arg_names)

    ops: dict[int, list[int | Reduction | StageSlice]] = {s: [] for s in range(p)}
    replicated: dict[int, str] = {}
    for i in op_ids:
        for s in run_on[i]:
            if i in reductions:
                ops[s].append(Reduction(i, block.ops[i].output("Out")[0], tuple(reductions[i][s])))
            elif i in slices:
                ops[s].append(StageSlice(i, tuple(slices[i][s]), first_on_device[s]))
            else:
                ops[s].append(i)
        if i in reductions:
            replicated[i] = "cross-stage sum: per-stage partial sums and an all-reduce"
        elif i in slices:
            replicated[i] = ("loss scaling: each stage's own gradients"
                             + (", the overflow flag or-ed over the stages" if block.ops[i].type == LOSS_SCALING_OPS[0]
                                else ", the same loss-scale update on every stage"))
        elif placed[i] == GLOBAL:
            replicated[i] = f"stage-free value needed on stages {run_on[i]}"
    return OptimizePlacement(ops, replicated)


def shared_partials(block: framework.Block, assignment: StageAssignment,
                    grads: dict[str, str]) -> tuple[list[SharedPartial], dict[int, set[str]]]:
    """Find the backward sums that add a shared parameter's partial gradients from several stages.

    Returns the partials that stay on their stage (accumulated there, sent once per step) and, per sum
    op, the input names to drop from it (they no longer travel per micro-batch).
    """
    producer_stage: dict[str, int] = {}
    for i, op in enumerate(block.ops):
        if assignment.role[i] == BWD:
            for name in op.output_arg_names:
                producer_stage.setdefault(name, assignment.stage[i])
    partials: list[SharedPartial] = []
    drops: dict[int, set[str]] = {}
    shared_grads = {grads[p]: p for p in assignment.shared if p in grads}
    for i, op in enumerate(block.ops):
        if assignment.role[i] != BWD or op.type != "sum" or op.output("Out")[0] not in shared_grads:
            continue
        param = shared_grads[op.output("Out")[0]]
        owner = assignment.param_stage[param]
        if assignment.stage[i] != owner:
            raise ValueError(f"{op_label(i, op)} sums the gradient of shared parameter '{param}' on stage "
                             f"{assignment.stage[i]}, not on its owner stage {owner}")
        remote = [n for n in op.input("X") if producer_stage.get(n, owner) != owner]
        if len(remote) == len(op.input("X")):
            raise ValueError(f"shared parameter '{param}' gets no gradient on its owner stage {owner}; "
                             "staticpipe needs the first stage that reads a shared parameter to train it")
        drops[i] = set(remote)
        partials += [SharedPartial(param, n, producer_stage[n], owner) for n in remote]
    return partials, drops
