"""The once-per-step phase of a rank: its optimize sections, run together, with their exchanges.

Each optimize section is a sequence of compute runs with the plan's exchanges between them (see
``rewrite/optimize_section.py``); a stage's walk through it is a coroutine that pauses wherever it must
wait: at a receive, or at a cross-stage sum that needs every stage's part.

Why every rank first waits for all the others (one all-reduce of a single number, before any update):
a step is all or nothing. If any stage's forward, backward or message failed, no stage may have applied
its update, or the next step would start from a half-updated model; the failed rank aborts the channel
and the others leave this barrier with ``PipelineAborted``. A failure inside the updates themselves comes
after the barrier: its ``StageError`` says that other stages may have applied theirs.

Why together: one rank may hold several stages (interleaved, ZB-V), run by this one thread. A
global-norm sum needs every stage's part, and a shared parameter's owner waits for the partial gradient
of a stage that may sit on the same rank: run one after the other, the first would wait forever for the
second. So exchanges between local stages are served locally, a cross-stage sum adds the local parts (in
stage order) and then goes once over the ranks, and only when no local stage can go on does the rank
wait for another rank.
"""
from __future__ import annotations

from typing import Any, Generator, Protocol

from .._paddle import core, np
from ..ir import tensor_of
from ..plan import SUM, Exchange, Run
from ..schedule.actions import OPT
from .channel import Channel
from .errors import PASSING_THROUGH, StageError, failing_as
from .jobs import Leftovers, StepJob
from .sharding import gather_parameters


class DeviceWorker(Protocol):
    """What the optimize phase uses of a device's worker (``worker.DeviceWorker``, which calls it): its
    device, place and root scope, a scope to borrow, and running a section's run in a scope."""

    device: str
    place: core.Place
    scope: core._Scope

    def borrow_scope(self) -> core._Scope: ...

    def return_scope(self, scope: core._Scope, leftovers: Leftovers) -> None: ...

    def execute(self, run: Run, scope: core._Scope, fetch: tuple[str, ...] = ()) -> None: ...

    def put(self, scope: core._Scope, name: str, value: Any) -> None: ...

UPDATE_FAILED = ("the step's forwards and backwards all succeeded, then this update failed: other stages may "
                 "have applied theirs, so the stages may now disagree; reload a checkpoint to go on")
Waiting = tuple[Exchange, "np.ndarray | None"]  # what a paused stage waits for, and its part of a sum


def run_optimizers(worker: DeviceWorker, job: StepJob, stages: tuple[int, ...]) -> None:
    """Run the optimize sections of this rank's ``stages`` together (module docstring)."""
    plan = job.plan
    rank = plan.stages[stages[0]].rank
    if stages[0] == job.program.first_optimizer and len(plan.ranks) > 1:  # every rank's forwards and backwards are done
        job.channel.allreduce(("opt", "ready"), rank, np.zeros(1, np.float32), len(plan.ranks))
    sent: set[int] = set()  # exchanges this rank's stages have sent this step
    walks = {s: _walk(worker, job, s, sent) for s in stages}
    waits: dict[int, Waiting] = {}

    def resume(stage: int, reply: Any = None) -> None:
        try:  # errors.failing_as, written out: a context manager costs more than the rest here
            waits[stage] = walks[stage].send(reply)
        except StopIteration:
            waits.pop(stage, None)
        except PASSING_THROUGH:
            raise
        except BaseException as exc:
            raise StageError(stage, worker.device, OPT(stage), exc, UPDATE_FAILED) from exc

    for stage in stages:
        resume(stage)
    while waits:
        receiver = next((s for s, (ex, _) in waits.items() if ex.kind != SUM and ex.index in sent), None)
        sums = {ex.index for ex, _ in waits.values() if ex.kind == SUM}
        if receiver is None and len(sums) == 1 and all(ex.kind == SUM for ex, _ in waits.values()):
            parts = [waits[s][1] for s in sorted(waits)]
            total = job.channel.allreduce(("opt", sums.pop()), rank, sum(parts[1:], parts[0].copy()),
                                          len(plan.ranks))
            for stage in sorted(waits):
                resume(stage, total)
            continue
        if receiver is None:  # nothing left to do here: wait for another rank
            receiver = next((s for s, (ex, _) in waits.items() if ex.kind != SUM
                             and plan.stages[ex.src].rank != rank), None)
            if receiver is None:
                raise RuntimeError(f"the optimize sections of stages {list(stages)} wait for each other: "
                                   f"{ {s: str(ex) for s, (ex, _) in waits.items()} }")
        ex = waits[receiver][0]
        resume(receiver, job.channel.recv(("opt", ex.index), ex.src))
    if job.channel.sharding > 1:  # ZeRO-1: each shard's new values
        with failing_as(stages[0], worker.device, OPT(stages[0]), UPDATE_FAILED):
            gather_parameters(worker.scope, worker.place, job.channel, plan, stages)


def _walk(worker: DeviceWorker, job: StepJob, stage: int, sent: set[int]) -> Generator[Waiting, Any, None]:
    """Stage ``stage``'s optimize section, run by run. Sends go out at once (and into ``sent``); at a
    receive it yields (the exchange, None) and is resumed with the message, at a sum it yields (the
    exchange, its part) and is resumed with the total.

    Its temporaries live in a scope of its own under the device's: two stages of one device compute
    values of the same names (a clip's norm, AMP's overflow flag) and run in turns, so in one scope the
    first to finish would free what the other still reads. Persistables resolve to the device's scope."""
    plan = job.plan
    section = plan.stages[stage].optimize_section(job.channel.shard)
    if job.channel.replicas > 1:
        _average_replicas(worker, job.channel, plan.stages[stage].grad_buffers)
    scope = worker.borrow_scope()
    try:
        for k, run in enumerate(section.runs):
            job.channel.wake()
            worker.execute(run, scope)
            if k == len(section.exchanges):
                return
            ex = plan.exchanges[section.exchanges[k]]
            if ex.kind == SUM:
                total = yield ex, np.array(tensor_of(scope, ex.vars[0].name, OPT(stage)))
                scope.var(ex.recv_as[0]).get_tensor().set(total, worker.place)
            elif ex.src == stage:
                job.channel.send(("opt", ex.index), {v.name: tensor_of(scope, v.name, OPT(stage))._copy(
                    job.places[ex.dst]) for v in ex.vars}, ex.dst)
                sent.add(ex.index)
            else:
                message = yield ex, None
                for var, name in zip(ex.vars, ex.recv_as):
                    # a shared parameter's new value is state (the device's scope), a partial gradient is not
                    worker.put(worker.scope if name in plan.stages[stage].persistables else scope, name,
                               message[var.name])
    finally:
        worker.return_scope(scope, job.program.optimize_leftovers[stage])


def _average_replicas(worker: DeviceWorker, channel: Channel, buffers: tuple[str, ...]) -> None:
    """Data parallelism: replace each accumulated gradient by its mean over the replicas, so that every
    replica applies the gradient of the whole global batch. One all-reduce per dtype, over the
    buffers flattened together: a message per buffer would cost a round trip each."""
    scope: core._Scope = worker.scope
    values = {n: np.array(tensor_of(scope, n, "OPT")) for n in buffers}
    for dtype in sorted({v.dtype.str for v in values.values()}):
        names = [n for n, v in values.items() if v.dtype.str == dtype]
        flat = channel.replica_mean(np.concatenate([values[n].ravel() for n in names]))
        offset = 0
        for n in names:
            size = values[n].size
            scope.var(n).get_tensor().set(flat[offset:offset + size].reshape(values[n].shape), worker.place)
            offset += size
