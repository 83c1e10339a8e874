"""What one step hands each rank's worker: its action list worked out once per plan (``RankProgram``), the
step's data, fetches and channel (``StepJob``), and what the worker hands back (``StepResult``).

A module of its own so that the step machinery and everything a worker calls (the optimize phase) read
these without importing the worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .._paddle import core, np
from ..ir import declared, is_pir_program
from ..plan import BACKWARD, FORWARD, OPTIMIZE, WEIGHT, Plan
from ..schedule import Action, Kind
from .channel import Channel


@dataclass(frozen=True, eq=False)
class RankProgram:
    """What a rank's action list needs besides the actions, worked out once per plan: after which action
    each micro-batch's scope can go, which OPT actions run together (the first of them waits for every
    rank: ``optimize_phase``), and what a micro-batch leaves in a stage's scope."""

    actions: tuple[Action, ...]
    last_use: dict[int, tuple[tuple[int, int], ...]]  # action position -> (stage, micro-batch) scopes to release
    optimizer_groups: dict[int, tuple[int, ...]]  # first stage of a run of OPT actions -> its stages
    leftovers: dict[int, "Leftovers"]  # stage -> what a micro-batch leaves in its scope
    optimize_leftovers: dict[int, "Leftovers"]  # stage -> what its optimize section leaves in its scope
    first_optimizer: int | None = None  # the first stage of the rank's first run of OPT actions
    # per action, what the worker's loop would otherwise work out every step: (action, the (stage, micro-batch)
    # of its scope (None: OPT and FB, which have none or two), the scopes released after it (``last_use``))
    steps: tuple[tuple[Action, tuple[int, int] | None, tuple[tuple[int, int], ...]], ...] = ()

    @classmethod
    def of(cls, plan: Plan, rank: int) -> "RankProgram":
        actions = tuple(plan.actions[rank])
        last = {(h.stage, h.microbatch): i for i, a in enumerate(actions) for h in a.halves()
                if h.microbatch is not None}
        released: dict[int, tuple[tuple[int, int], ...]] = {}
        for key, i in last.items():
            released[i] = released.get(i, ()) + (key,)
        groups: dict[int, tuple[int, ...]] = {}
        run: list[int] = []
        for a in actions + (None,):
            if a is not None and a.kind is Kind.OPT:
                run.append(a.stage)
            elif run:
                groups[run[0]] = tuple(run)
                run = []
        leftovers = {}
        for stage in {a.stage for a in actions}:
            sections = plan.stages[stage].sections
            names = set(sections[FORWARD].feeds)
            for kind in (FORWARD, BACKWARD, WEIGHT):
                names.update(sections[kind].keep if kind in sections else ())
            names.update(v.name for r in plan.routes if r.dst.stage == stage for v in r.vars)
            leftovers[stage] = Leftovers.of(names, [sections[k].run.program for k in (FORWARD, BACKWARD, WEIGHT)
                                                    if k in sections])
        optimize_leftovers = {a.stage: Leftovers.of({name for p in plan.stages[a.stage].sections[OPTIMIZE].programs
                                                     for name, persistable in declared(p) if not persistable},
                                                    plan.stages[a.stage].sections[OPTIMIZE].programs)
                              for a in actions if a.kind is Kind.OPT}
        first = next((a.stage for a in actions if a.kind is Kind.OPT), None)
        steps = tuple((a, None if a.kind in (Kind.OPT, Kind.FB) else (a.stage, a.microbatch), released.get(i, ()))
                      for i, a in enumerate(actions))
        return cls(actions, released, groups, leftovers, optimize_leftovers, first, steps)


@dataclass(frozen=True)
class Leftovers:
    """What a micro-batch (or an optimize section) leaves in a borrowed scope, to let go of before the scope
    serves another: ``tensors`` are emptied (their memory freed, each variable kept), ``others`` erased.

    Why not erase them all: Paddle's legacy executor re-creates an erased variable on the scope's next run,
    and a variable it finds there costs it less: emptying instead took 2-8 µs off each action of a narrow MLP
    on M4 (``bench/overhead.py``'s pipelines, the two interleaved in one process). An emptied tensor holds
    no memory, as an erased variable does not, and a run that read it before writing it fails as it would
    on the erased one. Only what a legacy section program declares a dense tensor is emptied; everything
    else (PIR sections' values, tensor arrays, selected rows) is erased, as before."""

    tensors: tuple[str, ...] = ()
    others: tuple[str, ...] = ()

    @classmethod
    def of(cls, names: set[str], programs: list) -> "Leftovers":
        dense = {v.name for p in programs if p is not None and not is_pir_program(p) for v in p.list_vars()
                 if v.type == core.VarDesc.VarType.LOD_TENSOR}
        return cls(tuple(sorted(names & dense)), tuple(sorted(names - dense)))

    def let_go(self, scope: core._Scope) -> None:
        for name in self.tensors:  # scope.var: this scope's own (find_var would look in its parents too)
            scope.var(name).get_tensor()._clear()
        if self.others:
            scope.erase(self.others)


@dataclass
class StepJob:
    plan: Plan
    program: RankProgram
    feeds: dict[int, list[dict[str, np.ndarray]]]  # stage -> per micro-batch data
    fetch: dict[tuple[int, str], tuple[str, ...]]  # (stage, section kind) -> names to fetch per micro-batch
    channel: Channel
    places: dict[int, core.Place]  # stage -> place (generic) of the receiver of its sends
    micro_batch_size: int | None  # None: any (evaluation)
    shapes: list[tuple]  # micro-batch -> the shapes of its data (what the kept activations' sizes follow)
    record: Callable[[Action, float, float, float], None] | None = None  # (action, start, end, thread CPU s)
    check_forwards: bool = False  # check each forward's outputs for NaN/Inf here (errors.check_finite_values)


@dataclass
class StepResult:
    fetched: dict[str, list[np.ndarray]] = field(default_factory=dict)
