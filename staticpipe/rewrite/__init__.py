"""Graph passes from a differentiated Paddle program to a pipeline ``Plan``. They execute nothing.

``build_plan`` = ``assign_stages`` (which stage runs each op) → ``build_sections`` (per-stage programs
with send/recv ops and gradient accumulation) → schedule action lists lowered with the routes.
"""
from __future__ import annotations

from typing import Iterable

from .._paddle import framework
from ..plan import Plan
from ..schedule import canonical_name, check_microbatches, lower, make_schedule
from .programs import clear_device_tags, np_dtype, split_at_comm_ops, without_comm_ops
from .sections import MERGED_SUFFIX, build_sections
from .stages import assign_stages


def check_micro_batch_size(micro_batch_size: object) -> None:
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size!r}")


def build_plan(program: framework.Program, loss_name: str, num_microbatches: int = 1,
               schedule: str = "1F1B", micro_batch_size: int | None = None,
               recompute: bool | Iterable[int] = False) -> Plan:
    """Split ``program`` (forward, backward and optimizer ops, tagged by ``device_guard``) into a Plan.

    ``recompute``: True for every stage, or the stage indices whose activations are recomputed.
    """
    check_microbatches(num_microbatches)
    schedule = canonical_name(schedule)
    check_micro_batch_size(micro_batch_size)
    assignment = assign_stages(program)
    num_stages = len(assignment.devices)
    if recompute is True or recompute is False:
        recompute_stages = frozenset(range(num_stages)) if recompute else frozenset()
    else:
        recompute_stages = frozenset(recompute)
        bad = sorted(s for s in recompute_stages if not (isinstance(s, int) and 0 <= s < num_stages))
        if bad:
            raise ValueError(f"recompute names stages {bad}, but the program has stages 0..{num_stages - 1}")
    stages, routes, data_vars, producers, replicated = build_sections(program, assignment, num_microbatches, micro_batch_size,
                                                          recompute_stages)
    block = program.global_block()
    data_specs = {}
    for name in data_vars:
        var = block.var(name)
        shape = tuple(int(d) for d in var.shape)
        if num_microbatches > 1 and (not shape or shape[0] != -1):
            raise ValueError(f"data variable '{name}' has shape {list(shape)} with a fixed batch dimension; "
                             f"declare it with None as dim 0 so it can be split into {num_microbatches} "
                             "micro-batches")
        data_specs[name] = (shape, np_dtype(var))
    actions = lower(make_schedule(schedule, len(stages), num_microbatches), routes)
    return Plan(stages=stages, routes=routes, num_microbatches=num_microbatches, schedule=schedule,
                actions=actions, data_vars=data_vars, data_specs=data_specs, loss=loss_name, producers=producers,
                micro_batch_size=micro_batch_size, shared=dict(assignment.shared), replicated=replicated)


__all__ = ["build_plan", "check_micro_batch_size", "assign_stages", "build_sections", "without_comm_ops", "split_at_comm_ops", "clear_device_tags", "MERGED_SUFFIX"]
