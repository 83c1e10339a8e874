"""A stage worker: executes one device's action list for one training step.

Why this shape: Paddle's ``Executor.run`` frees every non-persistable variable when a run ends, so a
forward's activations could not wait for their backward. The worker therefore runs sections through
the lower-level prepared-context executor in a scope per in-flight micro-batch, telling the garbage
collector to spare exactly the values later sections need (the plan's ``keep`` lists). Gradient and
optimizer state live in the device's root scope, shared by all micro-batch scopes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from .._paddle import core, framework, np, paddle
from ..plan import BACKWARD, FORWARD, INIT, OPTIMIZE, WEIGHT, Plan
from ..rewrite import clear_device_tags, split_at_comm_ops, without_comm_ops
from ..schedule import Action, Kind
from ..schedule.actions import OPT
from .channel import Channel, PipelineAborted
from .places import generic_place

convert_dtype = paddle.base.data_feeder.convert_dtype
SECTION_OF = {Kind.F: FORWARD, Kind.B: BACKWARD, Kind.W: WEIGHT}


class StageError(RuntimeError):
    """A stage failed; names the stage, its device and the action. ``__cause__`` is the original error."""

    def __init__(self, stage: int, device: str, action: Action | str, error: BaseException):
        self.stage, self.device, self.action = stage, device, action
        super().__init__(f"stage {stage} ({device}) failed in action {action}: "
                         f"{type(error).__name__}: {error}")


@dataclass
class StepJob:
    plan: Plan
    actions: list[Action]
    feeds: dict[int, list[dict[str, np.ndarray]]]  # stage -> per micro-batch data
    fetch: dict[tuple[int, str], tuple[str, ...]]  # (stage, section kind) -> names to fetch per micro-batch
    channel: Channel
    places: dict[int, core.Place]  # stage -> place, for the receivers of sends
    record: Callable[[Action, float, float], None] | None = None


@dataclass
class StepResult:
    fetched: dict[str, list[np.ndarray]] = field(default_factory=dict)


@dataclass
class MemoryStats:
    """Activations a stage holds between a micro-batch's forward and its backward."""

    inflight_bytes: int = 0
    inflight_microbatches: int = 0
    peak_bytes: int = 0
    peak_microbatches: int = 0

    def add(self, nbytes: int, microbatches: int) -> None:
        self.inflight_bytes += nbytes
        self.inflight_microbatches += microbatches
        self.peak_bytes = max(self.peak_bytes, self.inflight_bytes)
        self.peak_microbatches = max(self.peak_microbatches, self.inflight_microbatches)


