"""``auto_plan``: partition, schedule and per-stage recompute chosen together under per-device memory caps.

Why together: the three trade the same two things. A schedule that holds fewer micro-batches in flight
(V-Min, 1F1B) or recompute on a stage frees activation memory and costs time; a partition that moves
layers shifts both. Choosing one at a time misses the fast plan that fits (ZB-V with recompute nowhere
against 1F1B with recompute everywhere). So the planner profiles once and scores every combination.

How, running at most the plans it builds:

- time: the plan's simulated step (``schedule.simulate``, its lowered actions with their messages, the
  first OPT of each rank waiting for all). Given a micro-batch, each built plan is run for a few traced
  steps and every action priced at what it cost alone (``plan_timing.py``); otherwise at the stage's
  profiled op times. CPU devices are threads sharing this machine's cores, simulated so
  (``schedule/shared_cores.py``). What the simulator still leaves out (thread hand-offs, the
  scheduler's switches) is one figure, simulated / measured step of the timed plans (median), which
  every prediction is divided by;
- memory: the plan's own memory model (``memory_model.py``), exact to what the runtime holds between a
  forward and its backward. Building a plan costs Paddle's minimize and a rewrite, so each partition is
  minimized once and planned twice (no stage recomputed, every stage recomputed), and every schedule
  that runs the same sections is lowered onto those plans (``rewrite.reschedule``); a stage's figures
  (bytes and action times) depend only on its own ops and whether it recomputes, so any subset of
  recomputed stages is priced from those two and the schedule's in-flight counts: every subset up to six
  stages, beyond that the ones ``recompute_subsets.py`` picks.

Partitions: per layout (one stage per device; two per device for the interleaved and V schedules), the
time-balanced cut of ``auto_place`` and, under a cap and with one stage per device, its memory-capped cut.
The fastest combination whose every device fits its cap wins (ties: fewer recomputed stages, then the
schedule's registry order); the report lists the runners-up and why each lost.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from .._paddle import core, framework, np, paddle
from ..io import DataLoader
from ..ir import program_view
from ..pir_ir import is_pir_program, is_pir_value
from ..memory_model import DeviceMemory, MemoryModel, StageMemory, human_bytes, parse_bytes
from ..optimizer import PipelineOptimizer
from ..placement import clone_with_split_points, place_of
from ..plan import Plan
from ..rewrite import plan_with, reschedule
from ..schedule import KINDS, Action, Kind, make_schedule, simulate
from ..schedule.latency import Comm, link_latency
from .auto_place import Placement, auto_place
from .costs import Profile
from . import recompute_subsets as subsets
from .plan_report import Candidate, PlanReport
from .pir_profile import pir_twin
from .plan_timing import time_plans
from .profile import first_batch, refuse_measuring_in_launched_job
from .profile import profile as run_profile


def auto_plan(program: framework.Program, loss: Any, optimizer: Callable[[], Any], devices: Sequence[str],
              num_microbatches: int, memory_limit: float | Mapping[str, float] | Sequence[float] | None = None,
              feed: dict | DataLoader | None = None, profile: Profile | None = None,
              startup: framework.Program | None = None, schedules: Sequence[str] | None = None,
              recompute: bool | str = True, time_steps: int = 3, comm: Comm = None) -> PlanReport:
    """Choose a partition of ``program`` (a forward program without guards, as for ``auto_place``) over
    ``devices``, a schedule and the stages to recompute, for the fastest predicted step whose every device
    stays under ``memory_limit`` (bytes: one number, one per device, or ``{device: bytes}``; None: no cap),
    then apply it: tag the ops and ``PipelineOptimizer(optimizer(), ...).minimize(loss)``. On either IR (a PIR
    program's ``loss`` is its value).

    ``optimizer``: a function making the inner optimizer (each priced plan needs its own). ``feed``: one
    micro-batch (or a loader, whose first batch is used): the op profile is taken on it (unless
    ``profile`` is given, taken at the same micro-batch size) and every built plan is timed on it for
    ``time_steps`` traced steps (0: price time from the op profile alone, as without ``feed``).
    ``schedules``: the schedule names to consider (default: every registered one). ``recompute``: True
    prices the sets of recomputed stages that can win (every subset up to six stages; see
    ``recompute_subsets.py``), "whole" none or all of them, False none. ``comm``: the latency of a message
    between two devices (seconds, ``{(source rank, destination rank): seconds}`` by the devices' positions,
    or a function of the two): the schedules that plan by costs plan with it, and every plan is priced
    with it (``schedule/latency.py``); None: messages are free. ``ValueError``
    saying by how much the best plan misses, per device, when none fits.
    """
    if recompute not in (True, False, "whole"):
        raise ValueError(f"recompute must be True (every subset of stages), \"whole\" (none or all) or False; got {recompute!r}")
    if not isinstance(time_steps, int) or isinstance(time_steps, bool) or time_steps < 0:
        raise ValueError(f"time_steps must be an integer >= 0, got {time_steps!r}")
    if is_pir_program(program) and not is_pir_value(loss):
        raise ValueError(f"auto_plan of a PIR program takes the loss as its value (PIR values have no names of their "
                         f"own to find it by), got {type(loss).__name__}: {loss!r}")
    devices = list(devices)
    caps = _caps(memory_limit, devices)
    link_latency(comm)  # checked before anything is measured
    if profile is None or (feed is not None and time_steps):
        refuse_measuring_in_launched_job("auto_plan(feed=...)" if profile is not None else "auto_plan without profile=")
    batch = first_batch(feed) if feed is not None else None
    if profile is None:
        if batch is None:
            raise ValueError("auto_plan needs measured times: pass feed= (one micro-batch, or a loader) or profile=")
        profile = run_profile(program, batch, startup=startup, loss=loss)
    mbs = profile.batch_size
    if batch is not None:
        rows = {name: len(value) for name, value in batch.items() if np.ndim(value)}
        if any(n != mbs for n in rows.values()):
            raise ValueError(f"feed has batches of {rows}, but the profile was taken at micro-batch {mbs}: give "
                             "one micro-batch of the size the profile was taken at")
    builds, skipped, placements, partitions = [], {}, {}, {}
    for name in schedules or list(KINDS):
        kind = KINDS[name] if name in KINDS else None
        if kind is None:
            raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(KINDS)}")
        chunks = kind.chunks or 2
        try:
            compute = make_schedule(kind.name, len(devices), num_microbatches, chunks, comm=_comm(kind, comm))
        except ValueError as exc:
            skipped[kind.name] = str(exc)
            continue
        layout = [devices[r] for r in kind.layout(len(devices), chunks)]
        for policy in ("time",) + (("memory",) if any(c is not None for c in caps.values()) and chunks == 1 else ()):
            placed = _placed(program, loss, profile, layout, policy, kind, num_microbatches, caps, placements)
            if placed is None:
                continue
            rc = bool(recompute) and not kind.split_backward
            builds.append((kind, _built(placed, optimizer, startup, profile.batch_size, kind, compute,
                                        num_microbatches, rc, caps, partitions, batch is not None and time_steps > 0,
                                        comm)))
    if not builds:
        raise ValueError("auto_plan: no schedule can run this program: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    if batch is not None and time_steps:
        builds = _timed(builds, batch, time_steps)
    efficiency = _efficiency([b for _, b in builds])
    candidates = [c for kind, b in builds
                  for c in _priced(kind, b, mbs, caps, recompute == "whole", efficiency)]
    order = list(KINDS)
    candidates.sort(key=lambda c: (not c.fits, c.step_s if c.fits else sum(c.over.values()), len(c.recompute),
                                   order.index(c.schedule)))
    best = candidates[0]
    if not best.fits:
        rc = ", ".join(map(str, best.recompute)) or "none"
        raise ValueError(f"auto_plan: no plan fits the memory caps; the closest ({best.schedule}, {best.policy} cut, "
                         f"recompute {rc}) misses " + ", ".join(f"{d} by {b} bytes ({human_bytes(b)})"
                                                                for d, b in best.over.items()))
    _apply(program, loss, optimizer, startup, profile, best, num_microbatches, _cut_cap(caps),
           _comm(KINDS[best.schedule], comm))
    timed = sum(len(b.measured) for _, b in builds)
    return PlanReport(best, tuple(candidates), skipped, caps, mbs, efficiency, timed)


@dataclass(frozen=True)
class _Built:
    placement: Placement
    devices: tuple[str, ...]
    policy: str
    stages: Mapping[bool, tuple[StageMemory, ...]]  # recomputed or not -> each stage's figures
    costs: Mapping[bool, Mapping[Action, float]]  # recomputed or not -> what each action costs
    programs: Mapping[bool, tuple[framework.Program, framework.Program, Plan]]  # recomputed or not -> built plan
    measured: Mapping[bool, float] = field(default_factory=dict)  # recomputed or not -> measured step (if timed)
    comm: Comm = None  # the message latency every plan is priced with

    # what recompute leaves alone, read from the plan without it
    ranks = property(lambda self: self.programs[False][2].ranks)
    stage_ranks = property(lambda self: tuple(s.rank for s in self.programs[False][2].stages))
    actions = property(lambda self: self.programs[False][2].actions, doc="the lowered actions, messages included")


def _placed(program, loss, profile, layout, policy, kind, m, caps, placements: dict) -> tuple | None:
    """(placement, the program tagged by it, the loss in that program) of ``policy``'s cut over ``layout``;
    None: it cannot cut it. Made once per layout and policy (``placements``): the time cut does not depend
    on the schedule; the memory cut does, through its in-flight counts."""
    where = (tuple(layout), policy, kind.name if policy == "memory" else None)
    if where not in placements:
        pir = is_pir_value(loss)  # a PIR program's clone has values of its own: its loss is another value
        tagged, tagged_loss = pir_twin(program, loss) if pir else (clone_with_split_points(program), loss)
        try:
            placements[where] = (auto_place(tagged, devices=list(layout), policy=policy, profile=profile,
                                            schedule=kind.name, num_microbatches=m, memory_limit=_cut_cap(caps)),
                                 tagged, tagged_loss)
        except ValueError:
            placements[where] = None
    return placements[where]


def _built(placed, optimizer, startup, mbs: int, kind, compute, m: int, recompute: bool, caps,
           partitions: dict, timed: bool, comm: Comm = None) -> _Built:
    """The plans of ``kind`` over the ``placed`` partition, their actions priced from the op profile.

    Shared through ``partitions``: Paddle's minimize once per partition (the backward and optimizer ops are
    the same for every schedule and recompute choice), its sections planned once per backward split and
    recompute choice, and every other schedule that runs those sections lowered onto them
    (``rewrite.reschedule``). The every-stage-recomputed plan is built when it can matter: up to
    ``EXHAUSTIVE_UP_TO`` stages, when plans are timed, or when the plan without recompute misses a cap."""
    placement, tagged, loss = placed
    layout = tuple(s.device for s in placement.stages)
    base = (layout, tuple(placement.bounds))
    if base not in partitions:
        partitions[base] = _minimized(tagged, loss, optimizer, startup, mbs, kind, m)  # the placement's only build
    main, start, loss_name, options, plans = partitions[base]
    programs = {}
    for rc in (False, True) if recompute else (False,):
        key = (kind.split_backward, rc)
        if key not in plans:
            if rc and not (timed or len(layout) <= subsets.EXHAUSTIVE_UP_TO
                           or _over(programs[False][2].memory.devices(mbs), caps)):
                break
            plans[key] = plan_with(program_view(main), loss_name, replace(options, schedule=kind.name, recompute=rc,
                                                                          schedule_comm=_comm(kind, comm)))
        plan = plans[key]
        programs[rc] = (main, start, plan if plan.schedule == kind.name else reschedule(plan, kind.name, compute))
    stages = {rc: plan.memory.stages for rc, (_, _, plan) in programs.items()}
    costs = {}
    for rc, (_, _, plan) in programs.items():
        price = placement.profiled_cost(kind.split_backward, rc)
        costs[rc] = {a: price(a) for acts in plan.actions.values() for a in acts}
    return _Built(placement, layout, placement.policy, stages, costs, programs, comm=comm)


def _minimized(main, loss, optimizer, startup, mbs: int, kind, m: int) -> tuple:
    """``main`` (tagged) given Paddle's backward and optimizer ops by ``minimize``: (main, its startup, the
    loss's name, the plan options, ``{(backward split, recomputed): plan}`` holding the plan made for
    ``kind``)."""
    start = (startup or paddle.static.default_startup_program()).clone()
    with paddle.static.program_guard(main, start), paddle.utils.unique_name.guard():
        opt = PipelineOptimizer(optimizer(), num_microbatches=m, schedule=kind.name, micro_batch_size=mbs)
        opt.minimize(loss if is_pir_value(loss) else main.global_block().var(getattr(loss, "name", loss)))
    return main, start, opt.plan.loss, opt.options, {(kind.split_backward, False): opt.plan}


def _over(devices: Sequence[DeviceMemory], caps) -> dict[str, int]:
    """Each of ``devices`` over its cap -> by how many bytes."""
    return {d.device: d.total - caps[d.device] for d in devices
            if caps[d.device] is not None and d.total > caps[d.device]}


def _timed(builds: list, batch: dict, steps: int) -> list:
    """``builds`` with every built plan's actions priced at their timed costs (``plan_timing.py``)."""
    keys = [(i, rc) for i, (_, b) in enumerate(builds) for rc in b.programs]
    timings = dict(zip(keys, time_plans([builds[i][1].programs[rc] for i, rc in keys], batch, steps)))
    return [(kind, replace(b, costs={rc: timings[i, rc].costs for rc in b.programs},
                           measured={rc: timings[i, rc].step_s for rc in b.programs}))
            for i, (kind, b) in enumerate(builds)]


