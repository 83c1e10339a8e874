"""``staticpipe.Executor``: Paddle's ``Executor`` calls, for pipelined programs.

A thin facade: what a call means is decided here, the work is done by the runtime (``runtime/step.py``
runs a step, ``runtime/state.py`` initialises and reads the stages' state) and by the loops
(``train/``). A program without a plan runs as plain Paddle on ``place``, with the state the stages
hold, so an evaluation clone of a pipelined program sees the trained values.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator, Sequence

from ._paddle import core, framework, np, paddle
from .checkpoint import front_paddle_calls
from .ir import free_scope, is_pir_program, var_names
from .pir_ir import test_mode_forward
from .placement import clone_with_split_points, executor_place
from .plan import FORWARD_ONLY, Plan, attach_plan, is_startup, plan_of, require_plan
from .rewrite import build_forward_plan
from .runtime import paddle_io, startup_sync, state
from .runtime.devices import Devices
from .runtime.errors import non_finite_hint
from .runtime.step import StepRunner
from .trace import Timeline
from .train import Options, evaluate, infer_from_dataset, loader_for, one_feed, take_step, train_from_dataset
from .train.evaluate import is_clone_of, plan_like

log = logging.getLogger("staticpipe")


class Executor:
    """Pipeline executor with the calls of ``paddle.static.Executor``.

    ``place``: what ``paddle.static.Executor`` accepts -- ``paddle.CPUPlace()``, ``paddle.CUDAPlace(k)``,
    "cpu", "gpu", "gpu:k" or None (GPU 0 with CUDA, else the CPU) -- and where *unsplit* programs run (an
    evaluation clone, a program without guards). A pipelined program's stages run where their
    ``device_guard`` says, each on a worker of its own; the startup program runs once on the host and
    each stage receives its values. ``device_map``: run pipeline devices elsewhere, e.g.
    ``{"gpu:1": "gpu:0"}`` runs a two-GPU pipeline on one GPU (two workers there); default: the
    ``STATICPIPE_DEVICE_MAP`` environment variable ("gpu:1=gpu:0"). ``threads_per_stage`` is each CPU
    stage worker's intra-op thread budget: one number for all, or ``{device: threads}`` (devices not
    named get 1). ``worker_threads``: how many threads run the CPU stages. Ranks that share a thread take
    turns where one would wait for a message, in their action lists' order, so the values are the same
    for any number. 1 spends the least CPU (no thread wake-ups) and suits tiny stages; large stages step
    faster on a thread each (None). "auto" (the default) measures on each program's first steps the
    layouts that may step faster (a thread per rank, one per core, one thread; traced or checked steps
    do not count) and keeps the fastest, CPU breaking ties (``lanes`` tells which). ``trace`` records the start and end of every action; ``timeline`` returns
    the last step's.
    ``check_finite``: stop at the first NaN or Inf any op writes, with a ``NonFiniteError`` naming the stage,
    the action (so the micro-batch), the op and the variable (Paddle's ``FLAGS_check_nan_inf``, set for the
    duration of each step; it is process-wide, so steps of executors that do not check wait meanwhile).
    With dynamic loss scaling (fp16 AMP) the backward's overflows are the scaler's (it skips the step and
    lowers the scale, as on one device): the check then covers what each forward sends and keeps and the
    loss, naming the op that wrote the value.

    Calls from several threads run one after the other (a step, a state read or write at a time).
    """

    def __init__(self, place: Any = None, threads_per_stage: int | dict[str, int] = 1, trace: bool = False,
                 device_map: dict[str, str] | None = None, check_finite: bool = False,
                 worker_threads: int | str | None = "auto"):
        self.place = executor_place(place)
        front_paddle_calls()  # paddle.static.save / load / set_program_state on pipelined programs (checkpoint.py)
        self._devices = Devices(threads_per_stage, device_map, worker_threads)
        self._steps = StepRunner(self._devices)
        self._steps.check_finite = bool(check_finite)
        self._lock = threading.RLock()  # one step or state access at a time; a step calls run re-entrantly
        self._closed = False
        self._plain = paddle.static.Executor(self.place)
        self._plain_scope = core.Scope()
        self._forward_twins: dict[Plan, framework.Program] = {}  # training plan -> its forward-only twin
        self._io_plan: Plan | None = None  # the last pipelined training plan: Paddle's save/load calls' (flush)
        self._warned_non_finite = False
        self.trace = trace

    global_step = property(lambda self: self._steps.global_step,
                           lambda self, step: setattr(self._steps, "global_step", int(step)),
                           doc="Training steps run (restored by ``staticpipe.load``).")
    trace = property(lambda self: self._steps.trace,
                     lambda self, on: setattr(self._steps, "trace", bool(on)),
                     doc="Record the start and end of every action of the following steps (``timeline``).")

    # --- run ----------------------------------------------------------------------------------------
    def run(self, program: framework.Program | None = None, feed: dict | list | None = None,
            fetch_list: Sequence | None = None, feed_var_name: str = "feed", fetch_var_name: str = "fetch",
            scope: Any = None, return_numpy: bool = True, use_program_cache: bool = False,
            use_prune: bool = False, *, return_merged: bool = True) -> list:
        """Run ``program`` once (Paddle's signature).

        - a startup program of a pipelined program: initialise once on the host, then give each stage
          its parameters and state on its own place (launched: the first replica's owners' values, broadcast);
        - a pipelined main program: one training step on the global batch ``feed`` (a dict, or Paddle's
          one-element list of it), split into the plan's micro-batches; with no feed, one step of
          ``num_microbatches`` batches from the started loader feeding the program (Paddle's loader
          convention), raising ``core.EOFException`` at the end of its epoch. Values come back as numpy
          arrays, merged over the step's micro-batches into the global batch's value (batched values
          concatenated; a batch mean averaged, a batch sum added, a max or min taken, as the program
          computes it; a value that is none of these -- the square of a mean -- comes back as the list of
          its micro-batches' values; a data variable is the batch fed); ``return_merged=False`` (keyword; the name Paddle's executors gave per-device
          results) gives each as the list of its per-micro-batch values instead (Paddle's pipeline fetches
          the last micro-batch's: ``values[-1]``); ``scope`` must be None (each device keeps its own);
        - a program of Paddle's save (load) ops, as ``save_vars`` (``load_vars``) builds: ``runtime/paddle_io.py``;
        - any other program: plain Paddle execution on ``place`` with the state the stages hold (so an
          evaluation clone of a pipelined program sees the trained values), every argument as Paddle's;
          launched, an evaluation clone runs as ``evaluate`` runs it (its values on the rank computing them).
        """
        with self._open():
            return self._run(program, feed, fetch_list, feed_var_name, fetch_var_name, scope, return_numpy,
                             use_program_cache, use_prune, return_merged)

    def _run(self, program: framework.Program | None, feed: Any, fetch_list: Sequence | None, feed_var_name: str,
             fetch_var_name: str, scope: Any, return_numpy: bool, use_program_cache: bool, use_prune: bool,
             return_merged: bool) -> list:
        program = program if program is not None else paddle.static.default_main_program()
        plan = plan_of(program)
        if plan is None and (kind := paddle_io.io_kind(program)):  # Paddle's save_vars / load_vars program
            return paddle_io.run(kind, self._devices, self._io_plan, self.global_step, self._plain, program, scope)
        if plan is None and self._devices.world is not None and self._io_plan and is_clone_of(program, self._io_plan):
            plan = plan_like(program, self._io_plan)  # launched: no process holds every stage's state (evaluate)
        self._io_plan = plan if plan is not None and plan.schedule != FORWARD_ONLY else self._io_plan
        if plan is not None and is_startup(program):
            state.run_startup(self._devices, program, plan)
            startup_sync.broadcast_startup_state(self._devices, plan)  # launched: one state everywhere
            return []
        if plan is None:
            scope = scope if scope is not None else self._plain_scope
            state.copy_stage_state(self._devices, program, scope, self.place)
            return self._plain.run(program, feed, fetch_list, feed_var_name, fetch_var_name, scope, return_numpy,
                                   use_program_cache, use_prune)  # one run: nothing to merge
        if scope is not None:
            raise ValueError("scope must be None for a pipelined program: each device keeps its own scope "
                             "(Executor.scope_of(device))")
        feed = one_feed(feed)
        if not feed and plan.data_vars:
            loader = loader_for(program, plan, None, "Executor.run")
            micro = take_step(loader, plan.num_microbatches)
            return self._pipelined(program, plan, fetch_list, lambda names: self._steps.run_microbatches(
                plan, micro, names, return_merged), hint=True)
        return self._pipelined(program, plan, fetch_list,
                               lambda names: self._steps.run(plan, feed, names, return_merged), hint=True)

    def step(self, program: framework.Program, microbatches: list[dict], fetch_list: Sequence | None = None,
             return_merged: bool = True) -> list:
        """One step of pipelined ``program`` on ``microbatches`` (``num_microbatches`` batches, as a loader
        gives them); the fetched values, merged over the micro-batches (or per micro-batch: ``run``)."""
        with self._open():
            plan = require_plan(program, "step")
            return self._pipelined(program, plan, fetch_list, lambda names: self._steps.run_microbatches(
                plan, list(microbatches), names, return_merged))

    @contextlib.contextmanager
    def _open(self) -> Iterator[None]:
        """Hold the executor for one call; refuse one after ``close``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this staticpipe.Executor was closed (close() releases its workers and the "
                                   "stages' state): create a new Executor and run the startup program")
            yield

    def _pipelined(self, program: framework.Program, plan: Plan, fetch_list: Sequence | None, run: Any,
                   hint: bool = False) -> list:
        """``run`` the step; ``hint``: say once when a fetched value is not finite (``run``'s callers; the
        training loop says it itself, once per epoch)."""
        state.set_learning_rate(self._devices, program, plan)
        names = var_names(fetch_list, program)
        values = run(names)
        if hint and not self._warned_non_finite and (says := non_finite_hint(names, values)):
            self._warned_non_finite = True  # once per executor, as train_from_dataset says it once per epoch
            log.warning("staticpipe: step %d: %s", self._steps.global_step, says)
        return values

    def train_from_dataset(self, program: framework.Program | None = None, dataset: Any = None, scope: Any = None,
                           thread: int = 0, debug: bool = False, fetch_list: Sequence | None = None,
                           fetch_info: Sequence[str] | None = None, print_period: int = 100,
                           fetch_handler: Any = None, *, lr_step: str | None = None,
                           checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
                           keep_last: int = 3, resume: bool | None = None) -> list[list]:
        """Train ``program`` (default: the default main program) on one epoch of ``dataset``, or of the
        started loader feeding it, as Paddle's pipeline does: each loader batch is one micro-batch and a
        step takes ``num_microbatches`` of them; batches left at the end that do not fill a step are not
        trained on (a message says so). Prints the micro-batch size and global batch once.

        Paddle's arguments, with Paddle's meaning: ``fetch_list`` values are printed every
        ``print_period`` steps, labelled by ``fetch_info``; ``fetch_handler`` (a ``FetchHandler``) is
        called with the values of its ``var_dict`` every ``period_secs``; ``debug`` traces each step and
        prints its timeline summary (step time, bubble, bound, busy time per rank). ``thread`` is accepted
        and ignored (each stage has its own worker thread); ``scope`` must be None (one scope per device,
        ``scope_of``). Returns the fetched values of every step (a list per step, in ``fetch_list`` order).

        staticpipe's own: ``lr_step`` advances the learning-rate scheduler after every step ("step") or
        after the epoch ("epoch"); None leaves ``scheduler.step()`` to you. ``checkpoint_dir``: save a
        checkpoint (``staticpipe.save``) named ``step-<global step>`` there every ``checkpoint_every`` steps
        and after the epoch, keeping the last ``keep_last``, each recording where the data stands. ``resume``
        (with ``checkpoint_dir``; once per executor and program, at its first call): None resumes when
        ``staticpipe.launch --max-restarts`` restarted the job (or ``STATICPIPE_RESUME=1``), True always, from
        the newest checkpoint there, and the epochs go on with the batch the uninterrupted run would have
        taken next; an epoch trained before it returns ``[]`` (``train/resume.py``, docs/checkpoints.md).
        """
        program = self._program(program, scope, thread)
        options = Options(fetch_list, fetch_info, print_period, debug, fetch_handler, lr_step, checkpoint_dir,
                          checkpoint_every, keep_last, resume)
        return train_from_dataset(self, program, dataset, options)

    def infer_from_dataset(self, program: framework.Program | None = None, dataset: Any = None, scope: Any = None,
                           thread: int = 0, debug: bool = False, fetch_list: Sequence | None = None,
                           fetch_info: Sequence[str] | None = None, print_period: int = 100,
                           fetch_handler: Any = None) -> list[list]:
        """Run the pipelined forward of ``program`` over one epoch of ``dataset`` (or the started loader
        feeding it), in steps of ``num_microbatches`` loader batches, updating nothing (Paddle's
        ``infer_from_dataset``). A training program runs as its ``clone(for_test=True)`` on the same
        stages (a PIR program, which has none: its forward ops cloned with ``is_test`` set); an evaluation
        program (no backward) as it is. Arguments as ``train_from_dataset``."""
        program = self._program(program, scope, thread)
        options = Options(fetch_list, fetch_info, print_period, debug, fetch_handler)
        return infer_from_dataset(self, program, self._forward_twin(program), dataset, options)

    def _program(self, program: framework.Program | None, scope: Any, thread: Any) -> framework.Program:
        if scope is not None:
            raise ValueError("scope must be None: staticpipe keeps one scope per device (Executor.scope_of(device))")
        if not isinstance(thread, int) or isinstance(thread, bool) or thread < 0:
            raise ValueError(f"thread must be an integer >= 0 (it is ignored: each stage has its own worker), "
                             f"got {thread!r}")
        return program if program is not None else paddle.static.default_main_program()

    def _forward_twin(self, program: framework.Program) -> framework.Program:
        """``program`` if it is forward-only (planned on first use), else its forward-only twin on the
        same stages, built once per training plan."""
        plan = plan_of(program)
        if plan is None:
            attach_plan(build_forward_plan(program), program)
            return program
        if plan.schedule == FORWARD_ONLY:
            return program
        if plan not in self._forward_twins:
            if is_pir_program(program):
                twin = test_mode_forward(program)
            else:
                twin = clone_with_split_points(program, for_test=True)
            attach_plan(build_forward_plan(twin, plan.num_microbatches, len(plan.stages) > len(plan.ranks),
                                           dp_degree=plan.dp_degree, replica_batches=plan.replica_batches,
                                           sharding_degree=plan.sharding_degree), twin)
            self._forward_twins[plan] = twin
        return self._forward_twins[plan]

    def evaluate(self, program: framework.Program, dataset: Any, fetch_list: Sequence,
                 num_microbatches: int = 1, like: framework.Program | None = None) -> list[np.ndarray]:
        """Run the evaluation program over one epoch of ``dataset`` as a forward-only pipeline on the
        trained stages and return each fetched value over all samples, as it reduces the batch: a mean
        (loss, accuracy) averaged over all samples (batches weighted by their size), a sum added, a max or
        min taken -- single-device evaluation of the whole epoch; a value that is none of these as the list
        of its micro-batches' values (None in a process of a launched job that does not compute it; with
        data parallelism each replica evaluates its slice of every batch and the replicas' values are
        combined the same way). Each loader
        batch is one evaluation step of ``num_microbatches`` micro-batches; a last, smaller batch is
        evaluated too.

        ``program``: ``main.clone(for_test=True)`` taken before ``minimize`` (a PIR program, which has no
        such clone: the forward network built again as a program of its own, same parameter names, same
        device guards); it is rewritten once
        (the plan is kept on it). ``like``: the training program, whose chunking it follows.
        """
        return evaluate(self, program, dataset, fetch_list, num_microbatches, like)

    def flush(self) -> bool:
        """Paddle's "flush params to the root scope": every stage's state into ``global_scope()`` of the process
        that writes (launched: rank 0; every rank calls it); whether it is this one (``runtime/paddle_io.py``)."""
        with self._open():
            return paddle_io.publish(self._devices, self._io_plan, self.global_step, paddle.static.global_scope())

    # --- what the last steps did ----------------------------------------------------------------------
    def lanes(self, program: framework.Program) -> list[list[str]]:
        """The stage devices that each thread runs in ``program``'s next step: with ``worker_threads="auto"``
        the layout the trial tries next while it runs (``runtime/thread_choice.py``), then the one chosen."""
        with self._open():
            return self._steps.lanes(require_plan(program, "lanes"))

    def timeline(self, program: framework.Program) -> Timeline:
        """The last traced step of ``program``: busy time, bubble, Chrome trace and Gantt chart export."""
        return Timeline.from_records(require_plan(program, "timeline"), self._steps.records)

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """Per stage, the peak activation bytes and micro-batches held between forward and backward
        since the executor was created (or ``reset_memory_stats``), and the bytes of the values it holds
        once for all its micro-batches (AMP's low-precision parameter copies; 0 without AMP)."""
        stats = {}
        for worker in self._devices.workers.values():
            for stage, m in worker.memory.items():
                stats[stage] = {"peak_activation_bytes": m.peak_bytes, "peak_inflight_microbatches": m.peak_microbatches,
                                "step_value_bytes": m.step_value_bytes or 0}
        return dict(sorted(stats.items()))

    def device_memory_stats(self) -> dict[str, dict[str, int]]:
        """Per device, the peak activation bytes and micro-batches its stages held at once (a device with
        several stages: not the sum of their peaks), as ``memory_stats``; the plan's memory model predicts it
        (``print(plan)``, ``plan.memory.devices(micro_batch_size)``)."""
        return {device: {"peak_activation_bytes": w.device_memory.peak_bytes,
                         "peak_inflight_microbatches": w.device_memory.peak_microbatches}
                for device, w in sorted(self._devices.workers.items())}

    def reset_memory_stats(self) -> None:
        for worker in self._devices.workers.values():
            worker.reset_memory()

    # --- state --------------------------------------------------------------------------------------
    def state_dict(self, program: framework.Program) -> dict[str, np.ndarray]:
        """Every parameter and optimizer state of ``program``, gathered from the stages that hold them."""
        plan = plan_of(program)
        with self._open():
            if plan is None:
                return state.scope_state(program, self._plain_scope)
            return state.state_dict(self._devices, plan)

    def gathered_state_dict(self, program: framework.Program) -> dict[str, np.ndarray] | None:
        """``state_dict`` of every stage, in the process that writes checkpoints: rank 0 of a job of
        several processes receives the other pipeline ranks' state and the others return None; in one
        process, simply ``state_dict``."""
        plan = plan_of(program)
        if plan is None:
            return self.state_dict(program)
        with self._open():
            return state.gathered_state_dict(self._devices, plan, self.global_step)

    def gathered_positions(self, program: framework.Program, mine: dict | None) -> list[dict | None] | None:
        """Where every process's data stands, for a checkpoint: ``[mine]`` in one process; launched, every
        rank's in rank order on rank 0, None on the others (every rank calls it)."""
        plan = plan_of(program)
        if plan is None:
            return [mine]
        with self._open():
            return state.gathered_positions(self._devices, plan, mine)

    def set_state_dict(self, program: framework.Program, values: dict[str, Any], strict: bool = True) -> None:
        """Write ``values`` (name -> array) into every stage that holds each name. Names no stage holds
        are an error, or skipped with ``strict=False`` (a single-device checkpoint may hold more)."""
        plan = plan_of(program)
        with self._open():
            if plan is None:
                for name, value in values.items():
                    self._plain_scope.var(name).get_tensor().set(np.asarray(value), self.place)
                return
            state.set_state_dict(self._devices, plan, values, strict)

    # --- devices ------------------------------------------------------------------------------------
    def scope_of(self, device: str) -> core._Scope:
        """The root scope holding the parameters and optimizer state of the stages on ``device``; it is
        freed by ``close``, after which it must not be used."""
        with self._open():
            return self._devices.worker(device).scope

    def local_stages(self, plan: Plan) -> list:
        """The stages this process runs: all of them, or its rank's when launched as several processes."""
        return self._devices.local_stages(plan)

    def close(self) -> None:
        """Stop the workers and free the stages' state, their scopes and prepared runs; a later call on this
        executor is refused. Freed explicitly: Paddle keeps a scope made by ``core.Scope()`` until the
        process exits unless it is removed from its scope pool (``ir.free_scope``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._devices.close()
            self._plain = None  # its cached interpreters point into the plain scope: they go first
            free_scope(self._plain_scope)
            self._plain_scope = None


__all__ = ["Executor"]
