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
from typing import Any, Callable

from .._paddle import core, paddle
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
        self._threads: dict[str, cf.ThreadPoolExecutor] = {}
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
            budget = self.threads_per_stage
            if isinstance(budget, dict):
                budget = budget.get(device, 1)
            self._threads[device] = cf.ThreadPoolExecutor(
                1, thread_name_prefix=f"staticpipe-{device}", initializer=_init_worker_thread, initargs=(budget,))
        return w

    def submit(self, device: str, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` on ``device``'s worker thread."""
        self.worker(device)
        return self._threads[device].submit(fn, *args)

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

    def channel_for(self, plan: Plan) -> Channel:
        if self.world is None:
            return self._in_process
        # one channel per layout, not per plan: an evaluation plan on the same stages reuses the training
        # plan's process groups instead of making (and rendezvousing) them all again
        layout = (tuple(s.rank for s in plan.stages), tuple(plan.ranks))
        channel = self._channels.get(layout)
        if channel is None:
            pipeline = len(plan.ranks)
            channel = self._channels[layout] = DistributedChannel(
                [s.rank for s in plan.stages], pipeline, self.place_of(plan.ranks[self.world[0] % pipeline]))
        channel.connect(plan.rank_pairs())  # a no-op once the layout's groups cover this plan's messages
        return channel

    def close(self) -> None:
        for pool in self._threads.values():
            pool.shutdown(wait=True)
        self._threads.clear()
        self.workers.clear()


def _init_worker_thread(threads: int) -> None:
    """Paddle's static/dygraph mode is thread-local: a new thread must enter static mode itself."""
    paddle.enable_static()
    core.set_num_threads(threads)
