"""Exactly-once data across a restart: where each epoch's data stands, recorded in every checkpoint that
``train_from_dataset`` writes, and how a resumed process goes on with the batch the uninterrupted run would
have taken next.

Why by epoch and batch, with the random generators' state: a restarted script runs from its top and calls
``train_from_dataset`` once per epoch again. The calls before the checkpoint's epoch train nothing. The
checkpoint's own epoch reopens its loader with numpy's and Python's global generators as they were when it
first opened (a shuffle draws the same order, a generator makes the same batches) and starts after the
batches already trained: a dataset's sampler skips them unloaded, a generator's are made again and dropped
(a generator cannot be restored; that costs the time to make them). An epoch the checkpoint saw end is not
reopened: its call puts the generators back as they were when it ended. Every process of a launched job
records its own position (replicas may shuffle apart), and each resumes from its own.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import asdict, dataclass
from typing import Any

from .. import checkpoint, restarts
from ..io.position import Position, random_state
from ..plan import Plan


class Epochs:
    """One executor's training epochs of one program: how many calls came, the position a resumed checkpoint
    left to continue from, and the newest checkpoint written or resumed (for the launcher's reports)."""

    def __init__(self) -> None:
        self.count = 0
        self.resume_checked = False
        self.pending: Position | None = None
        self.scheduler_state: dict | None = None  # the resumed checkpoint's, put back at its epoch's call
        self.checkpoint: str | None = None
        self.checkpoint_step: int | None = None


_EPOCHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # executor -> {plan: Epochs}


def epochs_of(exe: Any, plan: Plan) -> Epochs:
    return _EPOCHS.setdefault(exe, {}).setdefault(plan, Epochs())


@dataclass(frozen=True)
class EpochStart:
    """Where a ``train_from_dataset`` call stands among the program's training epochs: its ``index``, the
    ``skipped`` batches a resumed checkpoint had trained on in it, the ``notes`` to print first, and
    ``passed``: None (train), "before" (the checkpoint's epoch is a later one) or "ended" (the checkpoint
    saw this epoch end): nothing to train."""

    epochs: Epochs
    index: int
    skipped: int = 0
    notes: tuple[str, ...] = ()
    passed: str | None = None


def start_epoch(exe: Any, program: Any, plan: Plan, loader: Any, directory: str | None,
                option: bool | None) -> EpochStart:
    """Count a ``train_from_dataset`` call; at the program's first, resume if ``option`` and the launcher
    say so; open ``loader`` where a resumed checkpoint's data stands, or stop it when the checkpoint had
    passed this epoch."""
    epochs = epochs_of(exe, plan)
    index, epochs.count = epochs.count, epochs.count + 1
    notes = ()
    if not epochs.resume_checked and directory is not None:
        epochs.resume_checked = True
        resume, job = wanted(option)
        notes = (load_newest(exe, program, epochs, directory, job),) if resume else ()
    pending = epochs.pending
    if pending is None:
        return EpochStart(epochs, index, notes=notes)
    if index < pending.epoch:
        _passed(loader, None)
        return EpochStart(epochs, index, notes=notes, passed="before")
    epochs.pending = None
    scheduler = getattr(program, "lr_scheduler", None)
    if scheduler is not None and epochs.scheduler_state is not None:  # undo a script's own steps in the epochs passed
        checkpoint.set_scheduler(scheduler, epochs.scheduler_state, os.path.join(epochs.checkpoint, checkpoint.META))
    if pending.ended:
        _passed(loader, pending)
        return EpochStart(epochs, index, notes=notes, passed="ended")
    _reopen(loader, pending)
    if getattr(loader, "batch_sampler", None) is not None:  # a map-style dataset's: the batches skipped unloaded
        notes += (f"staticpipe: the dataset's first {pending.batches} batches of epoch {index} are skipped unloaded: "
                  "random numbers its __getitem__ draws (augmentation) differ from the uninterrupted run's",)
    return EpochStart(epochs, index, pending.batches, notes)


def wanted(option: bool | None) -> tuple[bool, str | None]:
    """(whether to resume, the job whose checkpoints count: None for any) for ``train_from_dataset``'s
    ``resume``: True, or ``STATICPIPE_RESUME=1``: the newest checkpoint there is (a user's resume, or
    ``paddle.distributed.launch``'s restarts, which tell the ranks nothing); None: only when
    ``staticpipe.launch`` restarted the job, from a checkpoint of this job; False: never."""
    if option is False:
        return False, None
    if option is True or os.environ.get(restarts.ENV_RESUME) == "1":
        return True, None
    if restarts.restart_count() > 0:
        return True, restarts.job_id()
    return False, None


def load_newest(exe: Any, program: Any, epochs: Epochs, directory: str, job: str | None) -> str:
    """Load the newest checkpoint in ``directory`` (of ``job``, when given) into every stage and keep this
    process's data position for the epochs to come; the line that says what happened."""
    found = restarts.newest_checkpoint(directory, job)
    if found is None:
        return (f"staticpipe: resuming: no checkpoint {'of this job ' if job else ''}in {directory!r} yet; "
                "training from the start")
    path = os.path.abspath(found[0])
    meta = checkpoint.load(program, path, exe, with_position=True)  # refused whole if the position does not fit
    epochs.checkpoint, epochs.checkpoint_step = path, meta["step"]
    position = meta["position"]
    if position is None:
        return (f"staticpipe: resumed from {path} at step {meta['step']}; it records no data position, so every "
                "epoch trains again from the first, on its state")
    epochs.pending, epochs.scheduler_state = position, meta["lr_scheduler"]
    b = position.batches
    where = (f"epoch {position.epoch} had ended, epoch {position.epoch + 1} starts" if position.ended else
             f"epoch {position.epoch} goes on after its first {b} batch{'' if b == 1 else 'es'}")
    return f"staticpipe: resumed from {path} at step {meta['step']}: {where}"


def _reopen(loader: Any, position: Position) -> None:
    """Open ``loader``'s epoch again as ``position`` left it (a started loader is stopped and started again)."""
    started = getattr(loader, "started", False)
    if started:
        loader.reset()
    loader.resume_from(position)
    if started:
        loader.start()


def _passed(loader: Any, position: Position | None) -> None:
    """An epoch the checkpoint had already passed: its loader stops unread; once it is the checkpoint's own
    epoch, ended, the generators are put back as they were at its end."""
    if getattr(loader, "started", False):
        loader.reset()
    if position is not None:
        loader.resume_from(position)


def position_now(loader: Any, epoch: int, batches: int, ended: bool) -> dict[str, Any]:
    """This process's data position as a checkpoint records it (JSON values)."""
    state = random_state() if ended else loader.position().random if hasattr(loader, "position") else None
    return asdict(Position(epoch, batches, ended, state))


def report(step: int, epochs: Epochs) -> None:
    """Tell a restarting launcher how far this process got (nothing without one)."""
    restarts.report(restarts.Progress(step, epochs.checkpoint, epochs.checkpoint_step))