def _priced(kind, built: _Built, mbs: int, caps, whole: bool, efficiency: float | None) -> list[Candidate]:
    """The subsets of recomputed stages of ``built`` that ``recompute_subsets`` picks, under schedule ``kind``."""
    vectors = built.programs[False][2].memory.inflight  # the schedule's in-flight counts, from its plan
    p = len(built.devices)

    def memory(recomputed: Sequence[int]) -> list[DeviceMemory]:
        stages = tuple(built.stages[s in recomputed][s] for s in range(p))
        return MemoryModel(stages, built.ranks, built.stage_ranks, vectors).devices(mbs)

    forward = {a.stage: c for a, c in built.costs[False].items() if a.kind is Kind.F}
    priced = subsets.recompute_subsets(
        built.stage_ranks, whole, lambda rc: {d.rank: _over([d], caps).get(d.device, 0) for d in memory(rc)},
        lambda s: forward.get(s, 0.0)) if True in built.stages else [()]
    out = []
    for recomputed in priced:
        devices = memory(recomputed)
        step = _simulated_step(built, recomputed) / (efficiency or 1.0)
        out.append(Candidate(kind.name, built.policy, built.devices, tuple(built.placement.bounds), recomputed,
                             step, tuple(devices), _over(devices, caps)))
    return out


