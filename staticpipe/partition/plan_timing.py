"""``time_plans``: what built plans' actions cost when the runtime runs them, for ``auto_plan``.

Why time the built plans and not only add up the op profile: a section costs more than its ops timed one
by one (measured on the GPT of ``bench/planner.py``, CPU: a stage's forward 1.45x, its backward 1.35x the
sum of its profiled ops: the gradient-merge and loss-scale ops the rewrite adds, the runtime's per-action
work, values no longer in cache), the messages and the optimizer cost something, and a recomputed stage's
backward is exactly what it is. Each plan runs a few steps on the micro-batch given to ``auto_plan``
(repeated for every micro-batch), with parameters from the startup program in the executor's own scopes,
so nothing of the caller's state is touched. Each action's cost is ``Timeline.action_costs`` (CPU
seconds on CPU devices, so the waits for a shared core are not counted), the median over the steps.

Why two passes, the second in reverse order: a shared machine's speed drifts (measured here: the same
plan 20 % slower a minute later), and plans timed one after the other would be ranked by when they ran.
Timed first to last and then last to first, a steady drift weighs on every plan alike; one plan at a
time, so the device holds one plan's state, not all of them.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

from .._paddle import framework, np
from ..executor import Executor
from ..plan import Plan, attach_plan
from ..schedule import Action


@dataclass(frozen=True)
class PlanTiming:
    costs: dict[Action, float]  # action -> seconds it costs alone, the median over the steps
    step_s: float  # the measured step, median


def time_plans(plans: Sequence[tuple[framework.Program, framework.Program, Plan]], batch: dict[str, np.ndarray],
               steps: int) -> list[PlanTiming]:
    """Time each ``(main, startup, plan)`` for ``steps`` traced steps per pass (module docstring) on
    ``batch`` as every micro-batch."""
    walls: list[list[float]] = [[] for _ in plans]
    costs: list[list[dict[Action, float]]] = [[] for _ in plans]
    for order in (range(len(plans)), reversed(range(len(plans)))):
        for i in order:
            _time(*plans[i], batch, steps, walls[i], costs[i])
    return [PlanTiming({a: statistics.median(c[a] for c in cs) for a in cs[0]}, statistics.median(ws))
            for ws, cs in zip(walls, costs)]


def _time(main: framework.Program, startup: framework.Program, plan: Plan, batch: dict[str, np.ndarray],
          steps: int, walls: list[float], costs: list[dict[Action, float]]) -> None:
    """One pass over one plan: a fresh executor, one untimed step (it builds the runtime's prepared
    programs), then ``steps`` traced ones."""
    attach_plan(plan, main, startup)  # the plans of one partition share their programs
    exe = Executor(trace=True)
    try:
        exe.run(startup)
        microbatches = [batch] * plan.num_microbatches
        exe.step(main, microbatches)
        for _ in range(steps):
            start = time.perf_counter()
            exe.step(main, microbatches)
            walls.append(time.perf_counter() - start)
            costs.append(exe.timeline(main).action_costs())
    finally:
        exe.close()
