"""One pipelined step: a global batch in, every stage's actions run, the fetched values out.

The step splits the batch into micro-batches (after taking this replica's slice when the pipeline is
data-parallel), hands every local rank its action list on its lane (a thread running one or more
ranks: ``lanes.py``), and waits; the first stage to fail aborts the channel so that every other rank
stops at its next receive, and the step raises that stage's error after emptying the gradient buffers
the failed step may have touched. Fetched per-micro-batch values are merged into the global batch's
value.

Runtime state kept here, never in the plan: the micro-batch size a plan's first batch fixes (when the
plan did not compile one), what each rank needs besides its actions (``RankProgram``), both worked
out once per plan, and how many threads run its CPU ranks (``thread_choice.py``: tried on its first
steps when the executor is not told).
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any

from .._paddle import core, np
from ..io import batch_rows, checked_batch, split_microbatches
from ..ir import as_fetched, as_float, declared_var
from ..placement import generic_place
from ..plan import FORWARD, FORWARD_ONLY, OPTIMIZE, PER_MICROBATCH, Plan
from ..schedule import Kind
from .devices import Devices
from . import state
from .errors import NonFiniteError, PipelineAborted, StageError
from .nan_inf import NAN_INF_GATE, scales_loss
from .jobs import RankProgram, StepJob, StepResult
from .thread_choice import ThreadChoice, cores


class StepRunner:
    def __init__(self, devices: Devices):
        self.devices = devices
        self.trace = False  # record (action, start, end, CPU seconds) of every action of the next steps
        self.check_finite = False  # stop at the first NaN or Inf an op writes (Paddle's FLAGS_check_nan_inf)
        self.global_step = 0  # training steps whose actions all ran (their updates are applied)
        self.records: list[tuple] = []  # of the last traced step
        self._bound: dict[Plan, int] = {}  # plan -> the micro-batch size its first step fixed
        self._programs: dict[Plan, dict[int, RankProgram]] = {}
        self._places: dict[Plan, dict[int, core.Place]] = {}
        self._batched: dict[tuple[Plan, str], bool] = {}
        self._scaled: dict[Plan, bool] = {}  # plan -> whether it scales its loss (``scales_loss``)
        self._local: dict[Plan, list] = {}  # plan -> the stages this process runs
        self._prepared: set[tuple] = set()  # (plan, fetch lists) whose runs are prepared
        self._located: dict[tuple, tuple[dict, dict]] = {}  # (plan, fetch list) -> _locate_fetches of it
        self._choices: dict[Plan, ThreadChoice] = {}  # plan -> its trial of thread layouts (worker_threads="auto")

    def micro_batch_size(self, plan: Plan) -> int | None:
        """The plan's compiled micro-batch size, or the one its first step fixed (None before)."""
        return plan.micro_batch_size or self._bound.get(plan)

    def run(self, plan: Plan, batch: dict[str, Any], fetch: list[str], merged: bool = True) -> list:
        """One step of ``plan`` on the global batch ``batch``, split into the plan's micro-batches; the
        values of ``fetch`` (None for a value another process computes), merged over the micro-batches or,
        ``merged=False``, each a list of its per-micro-batch values."""
        batch = checked_batch(plan.data_specs, batch, "feed")
        if plan.dp_degree > 1:
            batch = self._replica_slice(plan, batch, "global batch")
        return self._step(plan, split_microbatches(batch, plan.num_microbatches), fetch, merged)

    def run_microbatches(self, plan: Plan, microbatches: list[dict[str, Any]], fetch: list[str],
                         merged: bool = True) -> list:
        """One step of ``plan`` on ``microbatches``, one batch each (Paddle's pipeline convention: a loader
        batch is a micro-batch). With data parallelism each replica takes its slice of every one."""
        if len(microbatches) != plan.num_microbatches:
            raise ValueError(f"a step takes num_microbatches={plan.num_microbatches} micro-batches, got "
                             f"{len(microbatches)}")
        micro = [checked_batch(plan.data_specs, mb, f"micro-batch {k}") for k, mb in enumerate(microbatches)]
        sizes = [batch_rows(mb) for mb in micro]
        if len(set(sizes)) > 1:
            raise ValueError(f"the micro-batches of a step must have one size; got sizes {sizes}")
        if plan.dp_degree > 1:
            micro = [self._replica_slice(plan, mb, "micro-batch") for mb in micro]
        return self._step(plan, micro, fetch, merged)

    def _step(self, plan: Plan, micro: list[dict[str, np.ndarray]], fetch: list[str], merged: bool = True) -> list:
        size = batch_rows(micro[0])
        if size == 0:
            raise ValueError(f"empty micro-batches: the batch has no samples (feed variables {sorted(micro[0])})")
        # an evaluation (forward-only) plan takes any size: a last, smaller batch is evaluated too
        training = plan.schedule != FORWARD_ONLY
        expected = self.micro_batch_size(plan) if training else None
        if expected is not None and size != expected:
            raise ValueError(_size_mismatch(plan, size, expected, plan.micro_batch_size is not None))
        feeds = {st.index: [{n: mb[n] for n in st.sections[FORWARD].feeds} for mb in micro] for st in plan.stages}
        key = (plan, tuple(fetch))
        if key not in self._located:  # once per fetch list; outliving: values left in their stages' scopes
            self._located[key] = _locate_fetches(plan, fetch + [n for n in plan.outliving if n not in fetch])
        where, persist = self._located[key]
        shapes = [tuple(mb[n].shape for n in sorted(mb)) for mb in micro]
        fetched = self._run_actions(plan, feeds, where, size if training else None, shapes)
        if training:  # the update is applied: the step counts, whatever merging the fetches does
            self.global_step += 1
            self._bound.setdefault(plan, size)  # only a step that succeeded fixes it
        local = {st.index for st in self._local[plan]}
        for name in plan.outliving:  # where one device's run leaves a persistable value: in the stage's scope
            stage = plan.stages[plan.producers[name].stage]
            if stage.index in local:
                worker = self.devices.worker(stage.device)
                worker.scope.var(name).get_tensor().set(self._combine(plan, name, fetched[name], each=False),
                                                        worker.place)
        out = []
        for name in fetch:
            if name not in persist and name not in plan.producers:  # a data variable: what was fed
                fed = [np.array(mb[name]) for mb in micro] if local & set(plan.data_vars[name]) else None
                out.append(fed if fed is None or not merged else np.concatenate(fed))
                continue
            stage = next((s for s in persist[name] if s in local), persist[name][0]) if name in persist else \
                plan.producers[name].stage  # state several stages hold (a learning rate) is alike: a local one's
            if stage not in local or not plan.stages[stage].holds(name, plan.shard_of_process(self.devices.world)):
                out.append(None)  # computed by another process, or another ZeRO-1 member's optimizer state
            elif name in persist:
                out.append(np.array(self.devices.worker(plan.stages[stage].device).scope.find_var(name).get_tensor()))
            elif not merged:
                out.append(list(fetched[name]))
            else:
                out.append(self._replica_value(plan, name, self._combine(plan, name, fetched[name])))
        return out

    def _rank_programs(self, plan: Plan, fetch: dict) -> dict[int, RankProgram]:
        """What each local rank runs, worked out on the plan's first step; the runs' prepared contexts,
        made here in the calling thread for each new fetch list."""
        programs = self._programs.get(plan)
        if programs is None:
            local = self.devices.runnable_stages(plan)
            for stage in local:
                missing = state.uninitialised(self.devices, plan, stage)
                if missing:
                    raise ValueError(f"stage {stage.index} ({stage.device}) has no value for {missing[0]!r}"
                                     f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: run the "
                                     "startup program (exe.run(startup)) before the first step")
            self._local[plan] = local
            mine = {s.index for s in local}
            self._places[plan] = {s.index: generic_place(self.devices.place_of(s.device) if s.index in mine
                                                         else core.CPUPlace()) for s in plan.stages}
            programs = self._programs[plan] = {r: RankProgram.of(plan, r) for r in sorted({s.rank for s in local})}
        key = (plan, tuple(sorted(fetch.items())))
        if key not in self._prepared:
            shard = plan.shard_of_process(self.devices.world)
            for stage in self._local[plan]:
                worker = self.devices.worker(stage.device)
                for kind, section in stage.sections.items():
                    runs = (stage.optimize_section(shard).runs if kind == OPTIMIZE else section.runs[:1]
                            if kind in PER_MICROBATCH else ())
                    for run in runs:
                        if run.program is not None:
                            worker.prepare(run, fetch.get((stage.index, kind), ()))
            self._prepared.add(key)
        return programs

    def _run_actions(self, plan: Plan, feeds: dict, fetch: dict, micro_batch_size: int | None,
                     shapes: list[tuple]) -> dict[str, list]:
        programs = self._rank_programs(plan, fetch)
        local = self._local[plan]
        channel = self.devices.channel_for(plan)
        channel.reset()
        record = None
        if self.trace:
            self.records = records = []
            record = lambda *event: records.append(event)  # noqa: E731
        # under dynamic loss scaling the backward's overflows are the scaler's: Paddle's per-op check, one flag
        # for the process, stays off and the forwards' outputs are checked by the workers instead
        if plan not in self._scaled:
            self._scaled[plan] = scales_loss(plan)
        scaled = self.check_finite and self._scaled[plan]
        jobs = [(plan.ranks[rank], StepJob(plan, program, feeds, fetch, channel, self._places[plan],
                                           micro_batch_size, shapes, record, scaled))
                for rank, program in programs.items()]
        with NAN_INF_GATE.held(self.check_finite and not scaled):  # process-wide: no step of another setting meanwhile
            return self._run_jobs(plan, jobs, channel, local, tuple(shapes))

    def lanes(self, plan: Plan) -> list[list[str]]:
        """The devices that each thread runs in ``plan``'s next step (of this process's ranks)."""
        devices = [plan.ranks[rank] for rank in self._local_ranks(plan)]
        return [[devices[i] for i in lane] for lane in self.devices.lanes_of(devices, self._threads(plan, devices)[0])]

    def _local_ranks(self, plan: Plan) -> list[int]:
        return sorted({s.rank for s in self.devices.local_stages(plan)})

    def _threads(self, plan: Plan, devices: list[str], shapes: tuple | None = None
                 ) -> tuple[int | None, ThreadChoice | None]:
        """How many threads run the plan's CPU ranks in its next step (of micro-batch ``shapes``; None: any
        the trial takes), and the trial the step counts in (``thread_choice.py``), if any. ``devices``:
        the local ranks' devices, in rank order."""
        setting = self.devices.worker_threads
        if setting != "auto":
            return setting, None
        choice = self._choices.get(plan)
        if choice is None:
            ranks = len(self.devices.shareable(devices))
            layouts = {n: self.devices.lanes_of(devices, n) for n in {max(ranks, 1), max(min(ranks, cores()), 1), 1}}
            messages = [sum(a.kind in (Kind.SEND, Kind.RECV) for a in plan.actions[r]) for r in self._local_ranks(plan)]
            choice = self._choices[plan] = ThreadChoice(layouts, messages, cores(), ", ".join(devices))
        counts = not (self.trace or self.check_finite) and choice.counts(choice.shapes if shapes is None else shapes)
        return choice.threads(counts), choice if counts else None

    def _run_jobs(self, plan: Plan, jobs: list, channel: Any, local: list, shapes: tuple) -> dict[str, list]:
        """Run the ranks' jobs on their lanes (``Devices.lanes_of``). In one process the first lane runs
        here, on the calling thread: a hand-off to a worker thread and back costs two thread wake-ups
        (58 µs measured). A step that counts in the plan's trial of thread layouts reports its wall and
        CPU time once it has run to its end."""
        rank_devices = [device for device, _ in jobs]
        threads, trial = self._threads(plan, rank_devices, shapes)
        if trial is not None:
            start, start_cpu = time.perf_counter(), time.process_time()
        lanes = [([jobs[i][0] for i in lane], [jobs[i][1] for i in lane])
                 for lane in self.devices.lanes_of(rank_devices, threads)]
        here = lanes.pop(0) if self.devices.world is None else None
        futures: list[cf.Future] = []
        try:  # from the first hand-off on: an interrupt anywhere must stop the jobs handed out (_settle)
            for devices, lane_jobs in lanes:
                futures.append(future := cf.Future())  # ours before the hand-off, which an interrupt may cut short
                self.devices.submit(devices, future, self.devices.run_lane, devices, lane_jobs, channel)
            outcomes, failure, lane_cpu = [], None, []
            if here is not None:
                try:
                    outcomes += _outcomes(self.devices.run_lane(*here, channel), lane_cpu)
                except BaseException as exc:  # an interrupt between its ranks: they have stopped, the others stop too
                    failure = exc
            results = _wait(futures, channel, failure, outcomes, lane_cpu)
            channel.flush()  # a step's messages are all received within the step
            if trial is not None:
                took = time.perf_counter() - start, time.process_time() - start_cpu
        except BaseException as exc:
            _settle(futures, channel)  # no job of this step runs on, nor touches the stages, after it
            if self.devices.watchdog is not None:  # the other processes stop instead of waiting for this one
                self.devices.watchdog.step_failed(exc, ", ".join(sorted({s.device for s in local})))
            # micro-batches of the failed step may have reached the gradient buffers: empty them so the
            # next step starts clean
            for stage in local:
                self.devices.worker(stage.device).init_stage(stage)
            non_finite = NonFiniteError.of(exc) if self.check_finite and isinstance(exc, StageError) else None
            if non_finite is not None:
                raise non_finite from exc
            raise
        if trial is not None:  # (after the step's own error handling: a step that ran to its end counts)
            trial.measured(threads, shapes, *took, lane_cpu)
            if trial.chosen is not None:
                self.devices.retire_threads(self.lanes(plan))
        fetched: dict[str, list] = {}
        for r in results:
            fetched.update(r.fetched)
        return fetched

    def _replica_slice(self, plan: Plan, batch: dict, what: str) -> dict:
        """Data parallelism: replica k trains on the k-th of ``dp_degree`` equal slices of ``batch``; with
        ``replica_batches="own"`` (Paddle's fleet) ``batch`` is this replica's own, as fed."""
        if plan.replica_batches == "own":
            return batch
        size = batch_rows(batch)
        if size % plan.dp_degree:
            raise ValueError(f"{what} size {size} is not divisible by dp_degree={plan.dp_degree} (each {what} is "
                             f"split among the replicas; feed a multiple of {plan.dp_degree}, or build with "
                             "replica_batches='own' to feed each replica its own batches, as Paddle's fleet does)")
        return split_microbatches(batch, plan.dp_degree)[plan.place_of_process(self.devices.world[0])[0]]

    def _replica_value(self, plan: Plan, name: str, value: np.ndarray | list) -> np.ndarray | list:
        """A fetched value over the whole global batch from the replicas' (equal slices): their mean for a
        mean, their sum for a sum, their max or min. Batched values, and values handed out per micro-batch,
        stay this replica's."""
        batched, dtype = self._declared(plan, name)
        how = plan.reduction(name)
        if plan.dp_degree == 1 or batched or how == "each":
            return value
        channel, numbers = self.devices.channel_for(plan), np.ascontiguousarray(as_float(value, dtype))
        if how in ("max", "min"):
            total = channel.replica_extreme(numbers, how == "max")
        else:
            total = channel.replica_mean(numbers) * (plan.dp_degree if how == "sum" else 1)
        return as_fetched(total, value, dtype).reshape(np.shape(value))

    def _combine(self, plan: Plan, name: str, values: list[np.ndarray], each: bool = True) -> np.ndarray | list:
        """Per-micro-batch values of one step as one value: batched values (dim 0 is -1 in the program)
        are concatenated; the others as ``reduction`` says: a mean averaged (the full batch's mean), a sum
        added, a max or min taken; any other value is handed out as the list of its micro-batches' values
        (``each``; else averaged: a value left in a stage's scope must be one)."""
        batched, dtype = self._declared(plan, name)
        if batched:
            return np.concatenate(values, axis=0)
        how = plan.reduction(name)
        if how == "each" and each:
            return [np.array(v) for v in values]
        if len(values) == 1:  # one micro-batch: its value is the mean, sum, max and min (np.stack costs 10 µs)
            return as_fetched(as_float(values[0], dtype), values[0], dtype)
        numbers = as_float(np.stack(values), dtype)  # (once, not per value: its dtype test is a call into Paddle)
        combine = {"sum": np.sum, "max": np.max, "min": np.min}.get(how, np.mean)
        return as_fetched(combine(numbers, axis=0), values[0], dtype)

    def _declared(self, plan: Plan, name: str) -> tuple[bool, Any]:
        """Whether per-micro-batch value ``name`` has the batch as its first dimension (-1 in the program),
        and its Paddle dtype."""
        key = (plan, name)
        if key not in self._batched:
            ref = plan.producers[name]
            shape, dtype = declared_var(plan.stages[ref.stage].sections[ref.kind].program, name)
            self._batched[key] = (len(shape) > 0 and shape[0] == -1, dtype)
        return self._batched[key]