def _simulated_step(built: _Built, recomputed: Sequence[int]) -> float:
    """The plan's step in the simulator, each action at its cost (from the plan with the action's stage
    recomputed or not); CPU devices (and gpu:k stand-ins without CUDA) share this machine's cores, the
    first OPT of every rank waits for all of them, as in the runtime."""
    sharing = {r for r, device in enumerate(built.ranks) if isinstance(place_of(device), core.CPUPlace)}
    sim = simulate(built.actions, lambda a: built.costs[a.stage in recomputed][a], len(built.stage_ranks),
                   cores=_cores() if sharing else None, sharing=sharing, collectives=True, comm=built.comm)
    return sim.total


def _efficiency(builds: Sequence[_Built]) -> float | None:
    """Simulated over measured step of every timed plan, the median: what the simulator leaves out (the
    threads' hand-offs, the scheduler's switches), one figure for this machine and runtime."""
    ratios = [_simulated_step(b, tuple(range(len(b.stage_ranks))) if rc else ()) / step
              for b in builds for rc, step in b.measured.items()]
    return statistics.median(ratios) if ratios else None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _comm(kind, comm: Comm) -> Comm:
    """The latency ``kind`` plans its order with: the schedules that plan by costs take it, the others' order is
    fixed (they are still priced with it)."""
    return comm if kind.cost_aware else None


