"""Channels: how a route's tensors travel from one stage worker to another.

The runtime only calls ``send``, ``recv``, ``allreduce``, ``replica_mean``, ``replica_extreme``, ``abort``, ``reset`` and
``flush``. Keys name messages: ``(route, micro-batch)`` for the cut variables of a schedule (the plan's
``Route``s), ``("opt", exchange)`` for the once-per-step exchanges of the optimize sections (the plan's
``Exchange``s). The in-process implementation below keeps a mailbox keyed that way, so a message can
never be matched to the wrong receiver. A transport on ``paddle.distributed`` implements the same
methods (``distributed.py``).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Hashable

import numpy as np

from . import lanes
from .errors import PipelineAborted

Message = dict[str, Any]  # cut variable name -> tensor (already on the receiver's place)


class Channel(ABC):
    @abstractmethod
    def send(self, key: Hashable, message: Message, dst_stage: int) -> None: ...

    @abstractmethod
    def recv(self, key: Hashable, src_stage: int) -> Message:
        """The message sent under ``key``; its values are tensors or numpy arrays."""

    @abstractmethod
    def allreduce(self, key: Hashable, rank: int, value: np.ndarray, ranks: int) -> np.ndarray:
        """Sum ``value`` over the ``ranks`` ranks of this pipeline (``rank`` is the caller's; every rank
        calls it once with the same ``key``) and return the same bits to each."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Wake every blocked ``recv`` with ``PipelineAborted``; later calls raise it too."""

    @abstractmethod
    def reset(self) -> None:
        """Forget pending messages and a past abort (between steps)."""

    def flush(self) -> None:
        """Return once every message sent so far has left this process (and, in-process, has woken its
        receiver)."""

    def wake(self) -> None:
        """Wake the receivers of what this thread has sent. A send may leave that for later, so that the
        receiver is woken when the sender is about to give up the GIL rather than while it holds it; the
        runtime calls this before each compute action and at the end of a rank's step, and ``recv``,
        ``allreduce`` and ``flush`` call it first. A receiver that is never woken still finds its message
        at its next poll."""

    replicas = 1  # data-parallel copies of the pipeline this channel's job runs
    sharding, shard = 1, None  # ZeRO-1: replicas per sharding group, and this rank's place in its group

    def shard_exchange(self, mine: Message) -> Message:
        """Every member's ``mine`` to every member of this rank's sharding group, merged (each member
        calls it, in the same order); without sharding, ``mine``."""
        return mine

    def replica_mean(self, value: np.ndarray) -> np.ndarray:
        """The mean of ``value`` over the data-parallel replicas of this rank's stages, the same bits on
        each; a single pipeline is its own mean."""
        return value

    def replica_extreme(self, value: np.ndarray, largest: bool) -> np.ndarray:
        """The elementwise max (``largest``) or min of ``value`` over the replicas, as ``replica_mean``."""
        return value


class InProcessChannel(Channel):
    """Ranks of one process: a mailbox keyed by message, under one lock. A receiver whose message is
    missing leaves its waiter (``lanes.py``: its lane and greenlet) under the key and gives way; the send
    leaves the message in the mailbox and makes the receiver ready, and when the receiver's lane sleeps
    on another thread, the sending thread wakes it at its next ``wake`` (Channel's docstring says when).

    Why so: a hand-off between threads is the runtime's dearest step on a machine with fewer cores than
    ranks, and a woken thread that must wait again costs another pair of context switches. So the
    receiver is woken outside the mailbox lock, and when the sender is about to give up the GIL (a
    compute action, its own receive, the end of its step): it usually wakes once, to a free mailbox and
    a free interpreter. Between ranks of one lane there is no thread to wake at all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards everything here
        self._box: dict[Hashable, Message] = {}
        self._waiting: dict[Hashable, tuple] = {}  # message key -> its receiver's waiter (until sent)
        self._sums: dict[Hashable, _Sum] = {}
        self._aborted: str | None = None
        self._wakes = threading.local()  # per sending thread: the sleeping lanes it has yet to wake

    def send(self, key: Hashable, message: Message, dst_stage: int) -> None:
        with self._lock:
            self._check()
            if key in self._box:
                raise RuntimeError(f"message {key} was sent twice")
            self._box[key] = message
            waiter = self._waiting.pop(key, None)
            if waiter is not None:
                self._ready(waiter)

    def wake(self) -> None:
        pending = getattr(self._wakes, "lanes", None)
        while pending:
            pending.pop().wake()

    def recv(self, key: Hashable, src_stage: int) -> Message:
        self.wake()
        with self._lock:
            message = self._box.pop(key, None)
            if message is not None:  # (the usual case on one thread: sent before; no lane to look up)
                return message
            self._check()
            lane = lanes.current()
            self._waiting[key] = lane.waiter()
        while True:
            lane.give_way()  # until the send (or an abort) makes this rank ready
            with self._lock:
                if key in self._box:
                    self._waiting.pop(key, None)
                    return self._box.pop(key)
                self._check()  # an abort has emptied ``_waiting``

    def allreduce(self, key: Hashable, rank: int, value: np.ndarray, ranks: int) -> np.ndarray:
        """Added in rank order, so every rank gets bit-identical results."""
        self.wake()
        lane = lanes.current()
        with self._lock:
            self._check()
            total = self._sums.setdefault(key, _Sum())
            total.parts[rank] = value
            if len(total.parts) == ranks:
                parts = [total.parts[r] for r in range(ranks)]
                total.result = sum(parts[1:], parts[0].copy())
                for waiter in total.waiters:
                    self._ready(waiter)
                total.waiters = []
            else:
                total.waiters.append(lane.waiter())
        while total.result is None:
            lane.give_way()
            with self._lock:
                self._check()
        with self._lock:
            total.taken += 1
            if total.taken == ranks:
                del self._sums[key]
        return total.result

    def abort(self, reason: str) -> None:
        with self._lock:
            self._aborted = reason
            waiters, self._waiting = list(self._waiting.values()), {}
            for total in self._sums.values():
                waiters += total.waiters
                total.waiters = []
            for waiter in waiters:
                self._ready(waiter)
        self.wake()

    def flush(self) -> None:
        self.wake()

    def reset(self) -> None:
        with self._lock:
            self._box.clear()
            self._waiting.clear()
            self._sums.clear()
            self._aborted = None

    def _ready(self, waiter: tuple) -> None:
        """Under the lock: make a waiting receiver ready; its lane, if asleep, is woken at this thread's next
        ``wake``."""
        lane, g = waiter
        if lane.ready(g):
            pending = getattr(self._wakes, "lanes", None)
            if pending is None:
                pending = self._wakes.lanes = []
            pending.append(lane)

    def _check(self) -> None:
        if self._aborted is not None:
            raise PipelineAborted(self._aborted)


class _Sum:
    """One in-process all-reduce: the parts so far, the total once all are in, who waits for it."""

    __slots__ = ("parts", "result", "taken", "waiters")

    def __init__(self) -> None:
        self.parts: dict[int, np.ndarray] = {}
        self.result: np.ndarray | None = None
        self.taken = 0
        self.waiters: list[tuple] = []
