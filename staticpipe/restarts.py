"""What a launcher that restarts a failed job and the ranks it restarts tell each other: which run of the
job this is, how far each rank got, and which checkpoints a job wrote.

Why environment variables and files, and no Paddle here: the launcher must name what a failure cost (the
step the job had reached, the checkpoint it resumes from) after the rank that failed is dead, and it must
start in a fraction of a second, so it imports nothing heavy; a rank learns from its environment that it
is a restart and then loads, in ``train_from_dataset``, the newest checkpoint its own job wrote (never one
an earlier job left in the same directory: each checkpoint records the job that wrote it).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass

ENV_RESTART = "STATICPIPE_RESTART"    # "k": this run is the job's k-th restart ("0": its first run)
ENV_JOB = "STATICPIPE_JOB"            # the launch's id, recorded in every checkpoint the job writes
ENV_PROGRESS = "STATICPIPE_PROGRESS"  # the file in which this rank reports its progress to the launcher
ENV_RESUME = "STATICPIPE_RESUME"      # "1": resume from the newest checkpoint in checkpoint_dir (any job's)
CHECKPOINT = re.compile(r"step-(\d+)")  # the names train_from_dataset gives the checkpoints it writes
META = "meta.json"


def restart_count() -> int:
    """Which restart of its job this process is (0: the first run, or not launched with restarts)."""
    value = os.environ.get(ENV_RESTART, "0")
    if not value.isdigit():
        raise ValueError(f"{ENV_RESTART}={value!r} must be a count of restarts (0, 1, ...)")
    return int(value)


def job_id() -> str | None:
    """The id of the launch this process belongs to, or None outside a launcher with restarts."""
    return os.environ.get(ENV_JOB) or None


@dataclass(frozen=True)
class Progress:
    """What a rank last reported: the global step it completed, and the newest checkpoint it saved or
    resumed from (its path and step; None before the first)."""

    step: int
    checkpoint: str | None = None
    checkpoint_step: int | None = None


def report(progress: Progress) -> None:
    """Write ``progress`` where the launcher reads it (``STATICPIPE_PROGRESS``); nothing without a launcher.
    Written to a temporary file and renamed, so the launcher never reads half of it."""
    file = os.environ.get(ENV_PROGRESS)
    if not file:
        return
    tmp = f"{file}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(progress), f)
    os.replace(tmp, file)


def read_progress(file: str) -> Progress | None:
    """The progress in ``file``, or None when the rank never reported (or the file is not a report)."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        return Progress(**data)
    except (OSError, ValueError, TypeError):
        return None


def newest_checkpoint(directory: str, job: str | None = None) -> tuple[str, int] | None:
    """(path, step) of the newest whole checkpoint ``train_from_dataset`` wrote in ``directory`` (a
    ``step-<n>`` directory holding its ``meta.json``, which a save puts in place last), of the job ``job``
    when given; None when there is none."""
    found = checkpoints(directory, job, everyone=job is None)
    return found[0] if found else None


def checkpoints(directory: str, job: str | None, everyone: bool = False) -> list[tuple[str, int]]:
    """(path, step) of the whole checkpoints in ``directory`` of the job ``job`` (None: written outside a
    launcher with restarts), or of any job with ``everyone``, newest first."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        if (m := CHECKPOINT.fullmatch(name)) is None:
            continue
        path = os.path.join(directory, name)
        try:
            with open(os.path.join(path, META), encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and (everyone or meta.get("job") == job):
            found.append((path, int(m.group(1))))
    return sorted(found, key=lambda found: found[1], reverse=True)
