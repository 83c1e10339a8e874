"""``train_from_dataset`` and ``infer_from_dataset``: one epoch of a loader through the pipeline, with
progress, Paddle's ``fetch_handler``, traced timelines, learning-rate steps and periodic checkpoints."""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

from .. import checkpoint, restarts
from .._paddle import framework, np
from ..ir import var_names
from ..plan import FORWARD_ONLY, Plan, require_plan
from ..runtime.errors import non_finite_hint
from . import resume as resuming
from .feeding import loader_for, steps
from .progress import Progress



class Stepper(checkpoint.StateHolder, Protocol):
    """What a training epoch uses of an executor (``staticpipe.Executor`` is one): a step of a plan's
    micro-batches, tracing and its last timeline, and, for checkpoints, its state."""

    trace: bool

    def step(self, program: framework.Program, microbatches: list[dict], fetch_list: Sequence | None = None,
             return_merged: bool = True) -> list: ...

    def timeline(self, program: framework.Program) -> Any: ...


@dataclass
class Options:
    """``Executor.train_from_dataset``'s options beyond the program and the data, checked once."""

    fetch_list: Sequence | None = None
    fetch_info: Sequence[str] | None = None
    print_period: int = 100
    debug: bool = False
    fetch_handler: Any = None
    lr_step: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep_last: int = 3
    resume: bool | None = None

    def check(self, program: framework.Program) -> None:
        if self.lr_step not in (None, "step", "epoch"):
            raise ValueError(f"lr_step must be None, 'step' or 'epoch', got {self.lr_step!r}")
        if self.lr_step is not None and getattr(program, "lr_scheduler", None) is None:
            raise ValueError(f"lr_step={self.lr_step!r} needs an optimizer with a paddle.optimizer.lr.LRScheduler "
                             "learning rate; this program's learning rate is constant")
        if self.checkpoint_every is not None and (not isinstance(self.checkpoint_every, int)
                                                  or self.checkpoint_every < 1 or self.checkpoint_dir is None):
            raise ValueError(f"checkpoint_every must be an integer >= 1 and needs checkpoint_dir, got "
                             f"checkpoint_every={self.checkpoint_every!r}, checkpoint_dir={self.checkpoint_dir!r}")
        if not (self.resume is None or type(self.resume) is bool) or (self.resume and self.checkpoint_dir is None):
            raise ValueError(f"resume must be None, True or False, and True needs checkpoint_dir; got "
                             f"resume={self.resume!r}, checkpoint_dir={self.checkpoint_dir!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {self.keep_last!r}")
        handler = self.fetch_handler
        if handler is not None and not (hasattr(handler, "var_dict") and hasattr(handler, "handler")):
            raise ValueError("fetch_handler must be a paddle.static FetchHandler (var_dict, period_secs, handler), "
                             f"got {type(handler).__name__}")


def train_from_dataset(exe: Stepper, program: framework.Program, dataset: Any, options: Options) -> list[list]:
    """See ``Executor.train_from_dataset``; where a resumed checkpoint's data stands: ``train/resume.py``."""
    plan = require_plan(program, "train_from_dataset")
    options.check(program)
    loader = loader_for(program, plan, dataset, "train_from_dataset")
    fetched = _fetched(options, program, plan)  # its errors before the epoch is counted or its loader moved
    start = resuming.start_epoch(exe, program, plan, loader, options.checkpoint_dir, options.resume)
    if start.passed is None:
        return _epoch(exe, program, program, plan, loader, options, fetched, start)
    Progress([]).note("\n".join([*start.notes, f"staticpipe: epoch {start.index} was trained before the checkpoint "
                                                 "resumed; nothing to train"]))
    if start.passed == "ended" and options.lr_step == "epoch":  # its checkpoint came before the epoch's step
        program.lr_scheduler.step()
    return []


def infer_from_dataset(exe: Stepper, program: framework.Program, forward: framework.Program, dataset: Any,
                       options: Options) -> list[list]:
    """See ``Executor.infer_from_dataset``; ``forward`` is ``program``'s forward-only pipelined twin."""
    options.check(program)
    plan = require_plan(forward, "infer_from_dataset")
    return _epoch(exe, program, forward, plan, loader_for(program, plan, dataset, "infer_from_dataset"), options,
                  _fetched(options, program, plan))


