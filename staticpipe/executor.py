"""``staticpipe.Executor``: Paddle's ``Executor`` calls, for pipelined programs.

A thin facade: what a call means is decided here, the work is done by the runtime (``runtime/step.py``
runs a step, ``runtime/state.py`` initialises and reads the stages' state) and by the loops
(``train/``). A program without a plan runs as plain Paddle on ``place``, with the state the stages
hold, so an evaluation clone of a pipelined program sees the trained values.
"""
from __future__ import annotations

from typing import Any, Sequence

from ._paddle import core, framework, np, paddle
from .ir import var_names
from .placement import place_of
from .plan import FORWARD_ONLY, Plan, is_startup, plan_of, require_plan
from .runtime import state
from .runtime.devices import Devices
from .runtime.step import StepRunner
from .trace import Timeline
from .train import evaluate, train_from_dataset


class Executor:
    """Pipeline executor with the calls of ``paddle.static.Executor`` that training needs.

    ``place`` is where unsplit programs run (default: GPU 0 with CUDA, else CPU). ``threads_per_stage``
    is each CPU stage worker's intra-op thread budget: one number for all, or ``{device: threads}``
    (devices not named get 1). ``trace`` records the start and end of every action; ``timeline``
    returns the last step's.
    """

    def __init__(self, place: Any = None, threads_per_stage: int | dict[str, int] = 1, trace: bool = False):
        self._devices = Devices(threads_per_stage)
        self._steps = StepRunner(self._devices)
        self.place = place if place is not None else place_of("gpu:0")
        self._plain = paddle.static.Executor(self.place)
        self._plain_scope = core.Scope()
        self.trace = trace
        self.global_step = 0  # training steps run (restored by staticpipe.load)

    trace = property(lambda self: self._steps.trace,
                     lambda self, on: setattr(self._steps, "trace", bool(on)),
                     doc="Record the start and end of every action of the following steps (``timeline``).")

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
        if plan is not None and is_startup(program):
            state.run_startup(self._devices, program, plan)
            return []
        if plan is not None:
            state.set_learning_rate(self._devices, program, plan)
            values = self._steps.run(plan, feed or {}, var_names(fetch_list))
            if plan.schedule != FORWARD_ONLY:
                self.global_step += 1
            return values
        state.copy_stage_state(self._devices, program, self._plain_scope, self.place)
        return self._plain.run(program, feed=feed, fetch_list=fetch_list, scope=self._plain_scope,
                               return_numpy=return_numpy)

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
        if scope is not None:
            raise ValueError("scope must be None: staticpipe keeps one scope per device "
                             "(Executor.scope_of(device))")
        return train_from_dataset(self, program, dataset, fetch_list, fetch_info, print_period, debug, lr_step,
                                  checkpoint_dir, checkpoint_every, keep_last)

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
        return evaluate(self, program, dataset, fetch_list, num_microbatches, like)

    # --- what the last steps did ----------------------------------------------------------------------
    def timeline(self, program: framework.Program) -> Timeline:
        """The last traced step of ``program``: busy time, bubble, Chrome trace and Gantt chart export."""
        return Timeline.from_records(require_plan(program, "timeline"), self._steps.records)

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """Per stage, the peak activation bytes and micro-batches held between forward and backward
        since the executor was created (or ``reset_memory_stats``)."""
        stats = {}
        for worker in self._devices.workers.values():
            for stage, m in worker.memory.items():
                stats[stage] = {"peak_activation_bytes": m.peak_bytes, "peak_inflight_microbatches": m.peak_microbatches}
        return dict(sorted(stats.items()))

    def reset_memory_stats(self) -> None:
        for worker in self._devices.workers.values():
            worker.memory.clear()

    # --- state --------------------------------------------------------------------------------------
    def state_dict(self, program: framework.Program) -> dict[str, np.ndarray]:
        """Every parameter and optimizer state of ``program``, gathered from the stages that hold them."""
        plan = plan_of(program)
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
        return state.gathered_state_dict(self._devices, plan, self.global_step)

    def set_state_dict(self, program: framework.Program, values: dict[str, Any], strict: bool = True) -> None:
        """Write ``values`` (name -> array) into every stage that holds each name. Names no stage holds
        are an error, or skipped with ``strict=False`` (a single-device checkpoint may hold more)."""
        plan = plan_of(program)
        if plan is None:
            for name, value in values.items():
                self._plain_scope.var(name).get_tensor().set(np.asarray(value), self.place)
            return
        state.set_state_dict(self._devices, plan, values, strict)

    # --- devices ------------------------------------------------------------------------------------
    def scope_of(self, device: str) -> core._Scope:
        """The root scope holding the parameters and optimizer state of the stages on ``device``."""
        return self._devices.worker(device).scope

    def local_stages(self, plan: Plan) -> list:
        """The stages this process runs: all of them, or its rank's when launched as several processes."""
        return self._devices.local_stages(plan)

    def close(self) -> None:
        self._devices.close()


__all__ = ["Executor"]
