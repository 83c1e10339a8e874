"""A stage worker: executes one device's action list for one training step.

Why this shape: Paddle's ``Executor.run`` frees every non-persistable variable when a run ends, so a
forward's activations could not wait for their backward. The worker therefore runs each section's
compute program (``Section.runs``, built by the rewrite) through the lower-level prepared-context
executor in a scope per in-flight micro-batch, telling the garbage collector to spare exactly the values
later sections need (the plan's ``keep`` lists). Gradient and optimizer state live in the device's root
scope, shared by all micro-batch scopes. Cut variables travel as the plan's routes say; the worker
never reads an op to learn what to send.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .._paddle import core, np
from ..ir import free_scope, is_pir_program, np_dtype, tensor_bytes, tensor_of
from ..plan import BACKWARD, FORWARD, INIT, WEIGHT, CutVar, Run, Section, Stage
from ..schedule import Action, Kind
from . import lanes
from .errors import PASSING_THROUGH, PipelineAborted, StageError, check_finite_values, failing_as
from .jobs import Leftovers, RankProgram, StepJob, StepResult
from .optimize_phase import run_optimizers
from .pir_runs import PirRuns

@dataclass
class MemoryStats:
    """Activations a stage holds between a micro-batch's forward and its backward."""

    inflight_bytes: int = 0
    inflight_microbatches: int = 0
    peak_bytes: int = 0
    peak_microbatches: int = 0
    step_value_bytes: int | None = None  # held once for all micro-batches (AMP's parameter copies)

    def add(self, nbytes: int, microbatches: int) -> None:
        self.inflight_bytes += nbytes
        self.inflight_microbatches += microbatches
        if self.inflight_bytes > self.peak_bytes:  # (two max() calls cost more: this runs twice per forward)
            self.peak_bytes = self.inflight_bytes
        if self.inflight_microbatches > self.peak_microbatches:
            self.peak_microbatches = self.inflight_microbatches