def _size_mismatch(plan: Plan, size: int, expected: int, compiled: bool) -> str:
    """Why a step's micro-batches of ``size`` rows do not fit a plan that runs ``expected`` (compiled by
    ``micro_batch_size``, or fixed by the first step), and what would fit."""
    split = plan.dp_degree > 1 and plan.replica_batches == "split"
    what = (f"micro-batch size {size}" + (f" (after splitting among dp_degree={plan.dp_degree} replicas)" if split
                                          else " (this replica's own)" if plan.dp_degree > 1 else ""))
    fixed = "micro_batch_size=" if compiled else "the first step's micro-batch size "
    fits = expected * (plan.dp_degree if split else 1)
    return (f"{what} differs from {fixed}{expected} the plan runs; every micro-batch must have the same size: feed "
            f"micro-batches (loader batches) of {fits} samples, or global batches of {fits * plan.num_microbatches} "
            f"(num_microbatches={plan.num_microbatches}" + (f", dp_degree={plan.dp_degree})" if split else ")")
            + (f", or build the plan with micro_batch_size={size}" if compiled else ""))


def _locate_fetches(plan: Plan, fetch: list[str]) -> tuple[dict, dict]:
    """(per-micro-batch fetches: (stage, section kind) -> names; persistable fetches: name -> the stages that
    hold it). A data variable is in neither: its value is the batch fed."""
    where: dict[tuple[int, str], tuple[str, ...]] = {}
    persist: dict[str, list[int]] = {}
    for name in fetch:
        ref = plan.producers.get(name)
        if ref is not None:
            where[(ref.stage, ref.kind)] = where.get((ref.stage, ref.kind), ()) + (name,)
        elif name in plan.data_vars:
            continue
        elif plan.stage_of_var(name):
            persist[name] = plan.stage_of_var(name)
        else:
            raise ValueError(f"cannot fetch '{name}': it is not computed by the pipelined program nor "
                             "part of any stage's state")
    return where, persist


