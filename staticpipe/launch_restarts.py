"""The launcher's record of the runs of one job under ``python -m staticpipe.launch --max-restarts N``:
what each run tells its ranks, and the one line that says what a failed run cost and what happens next.

Why apart from launch.py: launch.py starts, watches and stops the ranks of one run; this is what outlives
a run -- the job's id, the restarts used, the failures so far, where the ranks save their checkpoints --
and reads only the small files of the contract in ``restarts`` (no Paddle: the launcher starts fast).

A run's progress reports are removed before it starts, so the step a run "reached" is its own: the max
``step`` its ranks reported, else the step of the checkpoint it resumed from (a run that fails before its
first step lost nothing since), else none ("before its first step"). The checkpoint directory is
remembered across runs: a restarted run that fails before it reports still resumes from the newest one.
"""
from __future__ import annotations

import contextlib
import os
import secrets

from .restarts import ENV_JOB, ENV_PROGRESS, ENV_RESTART, newest_checkpoint, read_progress


class Runs:
    """The runs of one launch: the first, then up to ``max_restarts`` restarts ``delay_s`` seconds apart."""

    def __init__(self, reports: str, nprocs: int, max_restarts: int, delay_s: float):
        self.job = secrets.token_hex(8)  # once per launch: the checkpoints of this job, not of an earlier one
        self.progress_files = [os.path.join(reports, f"progress-rank{rank}.json") for rank in range(nprocs)]
        self.max_restarts, self.delay_s = max_restarts, delay_s
        self.restart = 0  # the run now starting or running: its number of restarts before it
        self.checkpoints: str | None = None  # the directory the ranks save checkpoints in, once one reported it
        self.resumed: tuple[str, int] | None = None  # (path, step) of the checkpoint this run resumes from
        self.failures: list[tuple[int, int, int | None]] = []  # (culprit rank, its return code, step reached)

    def environments(self) -> list[dict[str, str]]:
        """Each rank's ``restarts`` variables for the run about to start: the run's number and the job's id
        on every run (without restarts, its checkpoints record the job, to no effect); the file to report
        progress in only with restarts (a file written every step is a cost for nothing without them)."""
        for file in self.progress_files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(file)
        return [{ENV_RESTART: str(self.restart), ENV_JOB: self.job, **({ENV_PROGRESS: file} if self.max_restarts else {})}
                for file in self.progress_files]

    def failed(self, why: str, rank: int, returncode: int) -> str:
        """Record that this run failed (``why``: the launcher's verdict naming ``rank``, which ended with
        ``returncode``); the verdict and the step the job had reached, "rank 1 exited with code 3 at step 7"."""
        reports = [p for p in map(read_progress, self.progress_files) if p is not None]
        for p in reports:
            if p.checkpoint is not None:
                self.checkpoints = os.path.dirname(os.path.normpath(p.checkpoint))
        steps = [p.step for p in reports] or ([self.resumed[1]] if self.resumed else [])
        step = max(steps, default=None)
        self.failures.append((rank, returncode, step))
        return f"{why} {'before its first step' if step is None else f'at step {step}'}"

    def next(self, failed: str) -> str | None:
        """The line for the failure ``failed`` (``Runs.failed``) with a restart: which, when, from which
        checkpoint and the steps lost; None when none is left."""
        if self.restart == self.max_restarts:
            return None
        self.restart += 1
        self.resumed = newest_checkpoint(self.checkpoints, self.job) if self.checkpoints else None
        step = self.failures[-1][2] or 0
        if self.resumed is None:
            lost = f", {_steps(step)} lost" if step else ""
            source = f"from the start (no checkpoint yet{lost})"
        else:
            lost = step - self.resumed[1]
            source = f"resuming from {self.resumed[0]} ({_steps(lost) if lost > 0 else 'no step'} lost)"
        return f"{failed}; restart {self.restart} of {self.max_restarts} in {float(self.delay_s)} s, {source}"

    def last(self, failed: str) -> str:
        """The line for the failure ``failed`` that ends the job, its restarts used up; it says so when every
        run failed the same way (same rank, return code and step): a bug to fix, restarts cannot help."""
        runs = len(self.failures)
        if len(set(self.failures)) == 1:
            return (f"{failed} in each of the {runs} runs: the same failure every time (a bug, not a fault); "
                    "not restarting again")
        return f"{failed} in run {runs} of {runs}; no restart left, stopped the other ranks"


def _steps(n: int) -> str:
    return f"{n} step{'s' if n != 1 else ''}"
