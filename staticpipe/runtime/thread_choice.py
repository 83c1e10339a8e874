"""How many threads run a plan's CPU ranks when the executor is not told (``worker_threads="auto"``, the
default): the first steps of the plan measure the layouts that may be fastest, and the rest run on the
fastest.

Why measure instead of a rule: whether ranks should share a thread depends on how long their actions
compute and on what a wake-up between threads costs, and both change from model to model and machine to
machine. A thread per rank lets large stages overlap on the cores (on 2 cores a 4-stage pipeline of
large layers steps 1.7x slower on one thread); one thread spares tiny stages a wake-up per message (29
µs of CPU on one 2-core VM, more on others) and takes 30-40 % less CPU. Lanes (``lanes.py``) make the
layout invisible to the values, so a trial step on a worse layout costs time, never a different result.

Why not simply try every layout: a step on a worse layout is time the user waits. Large stages on one
thread step 2x slower, so trying it once costs a tenth of the first ten steps. Most such steps need not
run: a thread's step takes at least the CPU its ranks compute, so one step on a thread per rank (which
measures each rank's CPU) bounds every layout with fewer threads from below.

The rule (what the user waits for comes first; CPU breaks ties):

1. The plan's first step runs on a thread per rank, unmeasured (it prepares the runs).
2. The second, on a thread per rank, measures the wall time and each rank's thread CPU.
3. A layout of k threads cannot step faster than its busiest thread's ranks compute, nor than all the
   ranks compute spread over min(k, cores) cores: from each rank's CPU less ``WAKE_S`` per message it
   sends or receives (what a wake-up and the cold cache after it may have cost it, which a shared
   thread would save; it is large, for a bound that is too high would rule out the fastest). A layout
   whose bound is >= ``1 - SLACK`` of the measured wall cannot be more than ``SLACK`` faster: it is
   dropped without a step.
4. The others are measured one step each (after a first one that is not enough alone: a layout's first
   step on its threads runs on cold caches, slower than the next; it still counts as a step the layout
   took, for when a slow spell of the machine hits the next), fewest threads first; a layout more than
   ``CLEAR`` slower than the fastest step so far is dropped. When a thread per rank is dropped against one thread, so
   are the layouts between them, untried: what makes one thread faster (no wake-ups between threads)
   they have only in part. If more than one layout is left, each gets ``ROUNDS`` steps in all (more,
   up to ``MAX_ROUNDS``, until they add up to ``SHORT_S``: a step of a few ms varies by more than the
   layouts differ), interleaved (a slow spell of the machine hits each alike), and keeps its fastest.
5. Kept: the fastest; among the layouts within ``TIE`` of it, the one that took least CPU (every
   thread's, the data loader's included); on equal CPU, more threads.

Only comparable steps count: those of the trial's first step's micro-batch shapes (an evaluation's
last, smaller batch does far less work), neither traced nor checked for NaN (extra work per action).
A step that does not count runs on the fastest layout so far; one that does not count or that fails
leaves the trial where it was.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Hashable, Sequence

log = logging.getLogger("staticpipe")
ROUNDS = 2  # measured steps per layout still in the running after its first; the fastest counts
SHORT_S = 0.05  # ... or more, up to MAX_ROUNDS, until they add up to this: steps of a few ms vary more than layouts
MAX_ROUNDS = 4
WAKE_S = 500e-6  # the most CPU a message between threads is taken to cost its rank (up to 200 µs measured)
SLACK = 0.03  # a layout that can be at most this much faster is not tried
CLEAR = 0.10  # a layout this much slower than the fastest step so far is out after one step
TIE = 0.02  # walls within this are equal: the layout with less CPU is kept


class ThreadChoice:
    """The trial for one plan's ranks on ``cores`` cores. ``layouts``: for each number of threads to
    consider, the ranks (positions) each thread runs; the first, a thread per rank, must run each rank
    alone. ``messages``: per rank, the messages it sends or receives in a step. ``devices``: for the log.

    ``threads(counts)`` is the number of threads for the next step (``counts``: whether it will be
    measured); ``measured(threads, shapes, wall, cpu, lane_cpu)`` records a step that ran to its end;
    ``chosen`` is the number settled on, None while the trial runs."""

    def __init__(self, layouts: dict[int, list[list[int]]], messages: Sequence[int], cores: int, devices: str = ""):
        self.devices, self.layouts, self.messages, self.cores = devices, layouts, list(messages), max(cores, 1)
        self.candidates = sorted(layouts, reverse=True)
        if any(len(lane) != 1 for lane in layouts[self.candidates[0]]):
            raise ValueError(f"the first layout must run each rank alone, got {layouts[self.candidates[0]]}")
        self.open = list(self.candidates)  # still in the running
        self.walls: dict[int, list[float]] = {}  # layout -> the wall seconds of its measured steps
        self.cpus: dict[int, list[float]] = {}  # layout -> their CPU seconds
        self.bounds: dict[int, float] = {}  # layout -> the least wall it can have (rule 3)
        self.warmed: set[int] = set()  # the layouts whose first step ran
        self.cold: dict[int, tuple[float, float]] = {}  # layout -> the wall and CPU seconds of its first step
        self.shapes: Hashable = None  # the micro-batch shapes of the trial's steps (its first step's)
        self.chosen: int | None = self.candidates[0] if len(self.candidates) == 1 else None

    def counts(self, shapes: Hashable) -> bool:
        """Whether a step of micro-batch ``shapes`` (not traced nor checked) counts in the trial."""
        return self.chosen is None and (self.shapes is None or shapes == self.shapes)

    def threads(self, counts: bool) -> int:
        if self.chosen is not None:
            return self.chosen
        if counts:
            return self._next()
        return self._fastest() if self.walls else self.candidates[0]

    def measured(self, threads: int, shapes: Hashable, wall: float, cpu: float, lane_cpu: Sequence[float]) -> None:
        """A counting step of micro-batch ``shapes`` on ``threads`` threads ran to its end in ``wall``
        seconds and ``cpu`` CPU seconds (the process's), its threads ``lane_cpu`` each (in the order of
        the layout's lanes)."""
        if not self.counts(shapes) or threads != self.threads(True):
            return
        self.shapes = shapes
        if threads not in self.warmed:  # (a thread per rank's is the plan's first step: it prepares the runs)
            self.warmed.add(threads)
            if threads != self.candidates[0]:
                self.cold[threads] = (wall, cpu)
            return
        self.walls.setdefault(threads, []).append(wall)
        self.cpus.setdefault(threads, []).append(cpu)
        if threads == self.candidates[0] and not self.bounds:
            self._bound(wall, lane_cpu)
        fastest = min(self._wall(n) for n in self.walls)
        self.open = [n for n in self.open if n not in self.walls or self._wall(n) <= fastest * (1 + CLEAR)]
        if self.candidates[0] not in self.open and 1 in self.walls:  # one thread beat a thread per rank clearly
            self.open = [n for n in self.open if n in self.walls]
        if len(self.open) == 1 or all(self._measured_enough(n) for n in self.open):
            self._choose()

    def _measured_enough(self, n: int) -> bool:
        walls = self.walls.get(n, ())
        return len(walls) >= MAX_ROUNDS or len(walls) >= ROUNDS and sum(walls) >= SHORT_S

    def _bound(self, wall: float, rank_cpu: Sequence[float]) -> None:
        """Rule 3, from a step on a thread per rank: each rank's own CPU is its lane's."""
        work = [max(0.0, c - WAKE_S * n) for c, n in zip(rank_cpu, self.messages)]
        for n in self.candidates[1:]:
            lanes = self.layouts[n]
            self.bounds[n] = max(max(sum(work[i] for i in lane) for lane in lanes),
                                 sum(work) / min(len(lanes), self.cores))
        self.open = [n for n in self.open if self.bounds.get(n, 0.0) < (1 - SLACK) * wall]

    def _next(self) -> int:
        """The layout of the next counting step: a thread per rank until it is measured, then the open
        layouts with the fewest measured steps, fewest threads first."""
        if not self.walls:
            return self.candidates[0]
        return min((n for n in self.open if not self._measured_enough(n)), key=lambda n: (len(self.walls.get(n, ())), n))

    def _fastest(self) -> int:
        """Rule 5 among the layouts measured and still open."""
        measured = [n for n in self.open if n in self.walls]
        best = min(self._wall(n) for n in measured)
        near = [n for n in measured if self._wall(n) <= best * (1 + TIE)]
        return min(near, key=lambda n: (self._cpu(n), -n))

    def _wall(self, n: int) -> float:
        """Layout ``n``'s fastest step: its measured steps' and its cold first step's (slower, if anything,
        so it only counts when a slow spell of the machine hit every measured one)."""
        return min(self.walls[n] + [self.cold[n][0]] if n in self.cold else self.walls[n])

    def _cpu(self, n: int) -> float:
        return min(self.cpus[n] + [self.cold[n][1]] if n in self.cold else self.cpus[n])

    def _choose(self) -> None:
        self.chosen = self._fastest()
        log.info("staticpipe: the CPU ranks of %s run on %d thread(s) from now on (fastest step, ms of wall / CPU, "
                 "on each number of threads tried: %s; not tried, ruled out by their bound or by one thread's lead: "
                 "%s)", self.devices, self.chosen, {n: f"{self._wall(n) * 1e3:.3g} / {self._cpu(n) * 1e3:.3g}" for n in self.walls},
                 [n for n in self.candidates if n not in self.walls] or "none")


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
