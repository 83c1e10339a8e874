"""Timelines of executed steps: what every rank did when, exported for people to look at.

The runtime records ``(action, start, end, CPU seconds)`` for every action while tracing is on (one list
append per action; nothing at all when off). A ``Timeline`` turns one step's records into busy time, the
measured bubble, a Chrome trace (chrome://tracing, Perfetto), a PNG Gantt chart drawn beside the
simulator's prediction for the same measured action times, and what each action costs alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .._paddle import core
from ..placement import place_of
from ..plan import Plan
from ..schedule import Action, Kind, simulate
from ..schedule.simulate import PLANNED_KINDS

COMPUTE = (Kind.F, Kind.B, Kind.W, Kind.OPT, Kind.FB)


@dataclass
class Timeline:
    plan: Plan
    events: list[tuple[int, Action, float, float]]  # (rank, action, start, end), seconds from step start
    cpu: dict[Action, float] = field(default_factory=dict)  # action -> its rank's CPU seconds, upkeep included

    @classmethod
    def from_records(cls, plan: Plan, records: list[tuple[Action, float, float, float]]) -> "Timeline":
        if not records:
            raise ValueError("no actions were recorded: create the Executor with trace=True and run a step")
        t0 = min(start for _, start, _, _ in records)
        rank_of = {s.index: s.rank for s in plan.stages}
        return cls(plan, sorted(((rank_of[a.stage], a, start - t0, end - t0) for a, start, end, _ in records),
                                key=lambda e: (e[0], e[2])), {a: cpu for a, _, _, cpu in records})

    @property
    def total(self) -> float:
        return max(end for *_, end in self.events)

    def busy(self) -> dict[int, float]:
        """Seconds each rank spent in compute actions (F, B, W, OPT, and paired FB)."""
        busy = {r: 0.0 for r in range(len(self.plan.ranks))}
        for rank, a, start, end in self.events:
            if a.kind in COMPUTE:
                busy[rank] += end - start
        return busy

    def bubble(self) -> float:
        """Fraction of rank-time not spent computing: 1 - sum(busy) / (ranks x step time)."""
        return 1.0 - sum(self.busy().values()) / (len(self.plan.ranks) * self.total)

    def predicted(self):
        """The simulator's timeline for this plan with each action costing what it cost here: the
        schedule's own bound, which the runtime's overhead is measured against."""
        cost = {a: end - start for _, a, start, end in self.events}
        return simulate(self.plan.actions, costs=lambda a: cost.get(a, 0.0) if a.kind in COMPUTE else 0.0)

    def action_costs(self) -> dict[Action, float]:
        """What each action would have cost alone, for the simulator to price other schedules with
        (``auto_plan``). On a CPU device, the CPU seconds its rank spent from the end of the action
        before to the end of this one and its upkeep (freeing a micro-batch's scope after its last
        action), less what other ranks of its thread spent meanwhile, where the wall time also counts the
        waits for a core shared with other stage threads and a RECV's wait for its message. On a CUDA
        device, a compute action's wall time (the worker waits for the kernels; the thread may spin or
        sleep meanwhile) and, for messages and OPT (whose first waits for every rank), CPU seconds."""
        cuda = {r for r, device in enumerate(self.plan.ranks) if isinstance(place_of(device), core.CUDAPlace)}
        return {a: end - start if rank in cuda and a.kind in COMPUTE and a.kind is not Kind.OPT else self.cpu[a]
                for rank, a, start, end in self.events}

    def stage_costs(self) -> dict[str, list[float]]:
        """Mean seconds of each stage's F, B and W actions in this step: ``{"F": [stage 0, stage 1, ...],
        "B": [...], "W": [...]}`` (no "W" unless the backward was split), the ``schedule_costs`` a
        zero-bubble schedule plans with. Take them from a split-backward step (ZB-H1, ZB-V): a 1F1B
        step's B is the whole backward, which a zero-bubble plan would misprice as its B alone."""
        times: dict[Kind, list[list[float]]] = {}
        for _, a, start, end in self.events:
            if a.kind in PLANNED_KINDS:
                times.setdefault(a.kind, [[] for _ in self.plan.stages])[a.stage].append(end - start)
        return {k.value: [sum(t) / len(t) for t in times[k]] for k in PLANNED_KINDS if k in times}

    def to_chrome(self, path: str) -> None:
        """Chrome trace JSON: one thread per rank, one complete event per action."""
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                   "args": {"name": f"rank {r} ({d})"}} for r, d in enumerate(self.plan.ranks)]
        events += [{"name": str(a), "cat": a.kind.value, "ph": "X", "pid": 0, "tid": rank,
                    "ts": start * 1e6, "dur": (end - start) * 1e6,
                    "args": {"stage": a.stage, "microbatch": a.microbatch}}
                   for rank, a, start, end in self.events]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def to_png(self, path: str) -> None:
        """Gantt chart of the measured step above the simulator's prediction."""
        from ..schedule.gantt import draw_gantt
        draw_gantt({"measured": self.events, "simulated from measured action times": self.predicted()}, path)

    def summary(self) -> str:
        busy = ", ".join(f"rank {r}: {b:.3f} s" for r, b in self.busy().items())
        return (f"step {self.total:.3f} s, bubble {self.bubble():.3f}, schedule bound "
                f"{self.predicted().total:.3f} s; busy {busy}")
