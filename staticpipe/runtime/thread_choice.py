"""How many threads run a plan's CPU ranks when the executor is not told (``worker_threads="auto"``, the
default): the first steps of the plan try each layout, and the rest run on the one that did best.

Why measure instead of a rule: whether ranks should share a thread depends on how long their actions
compute and on what a wake-up between threads costs, and both change from model to model and machine to
machine. A thread per rank lets large stages overlap on the cores (on 2 cores a 4-stage pipeline of
large layers steps 1.7x slower on one thread); one thread spares tiny stages a wake-up per message (29
µs of CPU on one 2-core VM, more on others) and takes 30-40 % less CPU. Lanes (``lanes.py``) make the
layout invisible to the values, so a trial step on a worse layout costs time, never a different result.

The trial: a round of one unmeasured step on each candidate (a new layout starts threads and warms
caches), then ``ROUNDS`` rounds of one measured step on each, interleaved so that a slow spell of the
machine hits every candidate alike; each candidate keeps its best step. The candidates: a thread per
rank, one per core (when there are fewer cores than ranks) and one thread. The score is wall time x CPU
time of a step: the time the user waits and what the machine pays (every thread, the data loader's
included), a 10 % change in either counting the same. A tie keeps more threads.

Only comparable steps count: those of the trial's first step's micro-batch shapes (an evaluation's
last, smaller batch does far less work), neither traced nor checked for NaN (extra work per action).
A step that does not count runs on the best layout so far; one that does not count or that fails leaves
the trial where it was.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Hashable

log = logging.getLogger("staticpipe")
ROUNDS = 3  # measured steps per candidate; the best counts


class ThreadChoice:
    """The trial for one plan whose CPU ranks number ``ranks`` (``devices``, for the log), on ``cores``
    cores. ``threads(counts)`` is the number of threads for the next step (``counts``: whether it will be
    measured), ``measured(threads, shapes, wall, cpu)`` records a step that ran to its end; ``chosen``
    is the number settled on, None while the trial runs."""

    def __init__(self, ranks: int, cores: int, devices: str = ""):
        self.devices = devices
        ranks = max(ranks, 1)
        self.candidates = sorted({ranks, min(ranks, max(cores, 1)), 1}, reverse=True)
        self._trial = self.candidates * (1 + ROUNDS)  # the steps of the trial, in order; the first round warms up
        self._done = 0  # steps of the trial run
        self.shapes: Hashable = None  # the micro-batch shapes of the trial's steps (its first step's)
        self.scores: dict[int, float] = {}  # candidate -> its best wall x CPU so far
        self.chosen: int | None = self.candidates[0] if len(self.candidates) == 1 else None

    def counts(self, shapes: Hashable) -> bool:
        """Whether a step of micro-batch ``shapes`` (not traced nor checked) counts in the trial."""
        return self.chosen is None and (self.shapes is None or shapes == self.shapes)

    def threads(self, counts: bool) -> int:
        if self.chosen is None and self._done >= len(self._trial):  # (a report cut short by an interrupt)
            self._choose()
        if self.chosen is not None:
            return self.chosen
        if counts:
            return self._trial[self._done]
        return min(self.scores, key=self._rank) if self.scores else self.candidates[0]

    def measured(self, threads: int, shapes: Hashable, wall: float, cpu: float) -> None:
        """A counting step of micro-batch ``shapes`` on ``threads`` threads ran to its end in ``wall``
        seconds and ``cpu`` CPU seconds."""
        if not self.counts(shapes) or threads != self.threads(True):
            return
        self.shapes, self._done = shapes, self._done + 1
        if self._done > len(self.candidates):  # past the warm-up round
            self.scores[threads] = min(self.scores.get(threads, math.inf), wall * cpu)
        if self._done == len(self._trial):
            self._choose()

    def _choose(self) -> None:
        self.chosen = min(self.candidates, key=self._rank)
        log.info("staticpipe: the CPU ranks of %s run on %d thread(s) from now on (the best step's wall x CPU time "
                 "on each number of threads tried: %s)", self.devices, self.chosen,
                 {n: f"{score * 1e6:.3g} ms²" for n, score in self.scores.items()})

    def _rank(self, n: int) -> tuple[float, int]:
        return self.scores.get(n, math.inf), -n  # the least score; more threads on a tie


def cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a container's
    ``--cpus``) where there is one."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota visible: the affinity is the limit
    return n
