"""How many threads run a plan's CPU ranks when the executor is not told (``worker_threads="auto"``, the
default): the first steps of the plan try each layout, and the rest run on the one that did best.

Why measure instead of a rule: whether ranks should share a thread depends on how long their actions
compute and on what a wake-up between threads costs, and both change from model to model and machine to
machine. A thread per rank lets large stages overlap on the cores (on 2 cores a 4-stage pipeline of
large layers steps 1.75x slower on one thread); one thread spares tiny stages a wake-up per message
(29 µs of CPU on one 2-core VM, more on others) and takes 40 % less CPU. Lanes (``lanes.py``) make the
layout invisible to the values, so a trial step on a worse layout costs time, never a different result.

The trial: after ``WARMUP`` steps (the first prepares programs and starts threads), rounds of one step on
each candidate, interleaved so that a slow spell of the machine hits every candidate alike, ``ROUNDS``
steps each; each candidate keeps its best step, and one whose best is ``DROP`` times another's is
tried no more (a layout 1.75x slower need not cost two more slow steps to be known). The candidates: a
thread per rank, one per core (when there are fewer cores than ranks) and one thread. The score is wall
time x CPU time of a step: the time the user waits and what the machine pays (every thread, the data
loader's included), a 10 % change in either counting the same. A tie keeps more threads.
"""
from __future__ import annotations

import logging
import math
import os

log = logging.getLogger("staticpipe")
WARMUP = 1  # steps not measured: the plan's first step prepares its runs and starts its threads
ROUNDS = 3  # measured steps per candidate; the best counts
DROP = 1.5  # a candidate whose best step scores this many times the best one's is tried no more


class ThreadChoice:
    """The trial for one plan whose CPU ranks number ``ranks`` (``devices``, for the log), on ``cores``
    cores. ``threads()`` is the number of threads for the next step, ``measured(threads, wall, cpu)``
    records a step that ran to its end; ``chosen`` is the number settled on, None while the trial runs."""

    def __init__(self, ranks: int, cores: int, devices: str = ""):
        self.devices = devices
        ranks = max(ranks, 1)
        self.candidates = sorted({ranks, min(ranks, max(cores, 1)), 1}, reverse=True)
        self.scores: dict[int, float] = {}  # candidate -> its best wall x CPU so far
        self._left = dict.fromkeys(self.candidates, ROUNDS)  # measured steps still to run on each
        self._next: int | None = self.candidates[0]
        self._steps = 0  # steps recorded
        self.chosen: int | None = self.candidates[0] if len(self.candidates) == 1 else None

    def threads(self) -> int:
        return self.chosen if self.chosen is not None else self._next

    def measured(self, threads: int, wall: float, cpu: float) -> None:
        """A step on ``threads`` threads ran to its end in ``wall`` seconds and ``cpu`` CPU seconds. A step
        that failed is not recorded: the next one takes its place in the trial."""
        if self.chosen is not None or threads != self.threads():
            return
        self._steps += 1
        if self._steps <= WARMUP:
            return
        self.scores[threads] = min(self.scores.get(threads, math.inf), wall * cpu)
        self._left[threads] -= 1
        best = min(self.scores.values())
        for n, score in self.scores.items():
            if score > DROP * best:
                self._left[n] = 0
        at = self.candidates.index(threads)
        after = self.candidates[at + 1:] + self.candidates[:at + 1]  # the next candidate round-robin
        self._next = next((n for n in after if self._left[n]), None)
        if self._next is None:
            self.chosen = min(self.scores, key=lambda n: (self.scores[n], -n))  # more threads on a tie
            log.info("staticpipe: the CPU ranks of %s run on %d thread(s) from now on (the best step's wall x CPU "
                     "time on each number of threads tried: %s)", self.devices, self.chosen,
                     {n: f"{score * 1e6:.3g} ms²" for n, score in self.scores.items()})


def cores() -> int:
    """The cores this process may run on (its affinity, where the system tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