class DeviceWorker:
    """State of one device: its root scope, place, executor and prepared runs."""

    def __init__(self, device: str, place: core.Place, scope: core._Scope, generic: core.Place):
        self.device, self.place, self.scope = device, place, scope
        self._exe = core.Executor(generic)
        self._cuda = isinstance(place, core.CUDAPlace)
        self._ctx: dict[tuple[Run, tuple[str, ...]], Any] = {}  # (run, values fetched from it) -> context
        self._free: list[core._Scope] = []
        self.memory: dict[int, MemoryStats] = {}  # stage -> activation memory
        self.device_memory = MemoryStats()  # all its stages at once (the peaks of a V's two stages need not meet)
        self._held: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> bytes kept after its forward
        self._sizes: dict[tuple[Section, tuple], tuple[int, int]] = {}  # see _held_bytes
        self._settled: dict[tuple[Section, tuple], int] = {}  # see _held_bytes
        self._pir: PirRuns | None = None  # the runs of PIR section programs, made on first use

    # --- runs ---------------------------------------------------------------------------------------
    def prepare(self, run: Run, fetch: tuple[str, ...] = ()) -> Any:
        """The prepared context of ``run`` (built once): Paddle's executor with the garbage collector told
        to spare ``run.keep`` and the fetched values."""
        key = (run, fetch)
        ctx = self._ctx.get(key)
        if ctx is None and is_pir_program(run.program):  # built by its first run (pir_runs.py)
            return None
        if ctx is None:
            ctx = self._ctx[key] = self._exe.prepare(run.program.desc, 0, list(run.keep + fetch), False)
        return ctx

    def execute(self, run: Run, scope: core._Scope, fetch: tuple[str, ...] = ()) -> None:
        ctx = self._ctx.get((run, fetch))  # the common case, every run after its first: nothing else to decide
        if ctx is None and run.program is None:
            return
        if ctx is None and is_pir_program(run.program):
            if self._pir is None:
                self._pir = PirRuns(self.place, self.scope)
            self._pir.execute(run, scope, fetch)
        else:
            self._exe.run_prepared_ctx(ctx if ctx is not None else self.prepare(run, fetch), scope, False, True, True)
        if self._cuda:  # kernels run on the device's own stream; values leave it only once they are done
            core._cuda_synchronize(self.place)

    def init_stage(self, stage: Stage) -> None:
        """Zero the stage's gradient buffers (after startup, and after a failed step)."""
        self.execute(stage.sections[INIT].run, self.scope)

    def put(self, scope: core._Scope, name: str, value: Any) -> None:
        """Give ``scope`` a received value: a tensor already on this place is shared, an array copied in."""
        if isinstance(value, np.ndarray):
            scope.var(name).get_tensor().set(value, self.place)
        else:
            scope.var(name).get_tensor()._share_data_with(value)

    # --- one step -----------------------------------------------------------------------------------
    def run_step(self, job: StepJob) -> StepResult:
        """Run the rank's actions for one step. A failure here aborts the channel at once, so that every
        other rank stops at its next receive, and is raised as the stage's ``StageError`` (Ctrl-C as it is)."""
        try:
            return self._run_step(job)
        except PipelineAborted:
            raise
        except BaseException as exc:
            job.channel.abort(str(exc) if isinstance(exc, StageError) else "interrupted")
            raise
        finally:  # the receivers of its last messages
            job.channel.wake()

    def _run_step(self, job: StepJob) -> StepResult:
        result = StepResult()
        program, record = job.program, job.record
        scopes: dict[tuple[int, int], core._Scope] = {}
        lane = lanes.current() if record is not None else None  # a rank's CPU leaves out its lane's others'
        cpu = time.thread_time() - lane.away_cpu() if lane is not None else 0.0
        try:
            for action, key, released in program.steps:
                started = time.perf_counter() if record is not None else 0.0
                try:  # errors.failing_as, written out: a context manager per action cost more than the rest
                    if key is None:
                        if action.kind is Kind.OPT:
                            group = program.optimizer_groups.get(action.stage)
                            if group is not None:  # the first of the rank's OPT actions runs them all
                                run_optimizers(self, job, group)
                        else:
                            self._compute_pair(job, action, [self._scope(scopes, h) for h in action.halves()], result)
                    else:
                        scope = scopes.get(key)
                        if scope is None:
                            scope = scopes[key] = self.borrow_scope()
                        kind = action.kind
                        if kind is Kind.RECV:
                            self._recv(job, action, scope)
                        elif kind is Kind.SEND:
                            self._send(job, action, scope)
                        else:
                            self._compute(job, action, scope, result)
                except PASSING_THROUGH:
                    raise
                except BaseException as exc:
                    raise StageError(action.stage, self.device, action, exc) from exc
                for done in released:
                    self._release(program, done, scopes.pop(done))
                if record is not None:  # the thread's CPU since the last record: the action and its upkeep
                    ended, spent = time.perf_counter(), time.thread_time() - lane.away_cpu()
                    record(action, started, ended, spent - cpu)
                    cpu = spent
        finally:  # a failed step leaves no half-used micro-batch scope behind
            for key, scope in scopes.items():
                self._release(program, key, scope)
        return result

    def _scope(self, scopes: dict[tuple[int, int], core._Scope], a: Action) -> core._Scope:
        """The scope of ``a``'s (stage, micro-batch), borrowed by its first action."""
        key = (a.stage, a.microbatch)
        if key not in scopes:
            scopes[key] = self.borrow_scope()
        return scopes[key]

    def _recv(self, job: StepJob, a: Action, scope: core._Scope) -> None:
        for name, value in job.channel.recv((a.route, a.microbatch), a.peer).items():
            self.put(scope, name, value)

    def _send(self, job: StepJob, a: Action, scope: core._Scope) -> None:
        route = job.plan.routes[a.route]
        dst, size = job.places[route.dst.stage], job.micro_batch_size
        message = {}
        for var in route.vars:
            tensor = tensor_of(scope, var.name, a)
            _check_cut(var, tensor, size)
            message[var.name] = tensor._copy(dst)
        job.channel.send((a.route, a.microbatch), message, a.peer)

    def _compute(self, job: StepJob, a: Action, scope: core._Scope, result: StepResult) -> None:
        stage, forward = a.stage, a.kind is Kind.F
        kind = FORWARD if forward else BACKWARD if a.kind is Kind.B else WEIGHT  # (a dict by Kind: hashed in Python)
        section = job.plan.stages[stage].sections[kind]
        if forward and section.feeds:
            place = self.place
            for name, value in job.feeds[stage][a.microbatch].items():
                scope.var(name).get_tensor().set(value, place)
        names = job.fetch.get((stage, kind), ())
        job.channel.wake()  # the messages sent before: their receivers wake as this thread leaves the GIL
        self.execute(section.run, scope, names)
        if forward:
            if job.check_forwards:
                loss = job.plan.producers.get(job.plan.loss)
                made = section.run.keep + names + ((job.plan.loss,) if loss is not None and loss.stage == stage else ())
                check_finite_values(section.run.program, scope, dict.fromkeys(made))
            self._hold(job, section, a.microbatch, scope)
        for name in names:
            result.fetched.setdefault(name, []).append(np.array(tensor_of(scope, name, a)))

    def _compute_pair(self, job: StepJob, pair: Action, scopes: list[core._Scope], result: StepResult) -> None:
        """An FB action: its F, then its B, each in its own micro-batch's scope. Back to back, since a
        CPU stage runs one section at a time; their messages were received before and go after. A
        failure names the pair and the stage of the half that failed."""
        for half, scope in zip(pair.halves(), scopes):
            with failing_as(half.stage, self.device, pair):
                self._compute(job, half, scope, result)

    def _hold(self, job: StepJob, forward: Section, microbatch: int, scope: core._Scope) -> None:
        """Count what ``forward`` left in ``scope`` for the backward in the stage's and the device's
        activation memory until the micro-batch's scope is released."""
        stage = forward.stage
        key = (forward, job.shapes[microbatch])
        held = self._settled.get(key)
        if held is None:
            held = self._held_bytes(job, key, scope)
        self._held[(stage, microbatch)] = held
        stats = self.memory.get(stage)
        if stats is None:  # (setdefault would build a MemoryStats on every forward)
            stats = self.memory[stage] = MemoryStats()
        stats.add(held, 1)
        self.device_memory.add(held, 1)
        if stats.step_value_bytes is None:  # once: their sizes are the parameters'
            stats.step_value_bytes = sum(tensor_bytes(self.scope, n) for n in job.plan.stages[stage].step_values)

    def _held_bytes(self, job: StepJob, key: tuple[Section, tuple], scope: core._Scope) -> int:
        """Bytes the forward of ``key`` (forward section, data shapes) left in ``scope`` for the backward.
        Why not always measured: it costs a few calls into Paddle per kept value (12 µs for 7 values), on
        the critical path of every forward. So for each set of data shapes (a sequence length may vary
        from batch to batch), the first ``MEASURED_STEPS`` steps' forwards are measured; if they all agree
        the size is settled (``_settled``, one look-up from then on), and a stage whose kept sizes vary at
        equal data shapes (ops whose output size depends on the values) is measured on every forward."""
        known, seen = self._sizes.get(key, (None, 0))
        held = sum(tensor_bytes(scope, n) for n in key[0].keep)
        known = held if known is None else known if held == known else VARYING
        self._sizes[key] = (known, seen + 1)
        if known != VARYING and seen + 1 >= MEASURED_STEPS * job.plan.num_microbatches:
            self._settled[key] = known
        return held

    def _release(self, program: RankProgram, key: tuple[int, int], scope: core._Scope) -> None:
        """Erase what the (stage, micro-batch) ``key`` left in its scope, so a reused scope can never serve
        stale values."""
        stage = key[0]
        held = self._held.pop(key, None)
        if held is not None:
            self.memory[stage].add(-held, -1)
            self.device_memory.add(-held, -1)
        self.return_scope(scope, program.leftovers[stage])

    def reset_memory(self) -> None:
        self.memory.clear()
        self.device_memory = MemoryStats()

    def close(self) -> None:
        """Free what this worker holds inside Paddle; the worker is unusable after it. The prepared contexts
        and PIR interpreters go first (they point into the scope), then the root scope, and with it every
        micro-batch scope under it (a scope owns its kids). Its thread must have stopped."""
        self._ctx.clear()
        self._pir = None
        self._free.clear()
        self._sizes.clear()
        self._settled.clear()
        self._held.clear()
        scope, self.scope = self.scope, None  # a later use fails in Python, not on freed memory
        free_scope(scope)

    def borrow_scope(self) -> core._Scope:
        """A scope under the device's for one micro-batch's (or one optimize section's) temporaries."""
        return self._free.pop() if self._free else self.scope.new_scope()

    def return_scope(self, scope: core._Scope, leftovers: Leftovers) -> None:
        """Take back a borrowed scope, letting go of ``leftovers``: a reused scope never serves a stale value."""
        leftovers.let_go(scope)
        self._free.append(scope)


