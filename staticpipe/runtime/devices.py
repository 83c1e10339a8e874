"""This process's devices: a worker with its root scope, place and thread for each, and the channels
between them.

Why a thread per device: Paddle's executor releases the GIL while it runs ops, so stage workers on
their own threads overlap the way stages on their own GPUs do; each thread's intra-op budget is set once
when it starts. In a job started by a launcher (``placement.launched_world``) the process joins the
``paddle.distributed`` job, starts the fault watchdog, runs only its own rank's stages, and talks to the
other ranks through a ``DistributedChannel`` per stage layout.
"""
from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import weakref
from typing import Any, Callable

from .._paddle import core, paddle
from ..capabilities import bf16_kernel_op, require_bf16
from ..placement import device_map, generic_place, launched_world, place_of
from ..plan import Plan, Stage
from . import watchdog
from .channel import Channel, InProcessChannel
from .distributed import DistributedChannel, init_distributed
from .worker import DeviceWorker


class Devices:
    """Workers of this process, created on first use; ``threads_per_stage``: each CPU worker's intra-op
    thread budget, one number or ``{device: threads}`` (devices not named get 1); ``mapping``: the
    device that runs each pipeline device it names (``placement.device_map``)."""

    def __init__(self, threads_per_stage: int | dict[str, int] = 1, mapping: dict[str, str] | None = None):
        budgets = threads_per_stage.values() if isinstance(threads_per_stage, dict) else [threads_per_stage]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in budgets):
            raise ValueError("threads_per_stage must be an integer >= 1 or a dict device -> integer >= 1, "
                             f"got {threads_per_stage!r}")
        self.threads_per_stage = threads_per_stage
        self.device_map = device_map(mapping)
        self.workers: dict[str, DeviceWorker] = {}
        self._threads: dict[str, StageThread] = {}
        self._in_process: Channel = InProcessChannel()
        self._channels: dict[tuple, Channel] = {}
        self.world = launched_world()  # (rank, size) when started by a multi-process launcher
        self.watchdog: watchdog.Watchdog | None = None  # stops this process when another rank fails
        if self.world is not None:
            init_distributed()
            self.watchdog = watchdog.start(*self.world)

    def place_of(self, device: str) -> core.Place:
        """The place of pipeline device ``device``: where the device map sends it, else its own."""
        return place_of(self.device_map.get(device, device), launched=self.world is not None)

    def worker(self, device: str) -> DeviceWorker:
        w = self.workers.get(device)
        if w is None:
            place = self.place_of(device)
            w = self.workers[device] = DeviceWorker(device, place, core.Scope(), generic_place(place))
        return w

    def submit(self, device: str, future: cf.Future, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on ``device``'s worker thread, its outcome set on ``future``. The caller makes
        the future and keeps it before the hand-off: an interrupt anywhere in here leaves it a future that
        is either cancellable (not started, maybe never queued) or running (``StepRunner`` relies on it)."""
        thread = self._threads.get(device)
        if thread is None:
            budget = self.threads_per_stage
            thread = self._threads[device] = StageThread(
                f"staticpipe-{device}", budget.get(device, 1) if isinstance(budget, dict) else budget)
        thread.submit(future, fn, args)

    def run_here(self, device: str, job: Any) -> Any:
        """Run ``device``'s worker's step on the calling thread, with the device's intra-op thread budget
        (set every time: 0.5 µs, and the caller may have changed it since)."""
        budget = self.threads_per_stage
        core.set_num_threads(budget.get(device, 1) if isinstance(budget, dict) else budget)
        return self.worker(device).run_step(job)

    def local_stages(self, plan: Plan) -> list[Stage]:
        """The stages this process runs: all of them, or its rank's when launched as several processes."""
        stages = plan.stages_of_process(self.world)
        unloaded = [s.index for s in stages if not s.loaded]
        if unloaded:
            raise ValueError(f"this process runs stages {[s.index for s in stages]}, but the section programs of "
                             f"stages {unloaded} were not loaded (staticpipe.load_plan(..., stages=...))")
        return stages

    def runnable_stages(self, plan: Plan) -> list[Stage]:
        """``local_stages``, each checked before it first runs: a stage whose programs run bfloat16 kernels
        on a CPU that cannot (``capabilities.require_bf16``) is refused here, where its place is
        known (the device map may have moved it; a saved plan may come from another machine)."""
        stages = self.local_stages(plan)
        for stage in stages:
            found = next(filter(None, (bf16_kernel_op(p) for s in stage.sections.values() for p in s.programs)), None)
            if found:
                require_bf16(stage.device, self.place_of(stage.device), f"stage {stage.index}'s {found[1]}")
        return stages

    def channel_for(self, plan: Plan) -> Channel:
        if self.world is None:
            return self._in_process
        # one channel per layout, not per plan: an evaluation plan on the same stages reuses the training
        # plan's process groups instead of making (and rendezvousing) them all again
        layout = (tuple(s.rank for s in plan.stages), tuple(plan.ranks))
        channel = self._channels.get(layout)
        if channel is None:
            pipeline = len(plan.ranks)
            channel = self._channels[layout] = DistributedChannel([s.rank for s in plan.stages], pipeline)
        channel.connect(plan.rank_pairs())  # a no-op once the layout's groups cover this plan's messages
        return channel

    def close(self) -> None:
        """Stop the worker threads, then free each worker's scopes and prepared runs (``DeviceWorker.close``:
        Paddle keeps a root scope until it is freed explicitly, whatever Python drops)."""
        for thread in self._threads.values():
            thread.stop()
        self._threads.clear()
        workers, self.workers = list(self.workers.values()), {}
        for worker in workers:
            worker.close()


class StageThread:
    """A device's worker thread: runs the calls handed to it one at a time, in order.

    Why not ``concurrent.futures.ThreadPoolExecutor``: it starts its thread inside ``submit``, after
    queueing the call, and waits there until the new thread runs -- seconds on a loaded machine. A Ctrl-C
    in that wait escaped ``submit`` with the call queued and its future never returned, so nothing
    stopped the call (a stage waiting in ``recv`` for a step that had ended), and with the started thread
    unknown to the pool, so ``Executor.close()`` joined nothing while interpreter exit joined that thread
    for ever (not a daemon). Here the thread starts before anything is queued, is a daemon, and ends when
    its object goes (an interrupt between its start and the caller keeping it leaves no thread behind);
    the caller makes each call's future and keeps it before the hand-off.
    """

    def __init__(self, name: str, intra_op_threads: int):
        calls: queue.SimpleQueue = queue.SimpleQueue()
        self._calls = calls
        self._end = weakref.finalize(self, calls.put, None)
        self._thread = threading.Thread(target=_serve, args=(calls, intra_op_threads), name=name, daemon=True)
        try:
            self._thread.start()
        except BaseException:  # interrupted: if it started after all, it ends at once
            self._end()
            raise

    def submit(self, future: cf.Future, fn: Callable[..., Any], args: tuple) -> None:
        self._calls.put((future, fn, args))

    def stop(self) -> None:
        """End the thread once the calls queued before have run."""
        self._end()
        self._thread.join()


def _serve(calls: queue.SimpleQueue, intra_op_threads: int) -> None:
    """A ``StageThread``'s loop (a function, not a method: the thread must not keep its object alive)."""
    ready = False
    while (call := calls.get()) is not None:
        future, fn, args = call
        del call
        if future.set_running_or_notify_cancel():  # else cancelled by a step that was interrupted
            try:
                if not ready:  # Paddle's static/dygraph mode is thread-local: a new thread enters it itself
                    paddle.enable_static()
                    core.set_num_threads(intra_op_threads)
                    ready = True
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 -- the step raises it
                future.set_exception(exc)
        del future, fn, args  # a finished step's data is not kept until the next one
