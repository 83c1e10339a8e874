"""Lanes: the OS threads that run this process's ranks, several ranks to a thread if need be, each rank a
greenlet that gives way to the lane's other ranks where it would wait.

Why: a thread per rank pays for every message that finds its receiver asleep: a wake-up, often a second
one when the woken thread meets the GIL, and on another core a cold cache. An empty message through the
in-process channel costs 29 µs of CPU between threads on two cores of a 2-core VM, 11 µs between threads
on one core, and 4 µs between ranks of one lane (a greenlet switch); the lane's thread sleeps only when
none of its ranks can go on. Tiny stages feel it: on one thread a 4-stage pipeline of them takes 40 %
less CPU and no more time (``bench/worker_threads.py``). Large stages do not, and step fastest on a
thread each: the executor's first steps try both (``thread_choice.py``).

Why greenlets, not generators: a rank waits deep inside its step (a receive in the middle of its action
list, an all-reduce inside its optimize phase); a greenlet pauses right there, where a generator would
need every function above the wait rewritten. Ranks switch only where they would wait, so a lane runs
each rank's actions exactly in its list's order, as a thread of its own would: which lane runs a rank
changes no value, only how the ranks overlap.

The channel (``channel.py``) is the only one that waits: ``current()`` is the calling thread's lane (a
thread outside any lane gets a lane of its own that parks the thread itself), ``waiter()`` what a
waiting receive leaves for its sender, ``ready()`` what the sender calls, ``give_way()`` what the
receiver calls until its message is there.
"""
from __future__ import annotations

import threading
import time
from _thread import allocate_lock
from collections import deque
from contextlib import suppress
from typing import Any, Callable

import greenlet

POLL_S = 0.05  # a lane that no one wakes looks again this often: never a hang on a lost wake-up

_local = threading.local()
Outcome = tuple[Any, "BaseException | None"]  # (result, exception) of one rank's call


