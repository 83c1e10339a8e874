"""Stage assignment: which stage runs each op of a differentiated program. A pure analysis.

Rules, in order:
- forward ops take the stage of their ``op_device`` guard; stages are numbered by the first forward op
  of each device;
- a forward op with no guard joins the latest stage among the producers of its inputs; one whose inputs
  are only data, parameters or constants joins the earliest stage that consumes its outputs (directly or
  through other unguarded ops); one that nothing consumes goes to stage 0;
- backward ops take their guard (Paddle copies the forward op's device) or, without one, the stage of the
  forward op whose gradient they compute;
- a parameter belongs to the first stage that reads it; one read on several stages is *shared*;
- optimizer-phase ops are placed by ``rewrite/optimize.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Any, Callable

from .._paddle import GRAD_SUFFIX, OP_ROLE, ROLE_BACKWARD, ROLE_LRSCHED, ROLE_OPTIMIZE, framework
from ..placement import SPLIT_POINTS, op_device

FWD, BWD, OPT, LR = "forward", "backward", "optimize", "lr"
DEFAULT_DEVICE = "gpu:0"


@dataclass
class StageAssignment:
    devices: list[str]  # stage -> device (a device holds several stages when chunked)
    role: list[str]  # op index -> FWD/BWD/OPT/LR
    stage: list[int | None]  # op index -> stage of forward and backward ops (None for the others)
    param_stage: dict[str, int]  # parameter -> its owner: the first stage whose forward reads it
    shared: dict[str, tuple[int, ...]]  # parameter read on several stages -> those stages


def op_label(i: int, op: framework.Operator) -> str:
    return f"op #{i} '{op.type}'"


def role_of(op: framework.Operator, i: int) -> str:
    role = int(op.attr(OP_ROLE)) if op.has_attr(OP_ROLE) else 0
    if role & ROLE_LRSCHED:
        return LR
    if role & ROLE_OPTIMIZE:
        return OPT
    if role & ROLE_BACKWARD:
        return BWD
    if role & ~0x100:  # anything but Forward / Loss
        raise ValueError(f"{op_label(i, op)} has op_role {role}, which staticpipe cannot place "
                         "(RPC and distributed ops are not supported)")
    return FWD


def grad_base(name: str) -> str | None:
    """``x`` for ``x@GRAD`` and ``x@GRAD@RENAME@...``; None for a non-gradient name."""
    pos = name.find(GRAD_SUFFIX)
    return name[:pos] if pos > 0 else None


def latest_gradient_source(op: framework.Operator, position: Callable[[str], int | None]) -> int | None:
    """Where the forward op lies whose gradient backward op ``op`` computes, or None if it touches no
    gradient of a forward variable.

    The gradient of forward op O reads O's output gradients and writes its input gradients, so O is the
    latest, by ``position`` (a stage, or an op index), of the forward variables whose gradients ``op``
    reads or writes; ``position`` gives a variable's producer (a parameter's: its first reader)."""
    found = [p for n in op.input_arg_names + op.output_arg_names
             if (base := grad_base(n)) is not None and (p := position(base)) is not None]
    return max(found) if found else None


def gradient_owners(block: Any, roles: list[str], recorded: Callable[[int], int | None] = lambda j: None
                    ) -> dict[int, int]:
    """Backward op index -> index of the forward op whose gradient it computes, over the ops of ``block`` (a
    legacy block, or a PIR program's view) whose roles ``roles`` gives (FWD, BWD, ...): ``recorded(j)``
    when it knows (what Paddle's PIR backward recorded while it differentiated), else the rule
    ``latest_gradient_source`` states (a sum of gradients belongs to the latest forward op among them)."""
    producer: dict[str, int] = {}
    first_reader: dict[str, int] = {}
    params = {p.name for p in block.all_parameters()}
    for i, role in enumerate(roles):
        if role == FWD:
            for name in block.ops[i].output_arg_names:
                producer.setdefault(name, i)
            for name in block.ops[i].input_arg_names:
                if name in params:
                    first_reader.setdefault(name, i)
    owners = {}
    for j, role in enumerate(roles):
        if role != BWD:
            continue
        owner = recorded(j)
        if owner is None:
            owner = latest_gradient_source(block.ops[j], lambda base: producer.get(base, first_reader.get(base)))
        if owner is None:
            raise ValueError(f"backward {op_label(j, block.ops[j])} computes no gradient of a forward variable; "
                             "staticpipe cannot tell which forward op it belongs to")
        owners[j] = owner
    return owners


def assign_stages(program: framework.Program, chunked: bool = False) -> StageAssignment:
    """Assign every forward and backward op a stage.

    ``chunked`` (schedules with several chunks per device: interleaved, ZB-V): every return of the
    forward ops to a device already used starts a new stage (chunk) on it, so guards gpu:0, gpu:1,
    gpu:0, gpu:1 give four stages on two devices; backward ops then follow their forward op by data
    flow rather than by their device tag, which no longer names one stage. ``staticpipe.split_point()``
    also starts a new stage there, for consecutive stages on one device (the bottom of ZB-V's V).
    """
    block = program.global_block()
    ops = list(block.ops)
    for i, op in enumerate(ops):
        if op.has_attr("sub_block"):
            raise ValueError(f"{op_label(i, op)} has a sub-block (control flow); staticpipe cannot split "
                             "control-flow ops across stages yet")
    roles = [role_of(op, i) for i, op in enumerate(ops)]
    fwd = [i for i, r in enumerate(roles) if r == FWD]

    devices: list[str] = []
    stage: list[int | None] = [None] * len(ops)
    splits = sorted(getattr(program, SPLIT_POINTS, ()))
    previous = -1
    for i in fwd:
        dev = op_device(ops[i])
        if dev is None:
            continue
        if chunked:
            if not devices or devices[-1] != dev or any(previous < p <= i for p in splits):
                devices.append(dev)
            stage[i] = len(devices) - 1
            previous = i
        else:
            if dev not in devices:
                devices.append(dev)
            stage[i] = devices.index(dev)
    if not devices:
        devices = [DEFAULT_DEVICE]

    producer: dict[str, int] = {}  # forward var -> producing op index
    for i in fwd:
        for name in ops[i].output_arg_names:
            producer.setdefault(name, i)

    # unguarded forward ops: ops with a producing op follow their latest producer; source ops (data,
    # parameters, constants only) take the earliest stage that consumes them, directly or through
    # other unguarded ops. One pass from the end: earliest[v] is the earliest stage among the later
    # readers of v seen so far (each op's argument names read once: they cross into C++ every time)
    inputs = {i: ops[i].input_arg_names for i in fwd}
    consumer_stage: dict[int, int] = {}
    earliest: dict[str, int] = {}
    for i in reversed(fwd):
        cons = [earliest[n] for n in set(ops[i].output_arg_names) if n in earliest]
        if cons:
            consumer_stage[i] = min(cons)
        mine = stage[i] if stage[i] is not None else consumer_stage.get(i)
        if mine is not None:
            for name in inputs[i]:
                earliest[name] = min(earliest.get(name, mine), mine)
    for i in fwd:
        if stage[i] is None:
            ins = [stage[producer[n]] for n in inputs[i] if n in producer and producer[n] != i]
            ins = [s for s in ins if s is not None]
            stage[i] = max(ins) if ins else consumer_stage.get(i, 0)

    # forward data may only flow to later stages
    for i in fwd:
        for name in inputs[i]:
            j = producer.get(name)
            if j is not None and j != i and stage[j] > stage[i]:
                raise ValueError(
                    f"{op_label(i, ops[i])} on stage {stage[i]} ({devices[stage[i]]}) reads variable "
                    f"'{name}' produced on the later stage {stage[j]} ({devices[stage[j]]}) by "
                    f"{op_label(j, ops[j])}: forward data may only flow to later stages; "
                    "move the op into a later device_guard or reorder the guards")

    param_names = {p.name for p in block.all_parameters()}
    readers: dict[str, list[int]] = {}
    for i in fwd:
        for name in inputs[i]:
            if name in param_names and stage[i] not in readers.setdefault(name, []):
                readers[name].append(stage[i])
    param_stage = {name: min(stages) for name, stages in readers.items()}
    shared = {name: tuple(sorted(stages)) for name, stages in readers.items() if len(stages) > 1}

    for i, op in enumerate(ops):
        if roles[i] == BWD:
            stage[i] = _backward_stage(i, op, None if chunked else devices, producer, stage, param_stage)
    return StageAssignment(devices, roles, stage, param_stage, shared)


def _backward_stage(i: int, op: framework.Operator, devices: list[str] | None, producer: dict[str, int],
                    stage: list[int | None], param_stage: dict[str, int]) -> int:
    """The device tag's stage (``devices`` given), else the stage of the forward op being differentiated."""
    dev = op_device(op) if devices is not None else None
    if dev is not None:
        if dev not in devices:
            raise ValueError(f"backward {op_label(i, op)} is on device {dev}, which runs no forward op")
        return devices.index(dev)
    found = latest_gradient_source(op, lambda base: stage[producer[base]] if base in producer
                                   else param_stage.get(base))
    if found is None:
        raise ValueError(f"backward {op_label(i, op)} has no device and computes no gradient of a forward "
                         "variable; staticpipe cannot tell which stage runs it")
    return found
