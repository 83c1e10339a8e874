"""``staticpipe.verify``: the equivalence oracle a user runs before a long training job.

Why: a pipeline is only worth its speed if it computes what the single-device program computes. The
rewrite leaves the main program a valid single-device program, so the oracle trains both from the same
state on the same batches and reports, per parameter and per step, how far they drift; it also checks
that the plan placed every op and parameter of the program exactly once (or replicated it on purpose).
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any

from ._paddle import framework, np, paddle
from .ir import as_float, fetch_target, free_scope, program_view
from .plan import Plan, require_plan
from .executor import Executor


@dataclass
class PlacementCheck:
    ops: int = 0  # ops of the program
    placed_once: int = 0
    replicated: dict[int, str] = field(default_factory=dict)  # op -> why several stages run it
    missing: list[str] = field(default_factory=list)  # ops no stage runs
    duplicated: list[str] = field(default_factory=list)  # ops run by several stages without a reason
    parameters: int = 0
    unowned: list[str] = field(default_factory=list)  # parameters no stage owns
    multiply_owned: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unowned or self.multiply_owned)


@dataclass
class VerifyReport:
    steps: int
    rtol: float
    atol: float
    pipeline_losses: list[float]
    reference_losses: list[float]
    max_diff: dict[str, list[float]]  # parameter or state -> per step, largest |pipeline - reference|
    placement: PlacementCheck
    bounds: dict[str, float] = field(default_factory=dict, repr=False)  # name -> atol + rtol * |reference|

    def mismatches(self) -> list[str]:
        """State whose difference exceeds ``atol + rtol * |reference|`` after the last step."""
        return [name for name, diffs in self.max_diff.items() if diffs and diffs[-1] > self.bounds[name]]

    @property
    def ok(self) -> bool:
        losses_ok = np.allclose(self.pipeline_losses, self.reference_losses, rtol=self.rtol, atol=self.atol)
        return self.placement.ok and losses_ok and not self.mismatches()

    def __str__(self) -> str:
        pc = self.placement
        lines = [f"staticpipe.verify: {'OK' if self.ok else 'MISMATCH'} after {self.steps} steps "
                 f"(rtol {self.rtol:g}, atol {self.atol:g})",
                 f"  placement: {pc.ops} ops, {pc.placed_once} on exactly one stage, {len(pc.replicated)} "
                 f"replicated on purpose, missing {pc.missing or 'none'}, duplicated {pc.duplicated or 'none'}; "
                 f"{pc.parameters} parameters, unowned {pc.unowned or 'none'}, owned twice "
                 f"{pc.multiply_owned or 'none'}",
                 "  step  pipeline loss  reference loss  largest state difference"]
        for k in range(self.steps):
            worst = max(((d[k], n) for n, d in self.max_diff.items()), default=(0.0, "-"))
            lines.append(f"  {k:4d}  {self.pipeline_losses[k]:13.6g}  {self.reference_losses[k]:14.6g}  "
                         f"{worst[0]:.3g} ({worst[1]})")
        bad = self.mismatches()
        if bad:
            lines.append(f"  beyond tolerance after the last step: {', '.join(bad)}")
        return "\n".join(lines)


def check_placement(program: framework.Program, plan: Plan) -> PlacementCheck:
    """Every op of ``program`` runs on exactly one stage unless the plan replicates it on purpose, and
    every parameter has exactly one owner."""
    block = program_view(program).global_block()
    runs: dict[int, int] = {}
    for stage in plan.stages:
        for section in stage.sections.values():
            for i in section.source_ops:
                runs[i] = runs.get(i, 0) + 1
    # PIR declares a scheduled learning rate a parameter (``builtin.parameter``): it is the optimizer's, as on
    # the legacy IR, and no stage owns it
    params = [p for p in block.all_parameters() if p.name != getattr(program, "lr_name", None)]
    check = PlacementCheck(ops=len(block.ops), parameters=len(params))
    for i, op in enumerate(block.ops):
        label = f"#{i} {op.type}"
        count = runs.get(i, 0)
        if i in plan.replicated:
            check.replicated[i] = plan.replicated[i]
        elif count == 0:
            check.missing.append(label)
        elif count == 1:
            check.placed_once += 1
        else:
            check.duplicated.append(label)
    for param in params:
        owners = [s.index for s in plan.stages if param.name in s.parameters]
        if not owners and any(param.name in op.input_arg_names for op in block.ops):
            check.unowned.append(param.name)
        elif len(owners) > 1:
            check.multiply_owned.append(param.name)
    return check


def verify(program: framework.Program, loader: Any, startup_program: framework.Program, steps: int = 3,
           executor: Executor | None = None, rtol: float = 1e-5, atol: float = 1e-6) -> VerifyReport:
    """Train ``program`` pipelined and unsplit for ``steps`` batches from the same state; report how far
    they drift and whether the plan placed everything.

    ``loader``: a ``staticpipe.io.DataLoader`` (started, if non-iterable), whose batches are micro-batches
    (a step takes ``num_microbatches`` of them, as in training), or a list of feed dicts, each a global
    batch.
    The initial state is ``startup_program``'s, or ``executor``'s current state when given (that
    executor is not changed). A learning-rate scheduler is used at its current value in both runs,
    advanced per step, and restored afterwards.

    Adam-family optimizers divide by sqrt(v) + eps: a coordinate whose true gradient is zero (a key
    projection's bias, say) gets rounding noise of the size of eps, which both runs turn into different
    updates of up to the learning rate. Such coordinates show up as mismatches that are not bugs.
    """
    plan = require_plan(program, "verify")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if executor is not None and not isinstance(executor, Executor):
        raise ValueError(f"executor must be a staticpipe.Executor holding the state to start from (or None: the "
                         f"startup program's), got {type(executor).__name__}: {executor!r}")
    if hasattr(loader, "epoch"):
        m = plan.num_microbatches
        micro = list(itertools.islice(loader.epoch(), steps * m))
        batches = [{n: np.concatenate([mb[n] for mb in micro[k:k + m]]) for n in micro[0]}
                   for k in range(0, len(micro) - m + 1, m)]
    else:
        batches = list(itertools.islice(iter(loader), steps))
    if len(batches) < steps:
        raise ValueError(f"the loader gave batches for {len(batches)} step(s); verify was asked for {steps} steps")
    pipe = Executor()
    pipe.run(startup_program)
    if executor is not None:
        pipe.set_state_dict(program, executor.state_dict(program))
    initial = pipe.state_dict(program)
    ref, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    for name, value in initial.items():
        scope.var(name).get_tensor().set(value, paddle.CPUPlace())
    scheduler = getattr(program, "lr_scheduler", None)
    saved = scheduler.state_dict() if scheduler is not None else None
    losses_p, losses_r, diffs, bounds = [], [], {name: [] for name in initial}, {}

    def number(name: str, value: Any) -> np.ndarray:  # bfloat16 comes as bit patterns: compare numbers
        return as_float(value, program_view(program).global_block()._var_recursive(name).dtype)

    try:
        for batch in batches:
            losses_p.append(float(np.mean(number(plan.loss, pipe.run(program, feed=batch, fetch_list=[plan.loss])[0]))))
            with paddle.static.scope_guard(scope):  # PIR's executor sets a scheduled learning rate in the global scope
                single = ref.run(program, feed=batch, fetch_list=[fetch_target(program, plan.loss)])
            losses_r.append(float(np.mean(number(plan.loss, single[0]))))
            state = pipe.state_dict(program)
            for name in diffs:
                r = number(name, np.array(scope.find_var(name).get_tensor())).astype(np.float64)
                diffs[name].append(float(np.max(np.abs(number(name, state[name]) - r))) if r.size else 0.0)
                bounds[name] = atol + rtol * (float(np.max(np.abs(r))) if r.size else 0.0)
            if scheduler is not None:
                scheduler.step()
    finally:
        if scheduler is not None:
            with warnings.catch_warnings():  # nested schedulers (LinearWarmup) warn about their own keys
                warnings.simplefilter("ignore")
                scheduler.set_state_dict(saved)
        pipe.close()
        free_scope(scope)
    return VerifyReport(steps, rtol, atol, losses_p, losses_r, diffs, check_placement(program, plan), bounds)