def _epoch(exe: Stepper, program: framework.Program, runs: framework.Program, plan: Plan, loader: Any,
           options: Options, fetched: tuple[list[str], list[str]], training: resuming.EpochStart | None = None
           ) -> list[list]:
    """One epoch of ``loader`` as steps of ``runs`` (``program`` itself, or its forward-only twin);
    ``fetched``: ``_fetched``'s names and labels; ``training``: where it stands among the program's training
    epochs (None: inference)."""
    names, labels = fetched
    handler = _Handler(options.fetch_handler, program)
    history: list[list] = []
    tracing, exe.trace = exe.trace, exe.trace or options.debug
    m, period = plan.num_microbatches, options.print_period
    warned_non_finite = False
    try:
        with Progress(labels, period, done="inferred" if plan.schedule == FORWARD_ONLY else "trained") as progress:
            for note in training.notes if training else ():
                progress.note(note)
            for micro, last in _marked_last(steps(loader.epoch(), m, progress.note)):
                if not history:
                    rows = len(next(iter(micro[0].values())))
                    own = plan.dp_degree > 1 and plan.replica_batches == "own"  # Paddle's fleet: this replica's
                    replicas = (f" ({plan.dp_degree} replicas, each fed its own)" if own else
                                f" split among {plan.dp_degree} data-parallel replicas" if plan.dp_degree > 1 else "")
                    progress.note(f"staticpipe: a loader batch is one micro-batch: micro-batch size {rows}, "
                                  f"{m} micro-batches per step, global batch {rows * m * (plan.dp_degree if own else 1)}"
                                  f"{replicas}")
                started = time.perf_counter()
                values = exe.step(runs, micro, names + handler.names)
                if options.lr_step == "step":
                    program.lr_scheduler.step()
                history.append(values[:len(names)])
                handler.update(values[len(names):])
                if not warned_non_finite and (hint := non_finite_hint(labels, values[:len(names)])):
                    warned_non_finite = True
                    progress.note(f"step {len(history)}: {hint}")
                progress.update(len(micro) * len(next(iter(micro[0].values()))), values[:len(names)],
                                time.perf_counter() - started)
                if exe.trace and len(history) % period == 0:
                    progress.note(f"step {len(history)} timeline: {exe.timeline(runs).summary()}")
                if options.checkpoint_dir is not None and (last or _due(exe, options)):
                    _checkpoint(exe, program, loader, options, training, len(history) * m, ended=last)
                if training is not None:
                    resuming.report(exe.global_step, training.epochs)
            if exe.trace and history and len(history) % period:
                progress.note(f"step {len(history)} timeline: {exe.timeline(runs).summary()}")
    finally:
        exe.trace = tracing
    if not history and not (training and training.skipped):  # a resumed epoch may have had no step left
        raise ValueError(f"the epoch trained no step: {_why_empty(loader, m)}")
    if options.lr_step == "epoch":
        program.lr_scheduler.step()
    return history


def _fetched(options: Options, program: framework.Program, plan: Plan) -> tuple[list[str], list[str]]:
    """(the names of ``fetch_list``, their labels: ``fetch_info`` or the names, the loss's "loss")."""
    names = var_names(options.fetch_list, program)
    labels = list(options.fetch_info) if options.fetch_info else ["loss" if n == plan.loss else n for n in names]
    if len(labels) != len(names):
        raise ValueError(f"fetch_info has {len(labels)} names for {len(names)} fetch_list entries")
    return names, labels


def _why_empty(loader: Any, num_microbatches: int) -> str:
    """Why an epoch of ``loader`` made no step, from its counts (``DataLoader.last_epoch``)."""
    stats = getattr(loader, "last_epoch", None)
    if stats is None:
        return "the loader gave no batch"
    if stats.batches:
        return (f"the loader gave {stats.batches} batch(es), fewer than the num_microbatches={num_microbatches} "
                "a step takes (a loader batch is one micro-batch)")
    if stats.dropped_samples:
        return (f"the loader gave no batch: its data had {stats.dropped_samples} sample(s), fewer than "
                f"batch_size={loader.batch_size}, and drop_last=True dropped them")
    return "the loader gave no batch: its data source yielded nothing"


class _Handler:
    """Paddle's ``fetch_handler``: every ``period_secs`` seconds, ``handler({key: value})`` with the current
    values of the variables of its ``var_dict`` (Paddle calls it from a monitor thread; here it is called
    after the first step that ends ``period_secs`` or more after the previous call)."""

    def __init__(self, fetch_handler: Any, program: Any = None):
        self.handler = fetch_handler
        var_dict = getattr(fetch_handler, "var_dict", {}) or {}
        self.keys = list(var_dict)
        self.names = var_names(list(var_dict.values()), program)
        self.last = time.monotonic()

    def update(self, values: list) -> None:
        if self.handler is None or time.monotonic() - self.last < getattr(self.handler, "period_secs", 60):
            return
        self.last = time.monotonic()
        self.handler.handler({k: None if v is None else np.asarray(v) for k, v in zip(self.keys, values)})


def _marked_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, whether it is the last)``, reading one item ahead: the epoch's last step is known before its
    checkpoint is written, which then records the epoch as ended (a resume does not open it again). When
    reading ahead fails (a bad batch, the source's error), the item already read still comes first, not
    the last: its step trains and its checkpoint is written as without reading ahead, then the error."""
    end = object()
    item = next(items, end)
    while item is not end:
        try:
            following = next(items, end)
        except Exception:
            yield item, False
            raise
        yield item, following is end
        item = following


def _due(exe: Stepper, options: Options) -> bool:
    return bool(options.checkpoint_every) and exe.global_step % options.checkpoint_every == 0


def _checkpoint(exe: Stepper, program: framework.Program, loader: Any, options: Options, training: resuming.EpochStart | None,
                batches: int, ended: bool) -> None:
    """``staticpipe.save`` as ``<checkpoint_dir>/step-<global step>`` with where the data stands (a training
    epoch's ``batches`` trained on), then delete all but the last ``keep_last``."""
    directory, job = options.checkpoint_dir, restarts.job_id()
    path = os.path.join(directory, f"step-{exe.global_step:08d}")
    data = None if training is None else resuming.position_now(loader, training.index, training.skipped + batches, ended)
    wrote = checkpoint.save(program, path, exe, exe.global_step, data=data, job=job)
    if training is not None:
        training.epochs.checkpoint, training.epochs.checkpoint_step = os.path.abspath(path), exe.global_step
    if not wrote:
        return
    for old, _ in restarts.checkpoints(directory, job)[options.keep_last:]:  # this job's: an earlier job's stay
        shutil.rmtree(old)