class DeviceWorker:
    """State of one device: its root scope, place, executor and prepared sections."""

    def __init__(self, device: str, place: core.Place, scope: core._Scope):
        self.device, self.place, self.scope = device, place, scope
        self._exe = core.Executor(generic_place(place))
        self._ctx: dict[tuple, Any] = {}
        self._free: list[core._Scope] = []
        # a section's device tags are kept only where they name this place (a launched rank may run
        # "gpu:1" on its own GPU 0); elsewhere the worker's place decides
        self._cuda = isinstance(place, core.CUDAPlace) and device == f"gpu:{place.get_device_id()}"
        self._programs: list = []  # keeps alive the programs whose descs prepared contexts use
        self.memory: dict[int, MemoryStats] = {}  # stage -> activation memory
        self._held: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> bytes kept after its forward

    # --- sections -----------------------------------------------------------------------------------
    def _prepared(self, plan: Plan, stage: int, kind: str, keep: tuple[str, ...]) -> Any:
        key = (id(plan), stage, kind, keep)
        ctx = self._ctx.get(key)
        if ctx is None:
            section = plan.stages[stage].sections[kind]
            program = without_comm_ops(section.program)
            if not self._cuda:
                clear_device_tags(program)
            ctx = (self._exe.prepare(program.desc, 0, list(section.keep + keep), False), program)
            self._ctx[key] = ctx
        return ctx[0]

    def run_section(self, plan: Plan, stage: int, kind: str, scope: core._Scope,
                    keep: tuple[str, ...] = ()) -> None:
        self._exe.run_prepared_ctx(self._prepared(plan, stage, kind, keep), scope, False, True, True)
        self._sync()

    def init_stage(self, plan: Plan, stage: int) -> None:
        self.run_section(plan, stage, INIT, self.scope)

    # --- one step -----------------------------------------------------------------------------------
    def run_step(self, job: StepJob) -> StepResult:
        plan, result = job.plan, StepResult()
        last_use = {(a.stage, a.microbatch): i for i, a in enumerate(job.actions) if a.microbatch is not None}
        scopes: dict[tuple[int, int], core._Scope] = {}
        optimizers = _optimizer_groups(job.actions)
        try:
            for i, action in enumerate(job.actions):
                started = time.perf_counter()
                try:
                    self._run_action(job, action, scopes, result, optimizers)
                except (PipelineAborted, StageError):
                    raise
                except BaseException as exc:
                    raise StageError(action.stage, self.device, action, exc) from exc
                if job.record is not None:
                    job.record(action, started, time.perf_counter())
                key = (action.stage, action.microbatch)
                if action.microbatch is not None and last_use[key] == i:
                    self._release(plan, action.stage, action.microbatch, scopes.pop(key))
        finally:  # a failed step leaves no half-used micro-batch scope behind
            for (stage, mb), scope in scopes.items():
                self._release(plan, stage, mb, scope)
        return result

    def _run_action(self, job: StepJob, a: Action, scopes: dict, result: StepResult,
                    optimizers: dict[int, list[int]]) -> None:
        plan = job.plan
        if a.kind is Kind.OPT:
            if a.stage in optimizers:  # the first of the rank's OPT actions runs them all
                self._run_optimizers(job, optimizers[a.stage])
            return
        key = (a.stage, a.microbatch)
        scope = scopes.get(key)
        if scope is None:
            scope = scopes[key] = self._free.pop() if self._free else self.scope.new_scope()
        if a.kind is Kind.RECV:
            for name, value in job.channel.recv((a.route, a.microbatch), a.peer).items():
                self._put(scope, name, value)
        elif a.kind is Kind.SEND:
            route = plan.routes[a.route]
            dst = generic_place(job.places[route.dst.stage])
            message = {}
            for var in route.vars:
                tensor = _tensor(scope, var.name, a)
                _check_cut(var, tensor, plan.micro_batch_size)
                message[var.name] = tensor._copy(dst)
            job.channel.send((a.route, a.microbatch), message, a.peer)
        else:
            kind = SECTION_OF[a.kind]
            if a.kind is Kind.F:
                for name, value in job.feeds.get(a.stage, [{}] * (a.microbatch + 1))[a.microbatch].items():
                    scope.var(name).get_tensor().set(value, self.place)
            names = job.fetch.get((a.stage, kind), ())
            self.run_section(plan, a.stage, kind, scope, names)
            if a.kind is Kind.F:
                held = self._held[key] = _bytes(scope, plan.stages[a.stage].sections[FORWARD].keep)
                self.memory.setdefault(a.stage, MemoryStats()).add(held, 1)
            for name in names:
                result.fetched.setdefault(name, []).append(np.array(_tensor(scope, name, a)))

    def _run_optimizers(self, job: StepJob, stages: list[int]) -> None:
        """Run the optimize sections of this rank's ``stages`` together, each a coroutine that pauses at
        every exchange it waits for (``_optimize_steps``).

        Why together: one rank may hold several stages (interleaved, ZB-V), run by this one thread. A
        global-norm sum needs every stage's part, and a shared parameter's owner waits for the partial
        gradient of a stage that may sit on the same rank: run one after the other, the first would wait
        forever for the second. So exchanges between local stages are served locally, a cross-stage sum
        adds the local parts (in stage order) and then goes once over the ranks, and only when no local
        stage can go on does the rank wait for another rank."""
        plan = job.plan
        rank = plan.stages[stages[0]].rank
        sent: set = set()
        coroutines = {s: self._optimize_steps(job, s, sent) for s in stages}
        waits: dict[int, tuple] = {}

        def resume(stage: int, reply: Any = None) -> None:
            try:
                waits[stage] = coroutines[stage].send(reply)
            except StopIteration:
                waits.pop(stage, None)
            except PipelineAborted:
                raise
            except BaseException as exc:
                raise StageError(stage, self.device, OPT(stage), exc) from exc

        for stage in stages:
            resume(stage)
        while waits:
            receiver = next((s for s, (kind, key, _) in waits.items() if kind == "recv" and key in sent), None)
            sums = {key for kind, key, _ in waits.values() if kind == "sum"}
            if receiver is None and len(sums) == 1 and all(kind == "sum" for kind, _, _ in waits.values()):
                parts = [waits[s][2] for s in sorted(waits)]
                total = job.channel.allreduce(sums.pop(), rank, sum(parts[1:], parts[0].copy()),
                                              tuple(range(len(plan.ranks))))
                for stage in sorted(waits):
                    resume(stage, total)
                continue
            if receiver is None:  # nothing left to do here: wait for another rank
                receiver = next((s for s, (kind, _, src) in waits.items() if kind == "recv"
                                 and plan.stages[src].rank != rank), None)
                if receiver is None:
                    raise RuntimeError(f"the optimize sections of stages {stages} wait for each other: {waits}")
            _, key, src = waits[receiver]
            resume(receiver, job.channel.recv(key, src))

    def _optimize_steps(self, job: StepJob, stage: int, sent: set) -> Generator[tuple, Any, None]:
        """Run the optimize section piece by piece. Sends go out at once (their keys are added to
        ``sent``); at a receive it yields ("recv", key, source stage) and at a cross-stage sum ("sum",
        key, its part), and is resumed with the message or the total. A message is keyed by its two
        stages and its place among their messages this step: both sides list the exchanges in the same
        order, while the variable names may differ."""
        plan = job.plan
        if job.channel.replicas > 1:
            self._average_replicas(job.channel, plan.stages[stage].grad_buffers)
        sends: dict[int, int] = {}
        recvs: dict[int, int] = {}
        for piece in self._optimize_pieces(plan, stage):
            if not isinstance(piece, framework.Operator):
                self._exe.run_prepared_ctx(piece, self.scope, False, True, True)
                self._sync()
            elif piece.type == "send_v2":
                name, peer = piece.input("X")[0], piece.attr("peer")
                key = ("opt", stage, peer, _count(sends, peer))
                job.channel.send(key, {name: _tensor(self.scope, name, piece.type)._copy(
                    generic_place(job.places[peer]))}, peer)
                sent.add(key)
            elif piece.type == "recv_v2":
                name, peer = piece.output("Out")[0], piece.attr("peer")
                message = yield "recv", ("opt", peer, stage, _count(recvs, peer)), peer
                self._put(self.scope, name, next(iter(message.values())))
            else:  # c_allreduce_sum over all stages
                src, out = piece.input("X")[0], piece.output("Out")[0]
                total = yield "sum", ("opt", out), np.array(_tensor(self.scope, src, piece.type))
                self.scope.var(out).get_tensor().set(total, self.place)

    def _average_replicas(self, channel: Channel, buffers: tuple[str, ...]) -> None:
        """Data parallelism: replace each accumulated gradient by its mean over the replicas, so that every
        replica applies the gradient of the whole global batch. One all-reduce per dtype, over the
        buffers flattened together: a message per buffer would cost a round trip each."""
        values = {n: np.array(_tensor(self.scope, n, "OPT")) for n in buffers}
        for dtype in sorted({v.dtype.str for v in values.values()}):
            names = [n for n, v in values.items() if v.dtype.str == dtype]
            flat = channel.replica_mean(np.concatenate([values[n].ravel() for n in names]))
            offset = 0
            for n in names:
                size = values[n].size
                self.scope.var(n).get_tensor().set(flat[offset:offset + size].reshape(values[n].shape), self.place)
                offset += size

    def _put(self, scope: core._Scope, name: str, value) -> None:
        """Give ``scope`` a received value: a tensor already on this place is shared, an array copied in."""
        if isinstance(value, np.ndarray):
            scope.var(name).get_tensor().set(value, self.place)
        else:
            scope.var(name).get_tensor()._share_data_with(value)

    def prepare(self, plan: Plan, stage: int, fetch: dict[tuple[int, str], tuple[str, ...]]) -> None:
        """Build every program ``stage`` runs in this step, in the calling thread: Paddle's Python program
        API must not run in a worker while a channel thread sits in a dygraph guard."""
        for kind in (FORWARD, BACKWARD, WEIGHT):
            if kind in plan.stages[stage].sections:
                self._prepared(plan, stage, kind, fetch.get((stage, kind), ()))
        if OPTIMIZE in plan.stages[stage].sections:
            self._optimize_pieces(plan, stage)

    def _optimize_pieces(self, plan: Plan, stage: int) -> list:
        key = (id(plan), stage, OPTIMIZE)
        if key not in self._ctx:
            self._ctx[key] = self._prepare_pieces(plan.stages[stage].sections[OPTIMIZE].program)
        return self._ctx[key]

    def _prepare_pieces(self, program: framework.Program) -> list:
        pieces = split_at_comm_ops(program)
        prepared = []
        for k, piece in enumerate(pieces):
            if isinstance(piece, framework.Operator):
                prepared.append(piece)
                continue
            later = {n for p in pieces[k + 1:] for n in
                     (p.input_arg_names if isinstance(p, framework.Operator) else
                      [n for op in p.global_block().ops for n in op.input_arg_names])}
            if not self._cuda:
                clear_device_tags(piece)
            prepared.append(self._exe.prepare(piece.desc, 0, sorted(later), False))
            self._programs.append(piece)  # the prepared context refers to the program's desc
        return prepared

    def _sync(self) -> None:
        if self._cuda:  # kernels run on the device's own stream; values leave it only once they are done
            core._cuda_synchronize(self.place)

    def _release(self, plan: Plan, stage: int, microbatch: int, scope: core._Scope) -> None:
        """Erase what a micro-batch left in its scope, so a reused scope can never serve stale values."""
        held = self._held.pop((stage, microbatch), None)
        if held is not None:
            self.memory[stage].add(-held, -1)
        key = (id(plan), stage, "leftovers")
        if key not in self._ctx:  # computed once per plan and stage: this runs for every micro-batch
            sections = plan.stages[stage].sections
            names = set(sections[FORWARD].feeds)
            for kind in (FORWARD, BACKWARD, WEIGHT):
                names.update(sections[kind].keep if kind in sections else ())
            names.update(v.name for r in plan.routes if r.dst.stage == stage for v in r.vars)
            self._ctx[key] = sorted(names)
        scope.erase(self._ctx[key])
        self._free.append(scope)