def _apply(program, loss, optimizer, startup, profile, chosen: Candidate, m: int, cap: float | None,
           comm: Comm) -> None:
    auto_place(program, devices=list(chosen.devices), policy=chosen.policy, profile=profile, schedule=chosen.schedule,
               num_microbatches=m, memory_limit=cap)
    with paddle.static.program_guard(program, startup or paddle.static.default_startup_program()):
        PipelineOptimizer(optimizer(), num_microbatches=m, schedule=chosen.schedule, recompute=list(chosen.recompute),
                          micro_batch_size=profile.batch_size, schedule_comm=comm).minimize(loss)


def _cut_cap(caps: Mapping[str, float | None]) -> float | None:
    """The one limit ``auto_place``'s memory cut takes: the smallest cap."""
    return min((c for c in caps.values() if c is not None), default=None)


def _caps(memory_limit: Any, devices: Sequence[str]) -> dict[str, float | None]:
    """Each device's cap in bytes (None: none), every one checked by ``parse_bytes``."""
    ranks = list(dict.fromkeys(devices))

    def cap(value: Any, what: str) -> float | None:
        return None if value is None else parse_bytes(value, what)
    if memory_limit is None or isinstance(memory_limit, (int, float, str)):
        return {d: cap(memory_limit, "memory_limit") for d in ranks}
    if isinstance(memory_limit, Mapping):
        unknown = [d for d in memory_limit if d not in ranks]
        if unknown:
            raise ValueError(f"memory_limit names {unknown}, which are not among the devices {ranks}")
        return {d: cap(memory_limit.get(d), f"memory_limit[{d!r}]") for d in ranks}
    if not isinstance(memory_limit, Sequence):
        raise ValueError(f"memory_limit must be bytes, a size such as '8GB', one per device or {{device: bytes}}; "
                         f"got {type(memory_limit).__name__}: {memory_limit!r}")
    caps = list(memory_limit)
    if len(caps) != len(ranks):
        raise ValueError(f"memory_limit has {len(caps)} entries for the {len(ranks)} devices {ranks}")
    return {d: cap(c, f"memory_limit[{k}]") for k, (d, c) in enumerate(zip(ranks, caps))}
