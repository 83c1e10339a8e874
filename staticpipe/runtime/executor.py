"""``staticpipe.Executor``: runs startup programs, unsplit programs and pipelined training steps.

One ``DeviceWorker`` per device, each with its own root scope, place and worker thread (whose intra-op
thread budget is set once). A training step splits the batch into micro-batches, hands every worker its
action list, and waits; the first stage to fail aborts the channel so that every other worker stops at
its next receive, and the step raises that stage's error.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import shutil
import time
from typing import Any, Sequence

from .. import checkpoint
from .._paddle import core, framework, np, paddle
from ..io import FeedSpec, split_microbatches
from ..plan import FORWARD, PLAN_ATTR, Plan, plan_of
from ..rewrite import FORWARD_ONLY, build_forward_plan, clear_device_tags
from .channel import Channel, InProcessChannel, PipelineAborted
from .distributed import DistributedChannel, init_distributed, launched_world
from . import watchdog
from .places import place_of
from .progress import Progress
from ..trace import Timeline
from .worker import DeviceWorker, StageError, StepJob, StepResult

log = logging.getLogger("staticpipe")
def _names(fetch_list: Sequence | None) -> list[str]:
    return [v if isinstance(v, str) else v.name for v in (fetch_list or [])]


class Executor:
    """Pipeline executor with the calls of ``paddle.static.Executor`` that training needs.

    ``place`` is where unsplit programs run (default: GPU 0 with CUDA, else CPU). ``threads_per_stage``
    is each CPU stage worker's intra-op thread budget: one number for all, or ``{device: threads}``
    (devices not named get 1). ``trace`` records the start and end of every action; ``timeline``
    returns the last step's.
    """

    def __init__(self, place: Any = None, threads_per_stage: int | dict[str, int] = 1, trace: bool = False):
        budgets = threads_per_stage.values() if isinstance(threads_per_stage, dict) else [threads_per_stage]
        if not all(isinstance(n, int) and n >= 1 for n in budgets):
            raise ValueError("threads_per_stage must be an integer >= 1 or a dict device -> integer >= 1, "
                             f"got {threads_per_stage!r}")
        self.place = place if place is not None else place_of("gpu:0")
        self.threads_per_stage = threads_per_stage
        self._plain = paddle.static.Executor(self.place)
        self._plain_scope = core.Scope()
        self._workers: dict[str, DeviceWorker] = {}
        self._threads: dict[str, cf.ThreadPoolExecutor] = {}
        self._channel: Channel = InProcessChannel()
        self._world = launched_world()  # (rank, size) when started by a multi-process launcher
        self._watchdog: watchdog.Watchdog | None = None  # stops this process when another rank fails
        if self._world is not None:
            init_distributed()
            self._watchdog = watchdog.start(*self._world)
        self._channels: dict[tuple, Channel] = {}
        self.trace = trace
        self.global_step = 0  # training steps run (restored by staticpipe.load)
        self._records: list[tuple] = []  # (action, start, end) of the last step, when tracing

    # --- devices ------------------------------------------------------------------------------------
    def worker(self, device: str) -> DeviceWorker:
        w = self._workers.get(device)
        if w is None:
            w = self._workers[device] = DeviceWorker(device, self._place_of(device), core.Scope())
            budget = self.threads_per_stage
            if isinstance(budget, dict):
                budget = budget.get(device, 1)
            self._threads[device] = cf.ThreadPoolExecutor(
                1, thread_name_prefix=f"staticpipe-{device}", initializer=_init_worker_thread, initargs=(budget,))
        return w

    def _place_of(self, device: str) -> core.Place:
        return place_of(device, launched=self._world is not None)

    def local_stages(self, plan: Plan) -> list:
        """The stages this process runs: all of them, or its rank's when launched as several processes."""
        stages = stages_of_process(plan, self._world)
        unloaded = [s.index for s in stages if not s.loaded]
        if unloaded:
            raise ValueError(f"this process runs stages {[s.index for s in stages]}, but the section programs of "
                             f"stages {unloaded} were not loaded (staticpipe.load_plan(..., stages=...))")
        return stages

    def _channel_for(self, plan: Plan) -> Channel:
        if self._world is None:
            return self._channel
        # one channel per layout, not per plan: an evaluation plan on the same stages reuses the training
        # plan's process groups instead of making (and rendezvousing) them all again
        layout = (tuple(s.rank for s in plan.stages), tuple(plan.ranks))
        channel = self._channels.get(layout)
        if channel is None:
            pipeline = len(plan.ranks)
            channel = self._channels[layout] = DistributedChannel(
                [s.rank for s in plan.stages], pipeline, self._place_of(plan.ranks[self._world[0] % pipeline]))
        return channel

    def scope_of(self, device: str) -> core._Scope:
        """The root scope holding the parameters and optimizer state of the stages on ``device``."""
        return self.worker(device).scope

    def close(self) -> None:
        for pool in self._threads.values():
            pool.shutdown(wait=True)
        self._threads.clear()
        self._workers.clear()

    # --- run ----------------------------------------------------------------------------------------
    def run(self, program: framework.Program | None = None, feed: dict | None = None,
            fetch_list: Sequence | None = None, return_numpy: bool = True) -> list:
        """Run ``program`` once.

        - a startup program of a pipelined program: initialise once on the host, then give each stage
          its parameters and state on its own place;
        - a pipelined main program: one training step on the global batch ``feed``;
        - any other program: plain Paddle execution on ``place``, with the parameters and state the
          stages hold (so an evaluation clone of a pipelined program sees the trained values).
        """
        program = program if program is not None else paddle.static.default_main_program()
        plan = plan_of(program)
        if plan is not None and getattr(program, "_staticpipe_is_startup", False):
            self._run_startup(program, plan)
            return []
        if plan is not None:
            self._set_learning_rate(program, plan)
            return self._step(plan, feed or {}, _names(fetch_list))
        self._gather_state(program)
        return self._plain.run(program, feed=feed, fetch_list=fetch_list, scope=self._plain_scope,
                               return_numpy=return_numpy)

    def _gather_state(self, program: framework.Program) -> None:
        """Copy the trained values the stages hold into the scope of unsplit runs, so that a program
        without a plan (an evaluation clone, ``main.clone(for_test=True)``) sees the current state."""
        for var in program.list_vars():
            if not var.persistable:
                continue
            for worker in self._workers.values():
                found = worker.scope.find_var(var.name)
                if found is not None and found.get_tensor()._is_initialized():
                    self._plain_scope.var(var.name).get_tensor().set(np.array(found.get_tensor()), self.place)
                    break

    def _run_startup(self, startup: framework.Program, plan: Plan) -> None:
        host = core.Scope()
        paddle.static.Executor(core.CPUPlace()).run(_on_host(startup), scope=host)
        for stage in self.local_stages(plan):
            worker = self.worker(stage.device)
            for name in stage.persistables:
                var = host.find_var(name)
                if var is not None and var.get_tensor()._is_initialized():
                    worker.scope.var(name).get_tensor().set(np.array(var.get_tensor()), worker.place)
            worker.init_stage(plan, stage.index)

    # --- training -----------------------------------------------------------------------------------
    def _set_learning_rate(self, program: framework.Program, plan: Plan) -> None:
        """Give every stage the scheduler's current learning rate, as Paddle's executor does before each
        run; the scheduler advances only when ``step()`` is called (by the user or ``lr_step``)."""
        scheduler = getattr(program, "lr_scheduler", None)
        if scheduler is None:
            return
        name = scheduler._var_name
        dtype = paddle.base.data_feeder.convert_dtype(program.global_block().var(name).dtype)
        value = np.array([scheduler()], dtype=dtype)
        for s in plan.stage_of_var(name):
            worker = self.worker(plan.stages[s].device)
            worker.scope.var(name).get_tensor().set(value, worker.place)

    def _step(self, plan: Plan, batch: dict, fetch: list[str]) -> list[np.ndarray]:
        missing = [n for n in plan.data_vars if n not in batch]
        extra = [n for n in batch if n not in plan.data_vars]
        if missing or extra:
            raise ValueError(f"feed does not match the program's data variables: missing {missing}, "
                             f"unknown {extra}; expected {sorted(plan.data_vars)}")
        batch = {n: FeedSpec(n, *_spec(plan, n)).convert(v) for n, v in batch.items()}
        if plan.dp_degree > 1:
            batch = self._replica_slice(plan, batch)
        micro = split_microbatches(batch, plan.num_microbatches)
        plan.bind_micro_batch_size(len(next(iter(micro[0].values()))))
        feeds = {s: [{n: mb[n] for n in st.sections[FORWARD].feeds} for mb in micro]
                 for s, st in enumerate(plan.stages)}
        where, persist = self._locate_fetches(plan, fetch)
        fetched = self._run_actions(plan, feeds, where)
        if plan.schedule != FORWARD_ONLY:
            self.global_step += 1
        out = []
        local = {st.index for st in self.local_stages(plan)}
        for name in fetch:
            where_stage = persist[name] if name in persist else plan.producers[name].stage
            if where_stage not in local:
                out.append(None)  # computed by another process
            elif name in persist:
                out.append(np.array(self.scope_of(plan.stages[persist[name]].device).find_var(name).get_tensor()))
            else:
                out.append(self._replica_value(plan, name, _combine(plan, name, fetched[name])))
        return out

    def _replica_slice(self, plan: Plan, batch: dict) -> dict:
        """Data parallelism: replica k trains on the k-th of ``dp_degree`` equal slices of the global batch."""
        size = len(next(iter(batch.values())))
        if size % plan.dp_degree:
            raise ValueError(f"global batch size {size} is not divisible by dp_degree={plan.dp_degree}")
        return split_microbatches(batch, plan.dp_degree)[self._world[0] // len(plan.ranks)]

    def _replica_value(self, plan: Plan, name: str, value: np.ndarray) -> np.ndarray:
        """A fetched mean (loss, metric) over the whole global batch: the mean of the replicas' means
        (equal slices). Batched values stay this replica's rows."""
        if plan.dp_degree == 1 or _batched(plan, name):
            return value
        return self._channel_for(plan).replica_mean(np.ascontiguousarray(value)).reshape(np.shape(value))

    def _locate_fetches(self, plan: Plan, fetch: list[str]) -> tuple[dict, dict]:
        where: dict[tuple[int, str], tuple[str, ...]] = {}
        persist: dict[str, int] = {}
        for name in fetch:
            ref = plan.producers.get(name)
            if ref is not None:
                where[(ref.stage, ref.kind)] = where.get((ref.stage, ref.kind), ()) + (name,)
            elif plan.stage_of_var(name):
                persist[name] = plan.stage_of_var(name)[0]
            else:
                raise ValueError(f"cannot fetch '{name}': it is not computed by the pipelined program nor "
                                 "part of any stage's state")
        return where, persist

    def _run_actions(self, plan: Plan, feeds: dict, fetch: dict) -> dict[str, list[np.ndarray]]:
        local = self.local_stages(plan)
        # a message to a stage of another process leaves from host memory (see DistributedChannel)
        mine = {s.index for s in local}
        places = {s.index: self._place_of(s.device) if s.index in mine else core.CPUPlace() for s in plan.stages}
        channel = self._channel_for(plan)
        channel.reset()
        record = self._recorder()
        futures = {}
        for stage in local:
            self.worker(stage.device).prepare(plan, stage.index, fetch)
        for rank in sorted({s.rank for s in local}):
            device = plan.ranks[rank]
            job = StepJob(plan, plan.actions[rank], feeds, fetch, channel, places, record)
            futures[self._threads[device].submit(self.worker(device).run_step, job)] = device
        try:
            results = self._wait(futures, channel)
            channel.flush()  # a step's messages are all received within the step
        except BaseException as exc:
            if self._watchdog is not None:  # the other processes stop instead of waiting for this one
                self._watchdog.step_failed(exc, ", ".join(sorted({s.device for s in local})))
            # micro-batches of the failed step may have reached the gradient buffers: empty them so the
            # next step starts clean
            for stage in local:
                self.worker(stage.device).init_stage(plan, stage.index)
            raise
        fetched: dict[str, list[np.ndarray]] = {}
        for r in results:
            fetched.update(r.fetched)
        return fetched

    def _wait(self, futures: dict, channel: Channel) -> list[StepResult]:
        """Wait for every worker; on the first failure abort the rest and raise that stage's error."""
        pending = set(futures)
        failure: BaseException | None = None
        try:
            while pending:
                done, pending = cf.wait(pending, timeout=0.1, return_when=cf.FIRST_EXCEPTION)
                for f in done:
                    exc = f.exception()
                    if exc is not None and not isinstance(exc, PipelineAborted) and failure is None:
                        failure = exc
                        channel.abort(str(exc))
        except BaseException:  # KeyboardInterrupt: stop every worker at its next receive, then re-raise
            channel.abort("interrupted")
            cf.wait(pending)
            raise
        if failure is None:
            aborted = [f.exception() for f in futures if f.exception() is not None]
            if aborted:
                failure = aborted[0]
        if failure is not None:
            raise failure
        return [f.result() for f in futures]

    def _recorder(self):
        if not self.trace:
            return None
        self._records = records = []
        return lambda action, start, end: records.append((action, start, end))

    def timeline(self, program: framework.Program) -> Timeline:
        """The last traced step of ``program``: busy time, bubble, Chrome trace and Gantt chart export."""
        plan = plan_of(program)
        if plan is None:
            raise ValueError("timeline needs a program rewritten by staticpipe.PipelineOptimizer.minimize")
        return Timeline.from_records(plan, self._records)

    def train_from_dataset(self, program: framework.Program, dataset: Any = None, scope: Any = None,
                           thread: int = 0, debug: bool = False, fetch_list: Sequence | None = None,
                           fetch_info: Sequence[str] | None = None, print_period: int = 100,
                           lr_step: str | None = None, checkpoint_dir: str | None = None,
                           checkpoint_every: int | None = None, keep_last: int = 3) -> list[list]:
        """Train ``program`` on one epoch of ``dataset`` (a ``staticpipe.io.DataLoader``).

        Returns the fetched values of every step (a list per step, in ``fetch_list`` order). ``thread``
        is accepted for Paddle compatibility (each stage has its own worker already); ``scope`` must be
        None because parameters live in one scope per device (see ``scope_of``). With ``debug`` (or an
        executor created with ``trace=True``) each step is traced and its timeline summary -- step time,
        measured bubble, the schedule's bound, busy time per rank -- is logged every ``print_period``
        steps and after the last. ``lr_step`` advances the program's learning-rate scheduler
        after every step ("step") or after the epoch ("epoch"); None leaves ``scheduler.step()`` to you.
        ``checkpoint_dir``: save a checkpoint (``staticpipe.save``) named ``step-<global step>`` there
        every ``checkpoint_every`` steps and after the epoch, keeping the last ``keep_last``.
        """
        plan = plan_of(program)
        if plan is None:
            raise ValueError("train_from_dataset needs a program rewritten by staticpipe.PipelineOptimizer"
                             ".minimize; this program has no pipeline plan")
        if dataset is None or not hasattr(dataset, "epoch"):
            raise ValueError("dataset must be a staticpipe.io.DataLoader (from_generator) with a generator set")
        if scope is not None:
            raise ValueError("scope must be None: staticpipe keeps one scope per device "
                             "(Executor.scope_of(device))")
        if lr_step not in (None, "step", "epoch"):
            raise ValueError(f"lr_step must be None, 'step' or 'epoch', got {lr_step!r}")
        if lr_step is not None and getattr(program, "lr_scheduler", None) is None:
            raise ValueError(f"lr_step={lr_step!r} needs an optimizer with a paddle.optimizer.lr.LRScheduler "
                             "learning rate; this program's learning rate is constant")
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1
                                             or checkpoint_dir is None):
            raise ValueError(f"checkpoint_every must be an integer >= 1 and needs checkpoint_dir, got "
                             f"checkpoint_every={checkpoint_every!r}, checkpoint_dir={checkpoint_dir!r}")
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        names = _names(fetch_list)
        labels = list(fetch_info) if fetch_info else ["loss" if n == plan.loss else n for n in names]
        if len(labels) != len(names):
            raise ValueError(f"fetch_info has {len(labels)} names for {len(names)} fetch_list entries")
        history: list[list] = []
        tracing, self.trace = self.trace, self.trace or debug
        try:
            with Progress(labels, print_period) as progress:
                for batch in dataset.epoch():
                    started = time.perf_counter()
                    self._set_learning_rate(program, plan)
                    values = self._step(plan, batch, names)
                    if lr_step == "step":
                        program.lr_scheduler.step()
                    history.append(values)
                    progress.update(len(next(iter(batch.values()))), values, time.perf_counter() - started)
                    if self.trace and len(history) % print_period == 0:
                        progress.note(f"step {len(history)} timeline: {self.timeline(program).summary()}")
                    if checkpoint_every and self.global_step % checkpoint_every == 0:
                        self._checkpoint(program, checkpoint_dir, keep_last)
                if self.trace and history and len(history) % print_period:
                    progress.note(f"step {len(history)} timeline: {self.timeline(program).summary()}")
                if checkpoint_dir is not None and history and not (
                        checkpoint_every and self.global_step % checkpoint_every == 0):
                    self._checkpoint(program, checkpoint_dir, keep_last)
        finally:
            self.trace = tracing
        if lr_step == "epoch":
            program.lr_scheduler.step()
        return history

    def evaluate(self, program: framework.Program, dataset: Any, fetch_list: Sequence,
                 num_microbatches: int = 1, like: framework.Program | None = None) -> list[np.ndarray]:
        """Run the evaluation program over one epoch of ``dataset`` as a forward-only pipeline on the
        trained stages and return each fetched value averaged over all samples (batches weighted by
        their size), which equals single-device evaluation of means such as loss and accuracy (None
        in a process of a launched job that does not compute it; with data parallelism each replica
        evaluates its slice of every batch and the means are averaged over the replicas).

        ``program``: ``main.clone(for_test=True)`` taken before ``minimize``; it is rewritten once
        (the plan is kept on it). ``like``: the training program, whose chunking it follows.
        """
        plan = plan_of(program)
        if plan is None:
            trained = plan_of(like) if like is not None else None
            chunked = trained is not None and len(trained.stages) > len(trained.ranks)
            plan = build_forward_plan(program, num_microbatches, chunked)
            plan.dp_degree = trained.dp_degree if trained is not None else 1
            setattr(program, PLAN_ATTR, plan)
        names = _names(fetch_list)
        totals, samples = None, 0
        for batch in dataset.epoch():
            n = len(next(iter(batch.values())))
            weighted = [None if v is None else np.asarray(v, dtype=np.float64) * n
                        for v in self._step(plan, batch, names)]
            totals = weighted if totals is None else [None if t is None else t + w for t, w in zip(totals, weighted)]
            samples += n
        if totals is None:
            raise ValueError("the evaluation data set gave no batch")
        return [None if t is None else t / samples for t in totals]  # None: computed by another process

    def _checkpoint(self, program: framework.Program, directory: str, keep_last: int) -> None:
        if not checkpoint.save(program, os.path.join(directory, f"step-{self.global_step:08d}"), self,
                               self.global_step):
            return
        saved = sorted(d for d in os.listdir(directory) if d.startswith("step-") and "." not in d)
        for old in saved[:-keep_last]:
            shutil.rmtree(os.path.join(directory, old))

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """Per stage, the peak activation bytes and micro-batches held between forward and backward
        since the executor was created (or ``reset_memory_stats``)."""
        stats = {}
        for worker in self._workers.values():
            for stage, m in worker.memory.items():
                stats[stage] = {"peak_activation_bytes": m.peak_bytes, "peak_inflight_microbatches": m.peak_microbatches}
        return dict(sorted(stats.items()))

    def reset_memory_stats(self) -> None:
        for worker in self._workers.values():
            worker.memory.clear()

    # --- state --------------------------------------------------------------------------------------
    def state_dict(self, program: framework.Program) -> dict[str, np.ndarray]:
        """Every parameter and optimizer state of ``program``, gathered from the stages that hold them."""
        plan = plan_of(program)
        if plan is None:
            return {v.name: np.array(self._plain_scope.find_var(v.name).get_tensor())
                    for v in program.list_vars() if v.persistable and self._plain_scope.find_var(v.name)
                    and self._plain_scope.find_var(v.name).get_tensor()._is_initialized()}
        state = {}
        for stage in self.local_stages(plan):
            scope = self.scope_of(stage.device)
            for name in stage.persistables:
                var = scope.find_var(name)
                if name not in stage.grad_buffers and var is not None and var.get_tensor()._is_initialized():
                    state.setdefault(name, np.array(var.get_tensor()))
        return state

    def gathered_state_dict(self, program: framework.Program) -> dict[str, np.ndarray] | None:
        """``state_dict`` of every stage, in the process that writes checkpoints: rank 0 of a job of
        several processes receives the other pipeline ranks' state (the other replicas hold the same
        bits) and the others return None; in one process, simply ``state_dict``."""
        state = self.state_dict(program)
        plan = plan_of(program)
        if self._world is None or plan is None:
            return state
        rank, pipeline = self._world[0], len(plan.ranks)
        channel, key = self._channel_for(plan), ("state", self.global_step)
        if rank == 0:
            for peer in range(1, pipeline):
                state.update(channel.recv(key, next(s.index for s in plan.stages if s.rank == peer)))
            return state
        if rank < pipeline:
            channel.send(key, state, 0)
            channel.flush()
        return None

    def set_state_dict(self, program: framework.Program, state: dict[str, Any], strict: bool = True) -> None:
        """Write ``state`` (name -> array) into every stage that holds each name. Names no stage holds
        are an error, or skipped with ``strict=False`` (a single-device checkpoint may hold more)."""
        plan = plan_of(program)
        if plan is None:
            for name, value in state.items():
                self._plain_scope.var(name).get_tensor().set(np.asarray(value), self.place)
            return
        unknown = [n for n in state if not plan.stage_of_var(n)]
        if unknown and strict:
            raise KeyError(f"set_state_dict: no stage holds {unknown}")
        state = {n: v for n, v in state.items() if n not in unknown}
        local = {st.index for st in self.local_stages(plan)}
        for name, value in state.items():
            for s in plan.stage_of_var(name):
                if s not in local:
                    continue
                worker = self.worker(plan.stages[s].device)
                worker.scope.var(name).get_tensor().set(np.asarray(value), worker.place)


