"""Fault injection into the staticpipe runtime: make one action of one step raise.

Used by ``tests/test_fault_matrix.py`` in the test process and, imported from ``tests/``, inside the
scripts it launches as several processes. The seams are the runtime's own per-action calls:

- ``DeviceWorker._compute`` (F, B, W), ``DeviceWorker._compute_pair`` (a paired FB, DualPipeV's),
  ``DeviceWorker._send`` (SEND) and ``DeviceWorker._recv`` (RECV): the worker wraps whatever they raise
  into the stage's ``StageError`` (``runtime/worker.py``);
- ``optimize_phase._walk`` (OPT): one stage's walk through its optimize section, resumed by
  ``run_optimizers``, which wraps what it raises into ``StageError(stage, ..., OPT(stage))``. (Patching
  ``run_optimizers`` itself would blame the first stage of a rank's group of OPT actions.)

The action whose text is the target (``"1B2"``, ``"0SEND_F3>1"``, ``"1OPT"``) raises
``InjectedFault("injected fault at 1B2")`` instead of running.

``quiesce=True`` (one process only) makes the failure deterministic: before raising, the failing action
waits until every other rank of the step has finished its actions or is blocked in a receive whose
message has not been sent (they got as far as they can without the failing rank). Without it, whether
another rank has already reached its optimizer update when the abort arrives is a race.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import greenlet

from models import build_mlp
from pipeline_util import minimize
from staticpipe._paddle import paddle
from staticpipe.runtime import channel as channel_mod
from staticpipe.runtime import optimize_phase, worker
from staticpipe.schedule import Action, Kind

QUIESCE_TIMEOUT_S = 5.0
MICROBATCHES = 4
# schedule -> the stage devices of its MLP: two devices; interleaved and the V's hold two stages on each
SCHEDULES = {
    "F-then-B": ["gpu:0", "gpu:1"],
    "1F1B": ["gpu:0", "gpu:1"],
    "interleaved": ["gpu:0", "gpu:1", "gpu:0", "gpu:1"],
    "ZB-H1": ["gpu:0", "gpu:1"],
    "ZB-V": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "V-Min": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "V-Half": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "ZB-2P": ["gpu:0", "gpu:1"],
    "Eager1F1B": ["gpu:0", "gpu:1"],
    "DualPipeV": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
}


def build_pipeline(schedule: str):
    """A small MLP (in 8, hidden 16, 4 layers) pipelined on two devices with ``schedule``, Momentum."""
    devices = SCHEDULES[schedule]
    net = build_mlp(num_stages=len(devices), stage_devices=devices, in_dim=8, hidden=16, depth=4)
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9),
             dict(num_microbatches=MICROBATCHES, schedule=schedule))
    return net


class InjectedFault(RuntimeError):
    """The error an injected action raises."""


class _Tracker:
    """Which device workers are in a step, and which of them wait for a message not yet sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}  # device -> number of run_step calls in progress (0: done)
        self.waiting: dict[str, tuple] = {}  # device -> (channel, key) it is blocked on

    def stuck(self, device: str) -> bool:
        ch, key = self.waiting[device]
        with ch._lock:
            if key[0] == "allreduce":  # the barrier before the updates: stuck until every rank is in it
                total = ch._sums.get(key[1])
                return (total is None or total.result is None) and ch._aborted is None
            return key not in ch._box and ch._aborted is None

    def quiet(self, me: str, devices: tuple[str, ...]) -> bool:
        """Every device of ``devices`` but ``me`` has left its step or waits for a message not yet sent."""
        with self.lock:
            for device in devices:
                if device == me:
                    continue
                if device not in self.running:  # not started yet
                    return False
                if self.running[device] and not (device in self.waiting and self.stuck(device)):
                    return False
            return True


