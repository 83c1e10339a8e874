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
  forward and its backward. Building a plan costs a rewrite, so for each partition two are built (no
  stage recomputed, every stage recomputed); a stage's figures (bytes and action times) depend only on its
  own ops and whether it recomputes, so every subset of recomputed stages is priced from those two and
  the schedule's in-flight counts.

Partitions: per layout (one stage per device; two per device for the interleaved and V schedules), the
time-balanced cut of ``auto_place`` and, under a cap and with one stage per device, its memory-capped cut.
The fastest combination whose every device fits its cap wins (ties: fewer recomputed stages, then the
schedule's registry order); the report lists the runners-up and why each lost.
"""
from __future__ import annotations

import itertools
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from .._paddle import core, framework, np, paddle
from ..io import DataLoader
from ..ir import refuse_pir
from ..memory_model import DeviceMemory, MemoryModel, StageMemory, human_bytes, parse_bytes
from ..optimizer import PipelineOptimizer
from ..placement import place_of
from ..plan import Plan
from ..rewrite.memory import inflight_vectors
from ..schedule import KINDS, Action, make_schedule, simulate
from ..schedule.simulate import peak_inflight
from .auto_place import Placement, auto_place
from .costs import Profile
from .plan_timing import time_plans
from .profile import first_batch, refuse_measuring_in_launched_job
from .profile import profile as run_profile


@dataclass(frozen=True)
class Candidate:
    """One combination the planner priced."""

    schedule: str
    policy: str  # the partition: auto_place's "time" or "memory" cut
    devices: tuple[str, ...]  # the device of each stage
    bounds: tuple[int, ...]  # layer index where each stage starts (and the end)
    recompute: tuple[int, ...]  # stages whose activations are recomputed
    step_s: float  # predicted seconds per step
    memory: tuple[DeviceMemory, ...]  # predicted peak per device
    over: Mapping[str, int]  # device -> bytes above its cap (empty: fits)

    @property
    def fits(self) -> bool:
        return not self.over

    def describe(self) -> str:
        rc = ",".join(map(str, self.recompute)) or "-"
        peaks = ", ".join(f"{d.device} {human_bytes(d.total)}" for d in self.memory)
        return f"{self.schedule:<10} {self.policy:<6} recompute {rc:<8} {self.step_s * 1e3:9.2f} ms  peak {peaks}"


@dataclass(frozen=True)
class PlanReport:
    """What ``auto_plan`` chose (and applied), what it predicted, and why the others lost."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]  # every combination priced, fastest first
    skipped: Mapping[str, str]  # schedule -> why it could not run this program
    memory_limit: Mapping[str, float | None]
    micro_batch_size: int
    efficiency: float | None  # simulated / measured step of the timed plans (None: times from the op profile)
    timed_plans: int  # plans built and run to time their actions

    def why_not(self, candidate: Candidate) -> str:
        if candidate == self.chosen:
            return "chosen"
        if not candidate.fits:
            return "over the cap: " + ", ".join(f"{d} by {human_bytes(b)}" for d, b in candidate.over.items())
        slower = candidate.step_s / self.chosen.step_s - 1
        return f"{slower:+.1%} slower" if slower > 0 else "as fast; more recompute or later in the registry"

    def __str__(self) -> str:
        caps = ", ".join(f"{d} {'unlimited' if c is None else human_bytes(c)}" for d, c in self.memory_limit.items())
        best: dict[tuple[str, str], Candidate] = {}
        for c in self.candidates:  # fastest first: the first of each schedule and cut is its best
            best.setdefault((c.schedule, c.policy), c)
        timing = ("times from the op profile alone (no plan timed)" if self.efficiency is None else
                  f"times from {self.timed_plans} timed plans, simulated / measured step {self.efficiency:.2f}")
        lines = [f"auto_plan: micro-batch {self.micro_batch_size}, caps {caps}; {len(self.candidates)} plans priced; "
                 + timing,
                 f"  chosen: {self.chosen.describe()}", "  the best of each other schedule and cut:"]
        lines += [f"    {c.describe()}  -- {self.why_not(c)}" for c in best.values() if c != self.chosen]
        lines += [f"  not applicable: {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def auto_plan(program: framework.Program, loss: Any, optimizer: Callable[[], Any], devices: Sequence[str],
              num_microbatches: int, memory_limit: float | Mapping[str, float] | Sequence[float] | None = None,
              feed: dict | DataLoader | None = None, profile: Profile | None = None,
              startup: framework.Program | None = None, schedules: Sequence[str] | None = None,
              recompute: bool | str = True, time_steps: int = 3) -> PlanReport:
    """Choose a partition of ``program`` (a forward program without guards, as for ``auto_place``) over
    ``devices``, a schedule and the stages to recompute, for the fastest predicted step whose every device
    stays under ``memory_limit`` (bytes: one number, one per device, or ``{device: bytes}``; None: no cap),
    then apply it: tag the ops and ``PipelineOptimizer(optimizer(), ...).minimize(loss)``.

    ``optimizer``: a function making the inner optimizer (each priced plan needs its own). ``feed``: one
    micro-batch (or a loader, whose first batch is used): the op profile is taken on it (unless
    ``profile`` is given, taken at the same micro-batch size) and every built plan is timed on it for
    ``time_steps`` traced steps (0: price time from the op profile alone, as without ``feed``).
    ``schedules``: the schedule names to consider (default: every registered one). ``recompute``: True
    prices every subset of recomputed stages, "whole" none or all of them, False none. ``ValueError``
    saying by how much the best plan misses, per device, when none fits.
    """
    refuse_pir(program, "auto_plan")
    if recompute not in (True, False, "whole"):
        raise ValueError(f"recompute must be True (every subset of stages), \"whole\" (none or all) or False; got {recompute!r}")
    if not isinstance(time_steps, int) or isinstance(time_steps, bool) or time_steps < 0:
        raise ValueError(f"time_steps must be an integer >= 0, got {time_steps!r}")
    devices = list(devices)
    caps = _caps(memory_limit, devices)
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
    builds, skipped = [], {}
    for name in schedules or list(KINDS):
        kind = KINDS[name] if name in KINDS else None
        if kind is None:
            raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(KINDS)}")
        chunks = kind.chunks or 2
        try:
            make_schedule(kind.name, len(devices), num_microbatches, chunks)
        except ValueError as exc:
            skipped[kind.name] = str(exc)
            continue
        layout = [devices[r] for r in kind.layout(len(devices), chunks)]
        for policy in ("time",) + (("memory",) if any(c is not None for c in caps.values()) and chunks == 1 else ()):
            built = _built(program, loss, optimizer, startup, profile, layout, policy, kind, num_microbatches,
                           bool(recompute) and not kind.split_backward, caps)
            if built is not None:
                builds.append((kind, built))
    if not builds:
        raise ValueError("auto_plan: no schedule can run this program: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    if batch is not None and time_steps:
        builds = _timed(builds, batch, time_steps)
    efficiency = _efficiency([b for _, b in builds])
    candidates = [c for kind, b in builds
                  for c in _priced(kind, b, num_microbatches, mbs, caps, len(devices), recompute == "whole", efficiency)]
    order = list(KINDS)
    candidates.sort(key=lambda c: (not c.fits, c.step_s if c.fits else sum(c.over.values()), len(c.recompute),
                                   order.index(c.schedule)))
    best = candidates[0]
    if not best.fits:
        rc = ", ".join(map(str, best.recompute)) or "none"
        raise ValueError(f"auto_plan: no plan fits the memory caps; the closest ({best.schedule}, {best.policy} cut, "
                         f"recompute {rc}) misses " + ", ".join(f"{d} by {b} bytes ({human_bytes(b)})"
                                                                for d, b in best.over.items()))
    _apply(program, loss, optimizer, startup, profile, best, num_microbatches, _cut_cap(caps))
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

    # what recompute leaves alone, read from the plan without it
    ranks = property(lambda self: self.programs[False][2].ranks)
    stage_ranks = property(lambda self: tuple(s.rank for s in self.programs[False][2].stages))
    actions = property(lambda self: self.programs[False][2].actions, doc="the lowered actions, messages included")


def _built(program, loss, optimizer, startup, profile, layout, policy, kind, m, recompute, caps) -> _Built | None:
    """The partition ``policy`` gives for ``layout``, with its plans built and their actions priced from
    the op profile (None: the policy cannot cut it)."""
    stages: dict[bool, tuple[StageMemory, ...]] = {}
    costs: dict[bool, Mapping[Action, float]] = {}
    programs = {}
    placement = None
    for rc in (False, True) if recompute else (False,):
        main = program.clone()
        start = (startup or paddle.static.default_startup_program()).clone()
        try:
            placement = auto_place(main, devices=layout, policy=policy, profile=profile, schedule=kind.name,
                                   num_microbatches=m, memory_limit=_cut_cap(caps))
        except ValueError:
            return None
        with paddle.static.program_guard(main, start), paddle.utils.unique_name.guard():
            opt = PipelineOptimizer(optimizer(), num_microbatches=m, schedule=kind.name, recompute=rc,
                                    micro_batch_size=profile.batch_size)
            opt.minimize(main.global_block().var(loss if isinstance(loss, str) else loss.name))
        plan = opt.plan
        stages[rc] = plan.memory.stages
        price = placement.profiled_cost(kind.split_backward, rc)
        costs[rc] = {a: price(a) for acts in plan.actions.values() for a in acts}
        programs[rc] = (main, start, plan)
    return _Built(placement, tuple(layout), policy, stages, costs, programs)


def _timed(builds: list, batch: dict, steps: int) -> list:
    """``builds`` with every built plan's actions priced at their timed costs (``plan_timing.py``)."""
    keys = [(i, rc) for i, (_, b) in enumerate(builds) for rc in b.programs]
    timings = dict(zip(keys, time_plans([builds[i][1].programs[rc] for i, rc in keys], batch, steps)))
    return [(kind, replace(b, costs={rc: timings[i, rc].costs for rc in b.programs},
                           measured={rc: timings[i, rc].step_s for rc in b.programs}))
            for i, (kind, b) in enumerate(builds)]


def _priced(kind, built: _Built, m: int, mbs: int, caps, num_ranks: int, whole: bool,
            efficiency: float | None) -> list[Candidate]:
    """Every subset of recomputed stages of ``built`` (``whole``: none or all) under schedule ``kind``."""
    compute = make_schedule(kind.name, num_ranks, m, kind.chunks or 2)
    vectors = inflight_vectors(compute, built.stage_ranks)
    peaks = peak_inflight(compute)
    p = len(built.devices)
    subsets = (itertools.chain.from_iterable(itertools.combinations(range(p), k) for k in range(p + 1))
               if not whole else [(), tuple(range(p))])
    out = []
    for recomputed in subsets:
        if recomputed and True not in built.stages:
            break
        stages = tuple(replace(built.stages[s in recomputed][s], peak_inflight=peaks.get(s, 0)) for s in range(p))
        devices = MemoryModel(stages, built.ranks, built.stage_ranks, vectors).devices(mbs)
        over = {d.device: d.total - caps[d.device] for d in devices
                if caps[d.device] is not None and d.total > caps[d.device]}
        step = _simulated_step(built, recomputed) / (efficiency or 1.0)
        out.append(Candidate(kind.name, built.policy, built.devices, tuple(built.placement.bounds), recomputed,
                             step, tuple(devices), over))
    return out


def _simulated_step(built: _Built, recomputed: Sequence[int]) -> float:
    """The plan's step in the simulator, each action at its cost (from the plan with the action's stage
    recomputed or not); CPU devices (and gpu:k stand-ins without CUDA) share this machine's cores, the
    first OPT of every rank waits for all of them, as in the runtime."""
    sharing = {r for r, device in enumerate(built.ranks) if isinstance(place_of(device), core.CPUPlace)}
    sim = simulate(built.actions, lambda a: built.costs[a.stage in recomputed][a], len(built.stage_ranks),
                   cores=_cores() if sharing else None, sharing=sharing, collectives=True)
    return sim.total


def _efficiency(builds: Sequence[_Built]) -> float | None:
    """Simulated over measured step of every timed plan, the median: what the simulator leaves out (the
    threads' hand-offs, the scheduler's switches), one figure for this machine and runtime."""
    ratios = [_simulated_step(b, tuple(range(len(b.stage_ranks))) if rc else ()) / step
              for b in builds for rc, step in b.measured.items()]
    return statistics.median(ratios) if ratios else None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _apply(program, loss, optimizer, startup, profile, chosen: Candidate, m: int, cap: float | None) -> None:
    auto_place(program, devices=list(chosen.devices), policy=chosen.policy, profile=profile, schedule=chosen.schedule,
               num_microbatches=m, memory_limit=cap)
    with paddle.static.program_guard(program, startup or paddle.static.default_startup_program()):
        PipelineOptimizer(optimizer(), num_microbatches=m, schedule=chosen.schedule, recompute=list(chosen.recompute),
                          micro_batch_size=profile.batch_size).minimize(loss)


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