VARYING = -1  # held bytes that differ between micro-batches: measured every time
MEASURED_STEPS = 2
# (Paddle dtype enum, its code) -> numpy name. Why keyed by int(dtype): Paddle's conversion costs microseconds,
# and so does hashing and comparing its enum (a cache keyed by it took 2 µs per message, this 1 µs); the enum's
# type too, as Paddle has two numberings (VarType, DataType)
_NUMPY_NAMES: dict[tuple[type, int], str] = {}


def _check_cut(var: CutVar, tensor: core.LoDTensor, micro_batch_size: int | None) -> None:
    """A cut variable must keep its compiled shape and dtype: a receiver in another process relies on it."""
    got = tuple(tensor.shape())
    want = var.shape_for(micro_batch_size)
    if got != want and (len(got) != len(want) or any(w not in (-1, g) for w, g in zip(want, got))):
        raise ValueError(f"cut variable '{var.name}' has shape {list(got)}, but the plan compiled "
                         f"{list(want)}")
    code = tensor._dtype()
    key = (type(code), int(code))
    dtype = _NUMPY_NAMES.get(key)
    if dtype is None:
        dtype = _NUMPY_NAMES[key] = np_dtype(code)
    if dtype != var.dtype:
        raise ValueError(f"cut variable '{var.name}' has dtype {dtype}, but the plan compiled {var.dtype}")