def _wait(futures: list[cf.Future], channel, failure: BaseException | None, outcomes: list, lane_cpu: list[float]
          ) -> list[StepResult]:
    """Wait for every lane (a failing rank has aborted the channel, so the others stop at their next
    receive) and raise the failed rank's error, not the others' ``PipelineAborted``; ``failure``: the
    calling thread's own lane's, ``outcomes``: its ranks' (result, exception). Each lane's thread CPU is
    added to ``lane_cpu``. An interrupt while waiting is the caller's to handle (``_settle``).

    The channel is aborted here too on ``failure``: a rank aborts it itself, but not an interrupt that
    comes before its ``try`` (the other ranks would wait for its messages for ever).
    ``Future.exception()`` waits, not ``cf.wait``: an interrupt inside ``cf.wait`` can leave a future's
    lock held by this thread (its ``_AcquireFutures.__enter__`` takes them in a Python loop), after which
    the worker can never set the future's result."""
    if failure is not None:
        channel.abort(str(failure) if isinstance(failure, StageError) else "interrupted")
    errors = [] if failure is None else [failure]
    for f in futures:
        exc = f.exception()
        if exc is None:
            outcomes += _outcomes(f.result(), lane_cpu)
        else:
            errors.append(exc)
    errors += [e for _, e in outcomes if e is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, PipelineAborted)), errors[0])
    return [r for r, _ in outcomes]


def _outcomes(lane: tuple[list, float], lane_cpu: list[float]) -> list:
    """The outcomes of a lane's ranks (``Devices.run_lane``), its thread's CPU added to ``lane_cpu``."""
    lane_cpu.append(lane[1])
    return lane[0]


def _settle(futures: list[cf.Future], channel) -> None:
    """After a step failed or was interrupted at any point, also half way through handing out its jobs:
    abort the channel (a running job stops at its next receive), cancel the jobs not started (one that an
    interrupt kept from being queued at all among them) and wait for the running ones. Without it a job
    handed out before an interrupt ran on, waiting in ``recv`` for messages of a step that had ended: it
    took the next step's messages, or kept ``Executor.close()`` and interpreter exit waiting for ever."""
    channel.abort("interrupted")
    for future in futures:
        if not future.cancel():  # running or done: wait until it is done
            future.exception()