@contextlib.contextmanager
def inject(target: str, quiesce: bool = False) -> Iterator[_Tracker]:
    """Within the block, the action whose text is ``target`` ("1B2", "0SEND_F3>1", "1OPT") raises
    ``InjectedFault`` (with ``quiesce``: once the other ranks went as far as they can). Yields the tracker:
    ``running[device]`` is 0 once that device's ``run_step`` has returned."""
    tracker = _Tracker()
    W = worker.DeviceWorker
    saved = {name: getattr(W, name) for name in ("_compute", "_compute_pair", "_send", "_recv", "run_step")}
    saved_walk = optimize_phase._walk
    saved_recv = channel_mod.InProcessChannel.recv
    saved_allreduce = channel_mod.InProcessChannel.allreduce
    device_of_rank: dict[greenlet.greenlet, str] = {}  # a rank's greenlet (its thread's, alone on it) -> device

    def fail(device: str, job, label: str) -> None:
        if quiesce:
            deadline = time.monotonic() + QUIESCE_TIMEOUT_S
            while not tracker.quiet(device, tuple(job.plan.ranks)) and time.monotonic() < deadline:
                time.sleep(0.001)
        raise InjectedFault(f"injected fault at {label}")

    def patched(name: str):
        original = saved[name]

        def action(self, job, a, *rest):
            if str(a) == target:
                fail(self.device, job, str(a))
            return original(self, job, a, *rest)
        return action

    def walk(worker_, job, stage, sent):
        if target == f"{stage}OPT":
            fail(worker_.device, job, f"{stage}OPT")
        return (yield from saved_walk(worker_, job, stage, sent))

    def run_step(self, job):
        me = greenlet.getcurrent()
        device_of_rank[me] = self.device
        with tracker.lock:
            tracker.running[self.device] = tracker.running.get(self.device, 0) + 1
        try:
            return saved["run_step"](self, job)
        finally:
            with tracker.lock:
                tracker.running[self.device] -= 1
            device_of_rank.pop(me, None)

    def waits(original, wait_key):
        def call(self, key, *rest):
            device = device_of_rank.get(greenlet.getcurrent())
            if device is not None:
                with tracker.lock:
                    tracker.waiting[device] = (self, wait_key(key))
            try:
                return original(self, key, *rest)
            finally:
                if device is not None:
                    with tracker.lock:
                        tracker.waiting.pop(device, None)
        return call

    for name in ("_compute", "_compute_pair", "_send", "_recv"):
        setattr(W, name, patched(name))
    W.run_step = run_step
    optimize_phase._walk = walk
    channel_mod.InProcessChannel.recv = waits(saved_recv, lambda key: key)
    channel_mod.InProcessChannel.allreduce = waits(saved_allreduce, lambda key: ("allreduce", key))
    try:
        yield tracker
    finally:
        for name, fn in saved.items():
            setattr(W, name, fn)
        optimize_phase._walk = saved_walk
        channel_mod.InProcessChannel.recv = saved_recv
        channel_mod.InProcessChannel.allreduce = saved_allreduce


def targets(actions: dict[int, list[Action]], microbatches: tuple[int, ...]) -> list[Action]:
    """The actions of ``actions`` at the given micro-batches, and every OPT: each (stage, kind, channel)
    the schedule holds, at each of those micro-batches."""
    return [a for acts in actions.values() for a in acts if a.microbatch is None or a.microbatch in microbatches]


def updated_before(actions: dict[int, list[Action]], target: str) -> list[int]:
    """The stages whose OPT action runs although ``target`` fails, when every rank goes as far as it can
    without the failing rank (``quiesce``): a dry run of the action lists in which a RECV waits for its
    SEND, no OPT runs before every rank has reached its first OPT (the runtime's barrier: a step is all or
    nothing up to the updates), and the failing rank stops at ``target``. (An OPT is taken to need nothing
    from another rank: true of optimize sections without exchanges, no shared parameters and no global-norm
    clipping, as here.)"""
    pos = {rank: 0 for rank in actions}
    sent: set[tuple] = set()
    stopped: set[int] = set()
    done: list[int] = []
    progress = True
    while progress:
        progress = False
        for rank, acts in actions.items():
            while rank not in stopped and pos[rank] < len(acts):
                a = acts[pos[rank]]
                if str(a) == target:
                    stopped.add(rank)
                    break
                if a.kind is Kind.RECV and (a.route, a.microbatch) not in sent:
                    break
                if a.kind is Kind.OPT and not all(
                        any(b.kind is Kind.OPT for b in other[:pos[r] + 1]) for r, other in actions.items()):
                    break  # the barrier: some rank has not reached its updates
                if a.kind is Kind.SEND:
                    sent.add((a.route, a.microbatch))
                if a.kind is Kind.OPT:
                    done.append(a.stage)
                pos[rank] += 1
                progress = True
    return sorted(done)
