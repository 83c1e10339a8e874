"""This process's devices: a worker with its root scope and place for each, the threads (lanes) that run
them, and the channels between them.

Why threads: Paddle's executor releases the GIL while it runs ops, so stage workers on threads of
their own overlap the way stages on their own GPUs do. CPU ranks may share fewer threads (``lanes.py``:
a rank gives way to its lane's others where it would wait): a message between threads costs a wake-up,
29 µs of CPU per message on a 2-core VM (11 on one core, 4 inside a lane), which tiny stages feel,
while large stages step fastest on a thread each (on 2 cores a 4-stage pipeline of large layers steps
1.7x slower on one thread). How many: ``worker_threads``, by default chosen per plan by trying each
layout on its first steps (``thread_choice.py``; ``bench/worker_threads.py``, ``bench/overhead.py``).
A GPU rank keeps a thread of its own. In a job started by a launcher (``placement.launched_world``)
the process joins the ``paddle.distributed`` job, starts the fault watchdog, runs only its own rank's
stages, and talks to the other ranks through a ``DistributedChannel`` per stage layout.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import queue
import threading
import time
import weakref
from typing import Any, Callable

from .._paddle import core, paddle
from ..capabilities import bf16_kernel_op, require_bf16
from ..placement import device_map, generic_place, launched_world, place_of
from ..plan import Plan, Stage
from . import lanes, watchdog
from .channel import Channel, InProcessChannel
from .distributed import DistributedChannel, init_distributed
from .worker import DeviceWorker


class Devices:
    """Workers of this process, created on first use; ``threads_per_stage``: each CPU worker's intra-op
    thread budget, one number or ``{device: threads}`` (devices not named get 1); ``mapping``: the
    device that runs each pipeline device it names (``placement.device_map``); ``worker_threads``: how
    many threads run the CPU ranks: a number, None (one per rank) or "auto" (the default: the step runner
    tries the layouts, ``thread_choice.py``)."""

    def __init__(self, threads_per_stage: int | dict[str, int] = 1, mapping: dict[str, str] | None = None,
                 worker_threads: int | str | None = "auto"):
        budgets = threads_per_stage.values() if isinstance(threads_per_stage, dict) else [threads_per_stage]
        if not all(_count(n) for n in budgets):
            raise ValueError("threads_per_stage must be an integer >= 1 or a dict device -> integer >= 1, "
                             f"got {threads_per_stage!r}")
        if not (worker_threads is None or isinstance(worker_threads, str) and worker_threads == "auto"
                or _count(worker_threads)):
            raise ValueError('worker_threads must be "auto" (tried on the first steps), None (one per rank) or '
                             f"an integer >= 1, got {worker_threads!r}")
        self.threads_per_stage = threads_per_stage
        self.worker_threads = worker_threads
        self.device_map = device_map(mapping)
        self.workers: dict[str, DeviceWorker] = {}
        self._threads: dict[str, StageThread] = {}
        self._lanes: dict[tuple, list[list[int]]] = {}  # see lanes_of
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

    def lanes_of(self, devices: list[str], threads: int | None) -> list[list[int]]:
        """Which ranks (positions in ``devices``, one device per rank, in rank order) each thread runs: the
        shareable ranks (``shareable``) in ``threads`` groups of consecutive ranks (a message inside a group
        costs no wake-up, and pipeline neighbours share a group), or each alone for None; every other rank
        alone. Worked out once per list of devices and number."""
        key = (tuple(devices), threads)
        if key not in self._lanes:
            cpu = self.shareable(devices)
            n = min(len(cpu), threads or len(cpu))
            groups = [cpu[k * len(cpu) // n:(k + 1) * len(cpu) // n] for k in range(n)]
            self._lanes[key] = sorted(groups + [[i] for i in range(len(devices)) if i not in cpu])
        return self._lanes[key]

    def shareable(self, devices: list[str]) -> list[int]:
        """The ranks (positions in ``devices``) that may share a thread: the CPU ones. A GPU rank keeps a
        thread of its own, and so does every rank of a launched job (its channel blocks its thread)."""
        if self.world is not None:
            return []
        return [i for i, d in enumerate(devices) if isinstance(self.place_of(d), core.CPUPlace)]

    def run_lane(self, devices: list[str], jobs: list[Any], channel: Channel) -> tuple[list[lanes.Outcome], float]:
        """Run each device's worker's step on its job, all on the calling thread (a ``Lane``), each rank
        with its device's intra-op thread budget; their outcomes, in order, and the thread's CPU seconds
        (what the trial of thread layouts bounds other layouts by). An interrupt or error outside the
        ranks' own steps aborts the channel, so that the other lanes stop too."""
        cpu = time.thread_time()
        try:
            budgets = [self._budget(d) for d in devices]
            core.set_num_threads(budgets[0])  # 0.5 µs, and the caller may have changed it since
            calls = [(functools.partial(self.worker(d).run_step, job),
                      functools.partial(core.set_num_threads, b) if len(set(budgets)) > 1 else _nothing)
                     for d, job, b in zip(devices, jobs, budgets)]
            lane = lanes.Lane(timed=any(job.record is not None for job in jobs))  # a traced step's
            return lane.run(calls, lambda: channel.abort("interrupted")), time.thread_time() - cpu
        except BaseException as exc:  # before or between its ranks: the other lanes must not wait for them
            channel.abort(str(exc) if isinstance(exc, Exception) else "interrupted")
            raise

    def submit(self, devices: list[str], future: cf.Future, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread of the lane of ``devices``, its outcome set on ``future``. The
        caller makes the future and keeps it before the hand-off: an interrupt anywhere in here leaves it a
        future that is either cancellable (not started, maybe never queued) or running (``StepRunner``
        relies on it)."""
        name = "+".join(devices)
        thread = self._threads.get(name)
        if thread is None:
            thread = self._threads[name] = StageThread(f"staticpipe-{name}")
        thread.submit(future, fn, args)

    def retire_threads(self, layout: list[list[str]]) -> None:
        """Stop the worker threads that run no lane of ``layout`` (each lane a list of devices): those of
        thread layouts a trial passed over, idle for good (with ``threads_per_stage`` > 1 each holds an
        OpenMP team). A later step that needs one starts it again."""
        kept = {"+".join(lane) for lane in layout}
        for name in [n for n in self._threads if n not in kept]:
            self._threads.pop(name).stop()

    def _budget(self, device: str) -> int:
        budget = self.threads_per_stage
        return budget.get(device, 1) if isinstance(budget, dict) else budget

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
        layout = (tuple(s.rank for s in plan.stages), tuple(plan.ranks), plan.sharding_degree)
        channel = self._channels.get(layout)
        if channel is None:
            pipeline = len(plan.ranks)
            channel = self._channels[layout] = DistributedChannel([s.rank for s in plan.stages], pipeline,
                                                                  plan.sharding_degree)
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

    def __init__(self, name: str):
        calls: queue.SimpleQueue = queue.SimpleQueue()
        self._calls = calls
        self._end = weakref.finalize(self, calls.put, None)
        self._thread = threading.Thread(target=_serve, args=(calls,), name=name, daemon=True)
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


def _serve(calls: queue.SimpleQueue) -> None:
    """A ``StageThread``'s loop (a function, not a method: the thread must not keep its object alive)."""
    ready = False
    while (call := calls.get()) is not None:
        future, fn, args = call
        del call
        if future.set_running_or_notify_cancel():  # else cancelled by a step that was interrupted
            try:
                if not ready:  # Paddle's static/dygraph mode is thread-local: a new thread enters it itself
                    paddle.enable_static()
                    ready = True
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 -- the step raises it
                future.set_exception(exc)
        del future, fn, args  # a finished step's data is not kept until the next one


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _nothing() -> None:
    """A lane whose ranks share one intra-op budget sets it once, not at every switch."""
