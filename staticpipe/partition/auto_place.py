"""``auto_place``: give every forward op of an unguarded (or partly guarded) program its stage's device.

Why tag ops instead of building a plan: the rewrite already turns ``op_device`` tags into stages, cut
variables and schedules, and checks them; an automatic placement that only writes the tags a user would
have written by hand goes through exactly the same, tested path. So the flow is: build the forward
program without guards -> ``auto_place`` -> ``PipelineOptimizer.minimize``, which differentiates and
splits it (backward ops follow their forward op's device).

The program is cut only between layers (``layers.py``), contiguously, by a policy (``policies.py``):
ops that already carry a device are constraints (their layer stays on that device's stage), and split
points (variable names, or ``staticpipe.split_point()`` markers) are cuts every policy keeps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .._paddle import framework, np
from ..io import DataLoader
from ..pir_view import PirView
from ..placement import op_device, parse_device
from ..rewrite.stages import op_label, role_of
from ..schedule import Action, Kind, check_microbatches, get_kind, make_schedule, simulate
from ..schedule.simulate import peak_inflight
from . import policies
from .layers import Layer, forward_ops, group_layers, marker_starts
from .tags import readable, split_starts, tag
from .costs import Profile
from .profile import profile as run_profile, refuse_measuring_in_launched_job, static_bytes
from ..memory_model import parse_bytes
from .table import format_table, human_bytes

POLICIES = ("uniform", "params", "time", "memory")


@dataclass
class StageReport:
    """One stage of a placement. Times and activation bytes are per micro-batch at the profiled batch
    size, and None without a profile; cut variable bytes are per sample without one."""

    index: int
    device: str
    ops: tuple[int, ...]
    layers: tuple[str, ...]
    parameters: tuple[str, ...]
    param_bytes: int
    forward_s: float | None
    backward_s: float | None
    activation_bytes: int | None
    saved_bytes: int | None  # activations its backward reads, held per micro-batch in flight
    inflight: int  # micro-batches in flight at once under the schedule
    memory_bytes: int  # policies.stage_memory: parameters, state, gradients, saved activations (if profiled)
    cut_vars: tuple[tuple[str, int], ...]  # (variable, bytes) this stage sends to later stages

    @property
    def time_s(self) -> float | None:
        return None if self.forward_s is None else self.forward_s + self.backward_s


@dataclass
class Placement:
    """What ``auto_place`` decided, as data (``stages``) and as a table (``print``), with the balance and
    step time it predicts."""

    policy: str
    stages: list[StageReport]
    layers: list[Layer]
    bounds: list[int]  # stage k holds layers[bounds[k]:bounds[k + 1]]
    schedule: str
    num_microbatches: int
    batch_size: int | None  # the profiled (micro-)batch size; None without a profile

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    def imbalance(self) -> float:
        """Slowest stage / mean stage, forward + backward time: 1.0 is a perfect balance."""
        times = self._times("imbalance")
        return max(times) / (sum(times) / len(times))

    def predicted_step_time(self, schedule: str | None = None, num_microbatches: int | None = None) -> float:
        """Seconds per step that ``staticpipe.schedule.simulate`` predicts for the profiled stage times
        (F = a stage's forward, B = its backward, halved into B and W for split-backward schedules; a
        paired FB its F plus its B; messages and the optimizer cost 0)."""
        self._times("predicted_step_time")
        kind = get_kind(schedule or self.schedule)
        m = check_microbatches(num_microbatches or self.num_microbatches)
        ranks = list(dict.fromkeys(self.devices))
        compute = make_schedule(kind.name, len(ranks), m, len(self.stages) // len(ranks))
        return simulate(compute, self.profiled_cost(kind.split_backward), len(self.stages)).total

    def profiled_cost(self, split_backward: bool, recomputed: bool = False) -> Callable[[Action], float]:
        """An action's seconds at its stage's profiled times: F its forward, B its backward (halved into B
        and W when ``split_backward``; ``recomputed``: the forward paid again in it), a paired FB its F
        plus its B; messages and the optimizer 0."""
        self._times("profiled_cost")
        share = 0.5 if split_backward else 1.0

        def one(h: Action) -> float:
            s = self.stages[h.stage]
            backward = s.backward_s + (s.forward_s if recomputed else 0.0)
            return {Kind.F: s.forward_s, Kind.B: backward * share, Kind.W: backward * (1 - share)}.get(h.kind, 0.0)
        return lambda a: sum(map(one, a.halves()))

    def _times(self, what: str) -> list[float]:
        if self.stages[0].time_s is None:
            raise ValueError(f"{what} needs measured times: pass profile= or feed= to auto_place")
        return [s.time_s for s in self.stages]

    def __str__(self) -> str:
        timed = self.stages[0].time_s is not None
        per = f"micro-batch of {self.batch_size}" if timed else "sample (no profile)"
        lines = [f"Placement by policy '{self.policy}': {sum(len(s.ops) for s in self.stages)} ops in "
                 f"{len(self.layers)} layers on {len(self.stages)} stages; schedule {self.schedule}, "
                 f"{self.num_microbatches} micro-batches; bytes and times per {per}"]

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.3f}"

        def size(x: int | None) -> str:
            return "-" if x is None else human_bytes(x)

        rows = [[s.index, s.device, len(s.ops), f"{len(s.layers)} ({s.layers[0]} .. {s.layers[-1]})",
                 human_bytes(s.param_bytes), ms(s.forward_s), ms(s.backward_s), size(s.activation_bytes),
                 size(s.saved_bytes), s.inflight, human_bytes(s.memory_bytes),
                 human_bytes(sum(b for _, b in s.cut_vars))] for s in self.stages]
        lines.append(format_table(["stage", "device", "ops", "layers", "params", "fwd ms", "bwd ms", "activations",
                                   "saved", "in flight", "memory", "sends"], rows))
        for s in self.stages:
            if s.cut_vars:
                sent = ", ".join(f"{name} ({human_bytes(b)})" for name, b in s.cut_vars)
                lines.append(f"  stage {s.index} sends: {sent}")
        if timed:
            lines.append(f"  slowest stage / mean: {self.imbalance():.3f}; predicted step ({self.schedule}, "
                         f"{self.num_microbatches} micro-batches): {self.predicted_step_time() * 1e3:.3f} ms")
        return "\n".join(lines)


def auto_place(program: framework.Program, num_stages: int | None = None, devices: Sequence[str] | None = None,
               policy: str = "time", profile: Profile | None = None,
               feed: dict[str, np.ndarray] | DataLoader | None = None,
               split_points: Sequence[Any] | None = None, memory_limit: float | None = None,
               optimizer_state_factor: float = 2, schedule: str = "1F1B", num_microbatches: int = 1) -> Placement:
    """Set ``op_device`` on every forward op of ``program`` (before ``minimize``) and report the stages.

    ``num_stages`` (devices "gpu:0" .. "gpu:{n-1}") or ``devices`` (one per stage; a device listed
    twice holds two chunks, for interleaved or ZB-V schedules). ``policy``: "uniform" (equal numbers of
    layers), "params" (balanced parameter bytes), "time" (balanced forward + backward time, needs
    ``profile`` or ``feed``), "memory" ("time" with every device under ``memory_limit`` bytes, counting
    ``optimizer_state_factor`` x the parameter bytes of state and the activations ``schedule`` keeps in
    flight over ``num_microbatches``). ``split_points``: variables (or names) to cut after; the
    program's ``staticpipe.split_point()`` markers are cuts too. Without ``num_stages`` and ``devices``,
    the split points alone set the stages.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
    kind = get_kind(schedule)
    check_microbatches(num_microbatches)
    tagged, program = program, readable(program)
    block = program.global_block()
    ops = block.ops
    fwd = forward_ops(program)
    forward = set(fwd)
    for i, op in enumerate(ops):
        if i not in forward:
            raise ValueError(f"auto_place runs before minimize, but {op_label(i, op)} is a {role_of(op, i)} op; "
                             "call auto_place on the forward program, then PipelineOptimizer.minimize")
    points = [program.name_of(p) for p in split_points or ()] if isinstance(program, PirView) else split_points or ()
    starts = split_starts(block, fwd, points)
    layers = group_layers(program, starts)
    layer_of = {i: layer.index for layer in layers for i in layer.ops}
    required = sorted({layer_of[i] for i in starts | marker_starts(program, fwd)})
    devices = _devices(num_stages, devices, len(required) + 1)
    p, n = len(devices), len(layers)
    if len(required) + 1 > p:
        raise ValueError(f"the split points make {len(required) + 1} stages, but there are only {p} devices")
    if p > n:
        raise ValueError(f"{p} stages need at least {p} layers, but the program has {n}")
    allowed = _allowed(ops, layers, devices)
    ranks = list(dict.fromkeys(devices))
    if policy == "memory" and memory_limit is None:
        raise ValueError("policy 'memory' needs memory_limit= (bytes per device)")
    if memory_limit is not None:
        memory_limit = parse_bytes(memory_limit, "memory_limit")
    if policy == "memory" and len(ranks) < p:
        raise ValueError(f"policy 'memory' needs one stage per device; devices {devices} repeat")
    inflight = peak_inflight(make_schedule(kind.name, len(ranks), num_microbatches, p // len(ranks)))
    inflight = [inflight.get(k, 0) for k in range(p)]

    if profile is None and feed is not None:
        if policy in ("time", "memory"):
            refuse_measuring_in_launched_job(f"auto_place(policy={policy!r}, feed=...)")
        profile = run_profile(tagged, feed)  # the program itself: a PIR program is profiled as one
    if profile is None and policy in ("time", "memory"):
        raise ValueError(f"policy {policy!r} needs measured times: pass profile= (staticpipe.profile(...)) or feed=")
    rows = None
    if profile is not None:
        profile.check(program, fwd)
        rows = profile.aggregate(layers)
    param_bytes = {prm.name: static_bytes(prm) for prm in block.all_parameters()}
    var_bytes = profile.var_bytes if profile is not None else {}
    cut_bytes, crossing = _cuts(block, layers, var_bytes)
    constraints = policies.Constraints(allowed, tuple(required), cut_bytes)
    param_matrix = _param_matrix(layers, param_bytes)
    if policy == "uniform":
        bounds = policies.uniform(n, p, constraints)
    elif policy == "params":
        bounds = policies.params(param_matrix, p, constraints)
    else:
        costs = [r.forward_s + r.backward_s for r in rows]
        if policy == "time":
            bounds = policies.time(costs, p, constraints)
        else:
            bounds = policies.memory(costs, param_matrix, [r.saved_bytes for r in rows], p, memory_limit,
                                     inflight, optimizer_state_factor, constraints)
    tag(tagged, program, layers, bounds, devices)
    stages = [_report(k, devices[k], layers[a:b], rows[a:b] if rows is not None else None, param_bytes,
                      inflight[k], optimizer_state_factor, crossing, b)
              for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return Placement(policy, stages, layers, bounds, kind.name, num_microbatches,
                     profile.batch_size if profile is not None else None)


def _devices(num_stages: int | None, devices: Sequence[str] | None, needed: int) -> list[str]:
    if devices is not None:
        parsed = [str(parse_device(d)) for d in devices]
        if not parsed:
            raise ValueError("devices is empty: name one device per stage")
        if num_stages is not None and num_stages != len(parsed):
            raise ValueError(f"num_stages={num_stages} but devices names {len(parsed)} devices: {parsed}")
        return parsed
    if num_stages is None:
        if needed == 1:
            raise ValueError("pass num_stages or devices (or split points, which then set the stages)")
        num_stages = needed
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    return [f"gpu:{k}" for k in range(num_stages)]


def _allowed(ops: list, layers: list[Layer], devices: list[str]) -> np.ndarray:
    """Which stages each layer may run on: any, or those on its guard's device. A layer never straddles
    two guards (``group_layers``), so its first op's device is the layer's."""
    allowed = np.ones((len(devices), len(layers)), bool)
    pinned: list[tuple[int, str]] = []  # (first op of a guarded layer, its device)
    for layer in layers:
        i = layer.ops[0]
        device = op_device(ops[i])
        if device is None:
            continue
        if device not in devices:
            raise ValueError(f"{op_label(i, ops[i])} is guarded on '{device}', which is not among the devices "
                             f"{devices}")
        allowed[:, layer.index] = [d == device for d in devices]
        if pinned and len(set(devices)) == len(devices) and devices.index(device) < devices.index(pinned[-1][1]):
            j = pinned[-1][0]
            raise ValueError(f"{op_label(i, ops[i])} is guarded on '{device}' (stage {devices.index(device)}), but "
                             f"the earlier {op_label(j, ops[j])} is guarded on '{pinned[-1][1]}' (stage "
                             f"{devices.index(pinned[-1][1])}): guards must follow the stage order {devices}")
        pinned.append((i, device))
    return allowed


def _cuts(block: framework.Block, layers: list[Layer], var_bytes: dict[str, int]
          ) -> tuple[np.ndarray, dict[str, tuple[int, int, int]]]:
    """Bytes crossing a cut before each layer, and every forward activation read in a later layer:
    name -> (producing layer, last reading layer, bytes). Sizes from the profile, else per sample."""
    n = len(layers)
    made: dict[str, int] = {}
    last: dict[str, int] = {}
    for layer in layers:
        for i in layer.ops:
            for name in block.ops[i].input_arg_names:
                if name in made:
                    last[name] = layer.index
            for name in block.ops[i].output_arg_names:
                var = block._var_recursive(name)
                if not var.persistable and not getattr(var, "is_data", False):
                    made.setdefault(name, layer.index)
    crossing = {}
    for name, b in last.items():
        if b > made[name]:
            nbytes = var_bytes[name] if name in var_bytes else static_bytes(block._var_recursive(name))
            crossing[name] = (made[name], b, nbytes)
    diff = np.zeros(n + 2)
    for a, b, nbytes in crossing.values():
        diff[a + 1] += nbytes  # crosses the cuts before layers a+1 .. b
        diff[b + 1] -= nbytes
    return np.cumsum(diff)[: n + 1], crossing


def _param_matrix(layers: list[Layer], nbytes: dict[str, int]) -> np.ndarray:
    """Parameter bytes of every run of layers, each parameter counted once per run even when several of
    its layers read it (a tied embedding)."""
    per_layer = np.array([sum(nbytes[p] for p in layer.parameters) for layer in layers], np.float64)
    matrix = policies.segment_matrix(per_layer).copy()
    readers: dict[str, list[int]] = {}
    for layer in layers:
        for p in layer.parameters:
            readers.setdefault(p, []).append(layer.index)
    idx = np.arange(len(layers) + 1)
    for p, at in readers.items():
        for a, b in zip(at, at[1:]):  # a run holding both a and b counted p twice
            matrix -= nbytes[p] * ((idx[:, None] <= a) & (idx[None, :] > b))
    return matrix


def _report(k: int, device: str, layers: list[Layer], rows: list | None, param_bytes: dict[str, int],
            inflight: int, optimizer_state_factor: float, crossing: dict[str, tuple[int, int, int]],
            end: int) -> StageReport:
    params = tuple(dict.fromkeys(p for layer in layers for p in layer.parameters))
    pbytes = sum(param_bytes[p] for p in params)
    saved = sum(r.saved_bytes for r in rows) if rows is not None else None
    first = layers[0].index
    sent = tuple((name, nbytes) for name, (a, b, nbytes) in crossing.items() if first <= a < end <= b)
    return StageReport(
        index=k, device=device, ops=tuple(i for layer in layers for i in layer.ops),
        layers=tuple(layer.name for layer in layers), parameters=params, param_bytes=pbytes,
        forward_s=sum(r.forward_s for r in rows) if rows is not None else None,
        backward_s=sum(r.backward_s for r in rows) if rows is not None else None,
        activation_bytes=sum(r.activation_bytes for r in rows) if rows is not None else None,
        saved_bytes=saved, inflight=inflight,
        memory_bytes=int(policies.stage_memory(pbytes, saved or 0, inflight, optimizer_state_factor)),
        cut_vars=sent)