class Lane:
    """One OS thread's ranks. ``run`` runs calls as greenlets until every one is done; the ready queue
    and the parked flag are shared with other threads' senders, under the lane's lock."""

    def __init__(self, timed: bool = False) -> None:
        self._timed = timed  # keep ``away_cpu`` (a traced step's): two system calls per wait, so only then
        self._lock = allocate_lock()
        self._ready: deque = deque()  # greenlets made ready by a message (or an abort)
        self._parked = False  # the thread sleeps on ``_wake`` (taken while awake)
        self._wake = allocate_lock()
        self._wake.acquire()
        self._hub: greenlet.greenlet | None = None  # the greenlet of ``run``; None: a thread outside lanes
        self._away: dict[greenlet.greenlet, float] = {}  # greenlet -> thread CPU spent while it gave way
        self._lets: list[greenlet.greenlet] = []  # the ranks ``run`` runs

    def waiter(self) -> tuple["Lane", greenlet.greenlet | None]:
        """What a receive that must wait leaves for ``ready``: this lane and the greenlet to resume."""
        return self, greenlet.getcurrent() if self._hub is not None else None

    def ready(self, g: greenlet.greenlet | None) -> bool:
        """Make ``g`` runnable again (None: the thread outside lanes); True if the lane's thread sleeps, or
        may, and must be woken (``wake``), which the caller may put off until it is about to give up the
        GIL. A thread outside lanes is always woken: it may be on its way to sleep."""
        with self._lock:
            if g is None:
                return True
            self._ready.append(g)
            parked, self._parked = self._parked, False
        return parked

    def wake(self) -> None:
        with suppress(RuntimeError):  # already woken (a poll found its work first)
            self._wake.release()

    def give_way(self) -> None:
        """Wait for the next ``ready``: the lane's other ranks run meanwhile; a thread outside lanes sleeps
        (at most ``POLL_S``: the caller looks again, and a wake meant for an earlier wait only makes it
        look once more)."""
        if self._hub is None:
            self._wake.acquire(True, POLL_S)
            return
        if not self._timed:
            self._hub.switch()
            return
        cpu = time.thread_time()
        self._hub.switch()
        me = greenlet.getcurrent()  # (not held across the switch: a suspended frame holding its own greenlet)
        self._away[me] = self._away.get(me, 0.0) + time.thread_time() - cpu

    def away_cpu(self) -> float:
        """The thread CPU seconds other ranks of the lane have spent while the calling rank gave way (a
        traced action's own CPU excludes it), kept by a lane made ``timed``."""
        return self._away.get(greenlet.getcurrent(), 0.0)

    def run(self, calls: list[tuple[Callable[[], Any], Callable[[], None]]], interrupted: Callable[[], None]
            ) -> list[Outcome]:
        """Run each ``(call, enter)`` as a greenlet on this thread (``enter`` is called whenever the lane
        switches to a call other than the last one: the rank's intra-op thread budget) until all are
        done, and return their outcomes in order. An exception of the lane's own loop (an interrupt
        between ranks) calls ``interrupted`` (which must make every waiting rank ready, with an
        error) and is raised once every rank has finished."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        if len(calls) == 1:  # a rank alone needs no greenlet: its waits park the thread (its own lane)
            calls[0][1]()
            try:
                return [(calls[0][0](), None)]
            except BaseException as exc:  # noqa: BLE001 -- as a greenlet's
                return [(None, _stopping(exc, interrupted))]

        def body(i: int, call: Callable[[], Any]) -> None:
            try:
                outcomes[i] = (call(), None)
            except BaseException as exc:  # noqa: BLE001 -- handed to the step, which raises it
                outcomes[i] = (None, _stopping(exc, interrupted))

        lets: list[greenlet.greenlet] = []
        failure = None
        try:
            self._hub, _local.lane, self._lets = greenlet.getcurrent(), self, lets
            lets += [greenlet.greenlet(lambda i=i, c=c: body(i, c)) for i, (c, _) in enumerate(calls)]
            enter = {g: e for g, (_, e) in zip(lets, calls)}
            self._ready.extend(lets)
            live, last = len(lets), None
            while live:
                try:
                    g = self._next()
                    if g is None or g.dead:  # (dead: queued twice by an interrupt's or a poll's looking again)
                        continue
                    if g is not last:
                        enter[g]()
                        last = g
                    g.switch()
                    live -= g.dead
                except BaseException as exc:  # noqa: BLE001 -- the ranks finish first (they hold scopes)
                    if failure is None:
                        failure = exc
                        interrupted()
                    self._look_again()  # one popped but not resumed too: each stops at its next wait
                    live = sum(not g.dead for g in lets)
            if failure is not None:
                raise failure
            return outcomes  # type: ignore[return-value]
        finally:
            self._hub, _local.lane, self._lets = None, None, []
            for g in lets:  # left suspended only by a second interrupt: its step's cleanup runs now
                if not g.dead:
                    with suppress(BaseException):  # an error is on its way out already
                        g.throw()
            self._ready.clear()
            self._away.clear()

    def _next(self) -> greenlet.greenlet | None:
        """The next ready greenlet, or None after sleeping until one may be (``ready`` or a poll). A poll
        that finds nothing makes every rank look again, so that a wake-up lost to an interrupt (a waiter
        taken from the channel but never made ready) costs ``POLL_S``, never a hang."""
        with self._lock:
            if self._ready:
                return self._ready.popleft()
            self._parked = True
        woken = self._wake.acquire(True, POLL_S)
        with self._lock:
            self._parked = False
        if not woken:
            self._look_again()
        return None

    def _look_again(self) -> None:
        """Make every unfinished rank ready: each one resumed re-checks what it waits for (the channel's
        loops allow for that), and gives way again or raises the channel's abort."""
        with self._lock:
            self._ready.clear()
            self._ready.extend(g for g in self._lets if not g.dead)


def _stopping(exc: BaseException, interrupted: Callable[[], None]) -> BaseException:
    """A rank's outcome: an interrupt (not an ``Exception``) also stops the other ranks, for it may have
    come before the rank's own handler could (a failing rank stops them itself, with its reason)."""
    if not isinstance(exc, Exception):
        interrupted()
    return exc


def current() -> Lane:
    """The calling thread's lane: the one running it, else a lane of its own (kept per thread)."""
    lane = getattr(_local, "lane", None)
    if lane is None:
        lane = getattr(_local, "own", None)
        if lane is None:
            lane = _local.own = Lane()
    return lane
