"""Graph passes from a differentiated Paddle program to a pipeline ``Plan``. They execute nothing.

``build_plan`` = ``assign_stages`` (which stage runs each op) → ``build_sections`` (per-stage programs
with send/recv ops and gradient accumulation) → schedule action lists lowered with the routes.
"""
from __future__ import annotations

from typing import Iterable

from .._paddle import framework
from ..plan import Plan
from ..schedule.actions import F
from ..schedule import Kind, Schedule, check_microbatches, get_kind, lower, make_schedule, parse_schedule, validate
from ..schedule.registry import check_costs
from ..schedule.simulate import StageCosts
from .programs import clear_device_tags, np_dtype, split_at_comm_ops, without_comm_ops
from .sections import MERGED_SUFFIX, build_sections
from .stages import assign_stages


def check_micro_batch_size(micro_batch_size: object) -> None:
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size!r}")


def build_plan(program: framework.Program, loss_name: str, num_microbatches: int = 1,
               schedule: str | Schedule = "1F1B", micro_batch_size: int | None = None,
               recompute: bool | Iterable[int] = False, schedule_costs: StageCosts | None = None) -> Plan:
    """Split ``program`` (forward, backward and optimizer ops, tagged by ``device_guard``) into a Plan.

    ``schedule``: a schedule name, or a custom schedule (``{rank: [Action, ...]}`` or its text form,
    compute actions only), validated before it is accepted.
    ``recompute``: True for every stage, or the stage indices whose activations are recomputed.
    ``schedule_costs``: F/B/W durations (one per kind, or a list per stage) a zero-bubble schedule plans with.
    """
    check_microbatches(num_microbatches)
    check_micro_batch_size(micro_batch_size)
    check_schedule_costs(schedule, schedule_costs)
    custom = custom_schedule(schedule)
    kind = None if custom is not None else get_kind(schedule)
    if custom is not None:
        custom_ranks = {a.stage: rank for rank, acts in custom.items() for a in acts}
        chunked = len(custom_ranks) > len(custom)
        split = any(a.kind is Kind.W for acts in custom.values() for a in acts)
    else:
        chunked, split = kind.chunks != 1, kind.split_backward
    assignment = assign_stages(program, chunked=chunked)
    num_stages = len(assignment.devices)
    ranks = list(dict.fromkeys(assignment.devices))  # one worker per distinct device
    stage_ranks = [ranks.index(d) for d in assignment.devices]
    if kind is not None:
        chunks = kind.chunks or max(1, num_stages // len(ranks))
        layout = kind.layout(len(ranks), chunks)
        if layout != stage_ranks:
            raise ValueError(
                f"schedule {kind.name} cannot run this program: it needs {len(layout)} stages on the "
                f"{len(ranks)} devices {ranks} in the order {[ranks[r] for r in layout]}, but the program's "
                f"guards give {num_stages} stages on {assignment.devices}"
                + ("; separate consecutive stages on one device with staticpipe.split_point()"
                   if len(layout) > num_stages else ""))
    recompute_stages = _recompute_stages(recompute, num_stages)
    stages, routes, data_vars, producers, replicated = build_sections(
        program, assignment, num_microbatches, micro_batch_size, recompute_stages, split)
    for stage, rank in zip(stages, stage_ranks):
        stage.rank = rank
    compute = custom if custom is not None else make_schedule(
        kind.name, len(ranks), num_microbatches, num_stages // len(ranks),
        check_schedule_costs(schedule, schedule_costs, num_stages))
    actions = lower(compute, routes)
    validate(actions, num_stages, num_microbatches, stage_ranks, split_backward=split,
             collectives=bool(assignment.shared) or any("all-reduce" in why for why in replicated.values()))
    return Plan(stages=stages, routes=routes, num_microbatches=num_microbatches,
                schedule=kind.name if kind is not None else "custom", actions=actions, ranks=ranks,
                data_vars=data_vars, data_specs=_data_specs(program, data_vars, num_microbatches), loss=loss_name,
                producers=producers, micro_batch_size=micro_batch_size, shared=dict(assignment.shared),
                replicated=replicated)


FORWARD_ONLY = "forward-only"  # the schedule name of evaluation plans


def build_forward_plan(program: framework.Program, num_microbatches: int = 1, chunked: bool = False,
                       micro_batch_size: int | None = None) -> Plan:
    """A forward-only plan for an evaluation program (``main.clone(for_test=True)`` taken before
    ``minimize``): the same stages as training, every rank running its forwards micro-batch by
    micro-batch. ``chunked`` must match the training plan's (several stages per device)."""
    check_microbatches(num_microbatches)
    assignment = assign_stages(program, chunked=chunked)
    if any(role != "forward" for role in assignment.role):
        raise ValueError("an evaluation program must hold forward ops only: take main_program.clone(for_test=True) "
                         "before minimize")
    ranks = list(dict.fromkeys(assignment.devices))
    stages, routes, data_vars, producers, _ = build_sections(program, assignment, num_microbatches,
                                                             micro_batch_size)
    for stage in stages:
        stage.rank = ranks.index(stage.device)
    compute = {r: [F(s.index, mb) for mb in range(num_microbatches) for s in stages if s.rank == r]
               for r in range(len(ranks))}
    return Plan(stages=stages, routes=routes, num_microbatches=num_microbatches, schedule=FORWARD_ONLY,
                actions=lower(compute, routes), ranks=ranks, data_vars=data_vars,
                data_specs=_data_specs(program, data_vars, num_microbatches), loss="", producers=producers,
                micro_batch_size=micro_batch_size)


def custom_schedule(schedule: str | Schedule) -> Schedule | None:
    """A user-written schedule (a dict, or text in ``format_schedule``'s form), or None for a name."""
    if isinstance(schedule, dict):
        return schedule
    if isinstance(schedule, str) and schedule.lstrip().startswith("rank "):
        return parse_schedule(schedule)
    return None


def check_schedule_costs(schedule: str | Schedule, schedule_costs: StageCosts | None,
                         num_stages: int | None = None) -> StageCosts | None:
    """``schedule_costs`` as the duration function ``schedule`` plans with (None: unit costs);
    ``ValueError`` naming the argument and the kind or value at fault."""
    if schedule_costs is not None and custom_schedule(schedule) is not None:
        raise ValueError("schedule_costs plans the order of a named schedule (ZB-H1, ZB-V); a custom schedule "
                         "gives its own order")
    if schedule_costs is None:
        return None
    return check_costs(get_kind(schedule), schedule_costs, num_stages, "schedule_costs")


def _recompute_stages(recompute: bool | Iterable[int], num_stages: int) -> frozenset[int]:
    if recompute is True or recompute is False:
        return frozenset(range(num_stages)) if recompute else frozenset()
    stages = frozenset(recompute)
    bad = sorted(s for s in stages if not (isinstance(s, int) and 0 <= s < num_stages))
    if bad:
        raise ValueError(f"recompute names stages {bad}, but the program has stages 0..{num_stages - 1}")
    return stages


def _data_specs(program: framework.Program, data_vars: dict, num_microbatches: int) -> dict:
    specs = {}
    for name in data_vars:
        var = program.global_block().var(name)
        shape = tuple(int(d) for d in var.shape)
        if num_microbatches > 1 and (not shape or shape[0] != -1):
            raise ValueError(f"data variable '{name}' has shape {list(shape)} with a fixed batch dimension; "
                             f"declare it with None as dim 0 so it can be split into {num_microbatches} "
                             "micro-batches")
        specs[name] = (shape, np_dtype(var))
    return specs


__all__ = ["FORWARD_ONLY", "build_plan", "build_forward_plan", "custom_schedule", "check_micro_batch_size",
           "check_schedule_costs", "assign_stages", "build_sections", "without_comm_ops", "split_at_comm_ops",
           "clear_device_tags", "MERGED_SUFFIX"]
