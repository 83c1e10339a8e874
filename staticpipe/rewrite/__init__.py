"""Graph passes from a differentiated Paddle program to a pipeline ``Plan``. They execute nothing.

``build_plan`` = ``assign_stages`` (which stage runs each op) → ``build_sections`` (per-stage programs
with send/recv ops and gradient accumulation, the compute-only runs the runtime executes, the routes and
exchanges) → schedule action lists lowered with the routes.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterable

from .._paddle import framework
from ..gc_paused import gc_paused
from ..op_callstacks import fast_callstacks
from ..ir import is_pir_program, np_dtype
from ..pir_ir import Gradients
from ..pir_view import PirView
from ..plan import FORWARD_ONLY, WEIGHT, Plan
from ..schedule import Schedule, get_kind, lower, make_schedule, validate
from ..schedule.actions import F
from ..schedule.simulate import StageCosts
from .activations import as_activations
from .loss import MEAN, loss_reduction, value_reductions
from .memory import memory_model
from .options import PlanOptions
from .programs import MERGED_SUFFIX, section_runs
from .sections import build_sections
from .stages import StageAssignment, assign_stages


def build_plan(program: framework.Program, loss_name: str, num_microbatches: int = 1,
               schedule: str | Schedule = "1F1B", micro_batch_size: int | None = None,
               recompute: bool | Iterable[int] = False, schedule_costs: StageCosts | None = None,
               dp_degree: int = 1) -> Plan:
    """Split ``program`` (forward, backward and optimizer ops, tagged by ``device_guard``) into a Plan.

    ``schedule``: a schedule name, or a custom schedule (``{rank: [Action, ...]}`` or its text form,
    compute actions only), validated before it is accepted.
    ``recompute``: True for every stage, or the stage indices whose activations are recomputed.
    ``schedule_costs``: F/B/W durations (one per kind, or a list per stage) a zero-bubble schedule plans with.
    ``dp_degree``: data-parallel replicas of the whole pipeline the plan runs in.
    """
    return plan_with(program, loss_name, PlanOptions(num_microbatches, schedule, micro_batch_size, recompute,
                                                     schedule_costs, dp_degree))


@gc_paused()  # thousands of ops' section programs and a schedule of up to 10^6 actions: see gc_paused
@fast_callstacks()  # and thousands of ops appended: see op_callstacks
def plan_with(program: framework.Program, loss_name: str, options: PlanOptions) -> Plan:
    """``build_plan`` with options already checked (``PipelineOptimizer`` checks them when constructed)."""
    custom = options.custom
    kind = None if custom is not None else get_kind(options.schedule)
    split = options.layout_needs()[1]
    assignment, ranks, stage_ranks = check_layout(program, options)
    num_stages = len(assignment.devices)
    costs = options.costs(num_stages)
    m, mbs = options.num_microbatches, options.micro_batch_size
    reduction = MEAN if options.loss_reduction == MEAN else loss_reduction(program.global_block(), assignment,
                                                                          loss_name)
    # a mean's micro-batches are averaged (1/M); a sum's added, and the replicas' too (their mean x dp)
    seed = (1, m) if reduction == MEAN else (options.dp_degree, 1)
    with contextlib.nullcontext(()) if isinstance(program, PirView) else as_activations(program) as outliving:
        stages, routes, exchanges, data_vars, producers, replicated = build_sections(
            program, assignment, stage_ranks, m, mbs, options.recompute_stages(num_stages), split, seed,
            options.sharding_degree)
    compute = custom if custom is not None else make_schedule(kind.name, len(ranks), m, num_stages // len(ranks),
                                                              costs, options.latency())
    if custom is not None:  # first as written, so that an error counts the steps the user wrote
        validate(custom, num_stages, m, stage_ranks, split_backward=split, collectives=True)
    actions = _lowered(compute, routes, stage_ranks, m, split)
    return Plan(stages=tuple(stages), routes=tuple(routes), num_microbatches=m,
                schedule=kind.name if kind is not None else "custom", actions=actions, ranks=tuple(ranks),
                data_vars=data_vars, data_specs=_data_specs(program, data_vars, m), loss=loss_name,
                producers=producers, micro_batch_size=mbs, shared=dict(assignment.shared),
                replicated=replicated, exchanges=tuple(exchanges), dp_degree=options.dp_degree,
                replica_batches=options.replica_batches, outliving=tuple(outliving), loss_reduction=reduction,
                reductions=_reductions(program, assignment), memory=memory_model(stages, actions, ranks),
                sharding_degree=options.sharding_degree)


@gc_paused()
def reschedule(plan: Plan, schedule: str, compute: Schedule | None = None) -> Plan:
    """``plan`` run by another named ``schedule`` of the same stage layout and backward split (1F1B and
    F-then-B; ZB-H1 and ZB-2P; the V schedules): the same sections and routes, the schedule lowered with
    those routes, validated, and the memory model of the new action lists. What ``plan_with`` would give for
    that schedule at unit costs (a plan does not record ``schedule_costs``), without building the sections
    again (``auto_plan`` prices every schedule of a partition).
    ``compute``: the schedule's action lists when already made (``make_schedule``'s, unit costs)."""
    kind = get_kind(schedule)
    stage_ranks = [st.rank for st in plan.stages]
    num_stages, m = len(plan.stages), plan.num_microbatches
    layout = kind.layout(len(plan.ranks), kind.chunks or max(1, num_stages // len(plan.ranks)))
    split = any(WEIGHT in st.sections for st in plan.stages)
    if layout != stage_ranks or kind.split_backward != split:
        raise ValueError(f"schedule {kind.name} cannot run the sections of this {plan.schedule} plan: it needs "
                         f"stages on ranks {layout} with the backward {'split' if kind.split_backward else 'whole'}, "
                         f"the plan has them on {stage_ranks} with the backward {'split' if split else 'whole'}")
    if compute is None:
        compute = make_schedule(kind.name, len(plan.ranks), m, num_stages // len(plan.ranks))
    actions = _lowered(compute, plan.routes, stage_ranks, m, split)
    return replace(plan, schedule=kind.name, actions=actions, memory=memory_model(plan.stages, actions, plan.ranks))


def _lowered(compute: Schedule, routes: Iterable, stage_ranks: list[int], m: int, split: bool) -> dict:
    """``compute`` lowered with the plan's ``routes`` (messages, exchanges), validated; collectives: the OPT
    actions are a barrier (runtime/optimize_phase.py: a step is all or nothing)."""
    actions = lower(compute, routes)
    validate(actions, len(stage_ranks), m, stage_ranks, split_backward=split, collectives=True)
    return actions


def check_layout(program: framework.Program, options: PlanOptions) -> tuple[StageAssignment, list[str], list[int]]:
    """(stage assignment, the distinct devices as ranks, each stage's rank) of ``program`` under ``options``;
    ``ValueError`` if the schedule cannot run its stages, or options name stages it lacks. It needs the
    forward ops only, so ``PipelineOptimizer.minimize`` calls it before anything is added to the program."""
    kind = None if options.custom is not None else get_kind(options.schedule)
    assignment = assign_stages(program, chunked=options.layout_needs()[0])
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
    options.costs(num_stages)
    options.recompute_stages(num_stages)
    return assignment, ranks, stage_ranks


def build_forward_plan(program: framework.Program, num_microbatches: int = 1, chunked: bool = False,
                       micro_batch_size: int | None = None, dp_degree: int = 1,
                       replica_batches: str = "split", sharding_degree: int = 1) -> Plan:
    """A forward-only plan for an evaluation program (``main.clone(for_test=True)`` taken before
    ``minimize``): the same stages as training, every rank running its forwards micro-batch by
    micro-batch. ``chunked``, ``dp_degree``, ``replica_batches`` and ``sharding_degree`` must match the
    training plan's (launched, the last lays the processes out: ``plan.process_of``)."""
    options = PlanOptions(num_microbatches, micro_batch_size=micro_batch_size, dp_degree=dp_degree,
                          replica_batches=replica_batches)
    if is_pir_program(program):  # read through a view, which also names the values a fetch list gives
        program = PirView(program, Gradients(), None).attach()
    assignment = assign_stages(program, chunked=chunked)
    if any(role != "forward" for role in assignment.role):
        raise ValueError("an evaluation program must hold forward ops only: take main_program.clone(for_test=True) "
                         "before minimize")
    ranks = list(dict.fromkeys(assignment.devices))
    stage_ranks = [ranks.index(d) for d in assignment.devices]
    stages, routes, _, data_vars, producers, _ = build_sections(program, assignment, stage_ranks,
                                                                num_microbatches, micro_batch_size)
    compute = {r: [F(s.index, mb) for mb in range(num_microbatches) for s in stages if s.rank == r]
               for r in range(len(ranks))}
    return Plan(stages=tuple(stages), routes=tuple(routes), num_microbatches=num_microbatches, schedule=FORWARD_ONLY,
                actions=lower(compute, routes), ranks=tuple(ranks), data_vars=data_vars,
                data_specs=_data_specs(program, data_vars, num_microbatches), loss="", producers=producers,
                micro_batch_size=micro_batch_size, dp_degree=options.dp_degree, replica_batches=replica_batches,
                reductions=_reductions(program, assignment), sharding_degree=sharding_degree)


def _reductions(program: framework.Program, assignment: StageAssignment) -> dict[str, str]:
    """``loss.value_reductions`` of the program; batched: declared with -1 (the batch) as dim 0."""
    block = program.global_block()

    def batched(name: str) -> bool:
        shape = list(program.var(name).shape if isinstance(program, PirView) else block._var_recursive(name).shape)
        return bool(shape) and shape[0] == -1
    return value_reductions(block, assignment, batched)


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


__all__ = ["PlanOptions", "build_plan", "plan_with", "reschedule", "check_layout", "build_forward_plan", "assign_stages", "build_sections",
           "section_runs", "MERGED_SUFFIX"]
