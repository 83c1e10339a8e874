"""``PipelineOptimizer``: the user-facing wrapper that differentiates, optimizes, then rewrites.

It adds backward and optimizer ops through the wrapped Paddle optimizer, exactly as single-device
training would, so the main program stays a valid single-device program (the reference); the pipeline
``Plan`` is built from it by pure passes and attached to the main and startup programs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ._paddle import OP_ROLE, ROLE_BACKWARD, ROLE_OPTIMIZE, framework, paddle
from .plan import Plan, attach_plan, plan_of
from .rewrite import PlanOptions, check_layout, plan_with
from .schedule.simulate import StageCosts


class PipelineOptimizer:
    """Wrap ``optimizer``; ``minimize`` splits the program into stages by its ``device_guard`` tags.

    ``num_microbatches``: micro-batches per global batch (gradients are accumulated over them).
    ``schedule``: "1F1B", "F-then-B" (aliases "FThenB", "GPipe"), "interleaved" (several chunks per
    device: guards cycling through the devices), "ZB-H1", "ZB-V" (zero bubble, backward split into B
    and W), or a custom schedule: ``{rank: [Action, ...]}`` or its text (``rank 0: 0F0 0F1 ...``).
    ``schedule_costs``: for "ZB-H1" and "ZB-V", the F, B and W durations to plan the order with, one
    per kind or a list of one per stage (``{"F": [0.031, 0.035], ...}``: ``Timeline.stage_costs()`` of a
    traced step), or a function of the action; None plans with unit costs.
    ``micro_batch_size``: fixes the batch dimension of cut variables at rewrite time; otherwise it is
    fixed by the first batch.
    ``recompute``: True (every stage) or a list of stage indices that keep only their inputs between
    forward and backward and recompute the rest (activation checkpointing).
    ``dp_degree``: data-parallel replicas of the whole pipeline, for a job of ``dp_degree`` x devices
    processes (``python -m staticpipe.launch``): replica k is processes k x devices ... (k+1) x devices - 1,
    trains on the k-th slice of every global batch, and the replicas average their accumulated gradients
    before each update, so training equals one pipeline (and one device) on the global batch.
    """

    def __init__(self, optimizer: Any, num_microbatches: int = 1, schedule: str | dict = "1F1B",
                 micro_batch_size: int | None = None, recompute: bool | list[int] = False,
                 dp_degree: int = 1, schedule_costs: StageCosts | None = None):
        if not hasattr(optimizer, "minimize"):
            raise ValueError(f"optimizer must be a paddle.optimizer.Optimizer, got {type(optimizer).__name__}")
        self.inner = optimizer
        self.options = PlanOptions(num_microbatches, schedule, micro_batch_size, recompute, schedule_costs, dp_degree)
        self.plan: Plan | None = None

    def _option(name: str) -> property:  # noqa: N805  (a property factory, used in the class body)
        """An option as an attribute; setting it checks the new options as the constructor does."""
        return property(lambda self: getattr(self.options, name),
                        lambda self, value: setattr(self, "options", replace(self.options, **{name: value})))

    num_microbatches = _option("num_microbatches")
    schedule = _option("schedule")
    micro_batch_size = _option("micro_batch_size")
    recompute = _option("recompute")
    dp_degree = _option("dp_degree")
    schedule_costs = _option("schedule_costs")
    del _option

    def minimize(self, loss: framework.Variable, startup_program: framework.Program | None = None,
                 parameters: Any = None, no_grad_set: Any = None) -> tuple[list, list]:
        program = loss.block.program
        if plan_of(program) is not None:
            raise ValueError("minimize was already called on this program: it holds a pipeline plan (and the "
                             "backward and optimizer ops of the first call); build the program again to minimize "
                             "it anew")
        if _has_role(program, ROLE_BACKWARD):
            raise ValueError("this program already holds backward ops: minimize (or append_backward) ran on it "
                             "before, and a pipeline's minimize would add a second backward; build the program "
                             "again to minimize it anew")
        check_layout(program, self.options)  # what can fail on the forward program fails before it changes
        startup = startup_program or paddle.static.default_startup_program()
        updates = _update_ops(program)
        result = self.inner.minimize(loss, startup_program=startup, parameters=parameters,
                                     no_grad_set=no_grad_set)
        if _update_ops(program) == updates:
            raise ValueError(f"the inner optimizer's minimize ({type(self.inner).__name__}) added no update ops to the "
                             "program: nothing would ever train; wrap a paddle.optimizer.Optimizer")
        self.plan = plan_with(program, loss.name, self.options)
        attach_plan(self.plan, program, startup)
        return result


def _update_ops(program: framework.Program) -> int:
    """How many optimizer-role ops ``program`` holds (Paddle tags every parameter update with it)."""
    return sum(1 for op in program.global_block().ops
               if op.has_attr(OP_ROLE) and int(op.attr(OP_ROLE)) & ROLE_OPTIMIZE)


def _has_role(program: framework.Program, role: int) -> bool:
    return any(op.has_attr(OP_ROLE) and int(op.attr(OP_ROLE)) & role for op in program.global_block().ops)