def _tensor(scope: core._Scope, name: str, action: Action | str) -> core.LoDTensor:
    var = scope.find_var(name)
    if var is None or not var.get_tensor()._is_initialized():
        raise RuntimeError(f"variable '{name}' has no value in {action}")
    return var.get_tensor()


def _bytes(scope: core._Scope, names: tuple[str, ...]) -> int:
    total = 0
    for name in names:
        var = scope.find_var(name)
        if var is not None:
            tensor = var.get_tensor()
            if tensor._is_initialized():
                total += tensor._numel() * core.size_of_dtype(tensor._dtype())
    return total


def _check_cut(var, tensor: core.LoDTensor, micro_batch_size: int | None) -> None:
    """A cut variable must keep its compiled shape and dtype: a receiver in another process relies on it."""
    got = tuple(tensor.shape())
    want = var.shape_for(micro_batch_size)
    if len(got) != len(want) or any(w not in (-1, g) for w, g in zip(want, got)):
        raise ValueError(f"cut variable '{var.name}' has shape {list(got)}, but the plan compiled "
                         f"{list(want)}")
    dtype = convert_dtype(tensor._dtype())
    if dtype != var.dtype:
        raise ValueError(f"cut variable '{var.name}' has dtype {dtype}, but the plan compiled {var.dtype}")


def _optimizer_groups(actions: list[Action]) -> dict[int, list[int]]:
    """First stage of each run of consecutive OPT actions -> the stages of that run (run together)."""
    groups: dict[int, list[int]] = {}
    run: list[int] = []
    for a in actions + [None]:
        if a is not None and a.kind is Kind.OPT:
            run.append(a.stage)
        elif run:
            groups[run[0]] = run
            run = []
    return groups



def _count(counts: dict[int, int], peer: int) -> int:
    """The number of earlier exchanges with ``peer`` (then counts this one)."""
    counts[peer] = counts.get(peer, 0) + 1
    return counts[peer] - 1