def stages_of_process(plan: Plan, world: tuple[int, int] | None) -> list:
    """The stages the process ``world`` = (rank, size) of a launched job runs; every stage for None (one
    process). ``staticpipe.load_plan`` uses it to read only those stages' programs."""
    pipeline = len(plan.ranks)
    if world is None:
        if plan.dp_degree > 1:
            raise ValueError(f"dp_degree={plan.dp_degree} runs one process per device and replica: launch "
                             f"{plan.dp_degree * pipeline} processes (python -m staticpipe.launch --nprocs "
                             f"{plan.dp_degree * pipeline} script.py)")
        return list(plan.stages)
    rank, size = world
    if size != plan.dp_degree * pipeline:
        replicas = f" x dp_degree {plan.dp_degree}" if plan.dp_degree > 1 else ""
        raise ValueError(f"the job has {size} processes but the plan has {pipeline} devices {plan.ranks}"
                         f"{replicas}; launch {plan.dp_degree * pipeline} processes (one per device{replicas})")
    return [s for s in plan.stages if s.rank == rank % pipeline]


def _init_worker_thread(threads: int) -> None:
    """Paddle's static/dygraph mode is thread-local: a new thread must enter static mode itself."""
    paddle.enable_static()
    core.set_num_threads(threads)


def _on_host(startup: framework.Program) -> framework.Program:
    """A copy of ``startup`` with its device tags removed: it runs once on the CPU, then the values are
    copied to each stage's place."""
    host = startup.clone()
    host.random_seed = startup.random_seed
    return clear_device_tags(host)


def _spec(plan: Plan, name: str) -> tuple[tuple[int, ...], np.dtype]:
    shape, dtype = plan.data_specs[name]
    return shape, np.dtype(dtype)


def _combine(plan: Plan, name: str, values: list[np.ndarray]) -> np.ndarray:
    """Per-micro-batch values of one step as one value: batched values (dim 0 is -1 in the program) are
    concatenated; others (mean losses, metrics) are averaged, which equals the full-batch value of a
    mean over the batch."""
    if _batched(plan, name):
        return np.concatenate(values, axis=0)
    return np.mean(np.stack(values), axis=0).astype(values[0].dtype)


def _batched(plan: Plan, name: str) -> bool:
    """Whether per-micro-batch value ``name`` has the batch as its first dimension (-1 in the program)."""
    ref = plan.producers[name]
    shape = plan.stages[ref.stage].sections[ref.kind].program.global_block().var(name).shape
    return len(shape) > 0 and shape[0] == -1


__all__ = ["Executor", "StageError", "plan_of"]
