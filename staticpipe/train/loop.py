"""``train_from_dataset``: one epoch of a loader through the pipeline, with progress, traced timelines,
learning-rate steps and periodic checkpoints."""
from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Sequence

from .. import checkpoint
from .._paddle import framework
from ..ir import var_names
from ..plan import require_plan
from .progress import Progress

if TYPE_CHECKING:
    from ..executor import Executor


def train_from_dataset(exe: "Executor", program: framework.Program, dataset: Any, fetch_list: Sequence | None = None,
                       fetch_info: Sequence[str] | None = None, print_period: int = 100, debug: bool = False,
                       lr_step: str | None = None, checkpoint_dir: str | None = None,
                       checkpoint_every: int | None = None, keep_last: int = 3) -> list[list]:
    """See ``Executor.train_from_dataset``."""
    plan = require_plan(program, "train_from_dataset")
    if dataset is None or not hasattr(dataset, "epoch"):
        raise ValueError("dataset must be a staticpipe.io.DataLoader (from_generator) with a generator set")
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
    names = var_names(fetch_list)
    labels = list(fetch_info) if fetch_info else ["loss" if n == plan.loss else n for n in names]
    if len(labels) != len(names):
        raise ValueError(f"fetch_info has {len(labels)} names for {len(names)} fetch_list entries")
    history: list[list] = []
    tracing, exe.trace = exe.trace, exe.trace or debug

    def due() -> bool:
        return bool(checkpoint_every) and exe.global_step % checkpoint_every == 0

    try:
        with Progress(labels, print_period) as progress:
            for batch in dataset.epoch():
                started = time.perf_counter()
                values = exe.run(program, feed=batch, fetch_list=names)
                if lr_step == "step":
                    program.lr_scheduler.step()
                history.append(values)
                progress.update(len(next(iter(batch.values()))), values, time.perf_counter() - started)
                if exe.trace and len(history) % print_period == 0:
                    progress.note(f"step {len(history)} timeline: {exe.timeline(program).summary()}")
                if due():
                    _checkpoint(exe, program, checkpoint_dir, keep_last)
            if exe.trace and history and len(history) % print_period:
                progress.note(f"step {len(history)} timeline: {exe.timeline(program).summary()}")
            if checkpoint_dir is not None and history and not due():
                _checkpoint(exe, program, checkpoint_dir, keep_last)
    finally:
        exe.trace = tracing
    if lr_step == "epoch":
        program.lr_scheduler.step()
    return history


def _checkpoint(exe: "Executor", program: framework.Program, directory: str, keep_last: int) -> None:
    """``staticpipe.save`` as ``<directory>/step-<global step>``, then delete all but the last ``keep_last``."""
    if not checkpoint.save(program, os.path.join(directory, f"step-{exe.global_step:08d}"), exe, exe.global_step):
        return
    saved = sorted(d for d in os.listdir(directory) if d.startswith("step-") and "." not in d)
    for old in saved[:-keep_last]:
        shutil.rmtree(os.path.join(directory, old))
