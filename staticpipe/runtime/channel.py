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
from _thread import allocate_lock as _allocate_lock
from abc import ABC, abstractmethod
from typing import Any, Hashable

import numpy as np

from .errors import PipelineAborted

Message = dict[str, Any]  # cut variable name -> tensor (already on the receiver's place)
POLL_S = 0.05


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

    def replica_mean(self, value: np.ndarray) -> np.ndarray:
        """The mean of ``value`` over the data-parallel replicas of this rank's stages, the same bits on
        each; a single pipeline is its own mean."""
        return value

    def replica_extreme(self, value: np.ndarray, largest: bool) -> np.ndarray:
        """The elementwise max (``largest``) or min of ``value`` over the replicas, as ``replica_mean``."""
        return value


class InProcessChannel(Channel):
    """Workers of one process: a mailbox keyed by message, under one lock. A receiver that finds its
    message missing parks on a raw lock of its own; the send leaves the message in the mailbox and the
    sending thread releases that lock at its next ``wake`` (Channel's docstring says when).

    Why so: a hand-off is the runtime's dearest step on a machine with fewer cores than stages, and a
    woken thread that must wait again costs another pair of context switches. With a
    ``threading.Condition`` on the mailbox lock (the previous design) the receiver woke while the sender
    still held that lock, and then again while the sender held the GIL; each wait also built a Condition
    and a lock in Python. Now the receiver is woken outside the mailbox lock, and when the sender is
    about to give up the GIL (a compute action, its own receive, the end of its step), so it usually
    wakes once, to a free mailbox and a free interpreter. A raw lock is what a Condition parks on, without
    the Python around it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards everything here
        self._cond = threading.Condition(self._lock)  # allreduce's
        self._box: dict[Hashable, Message] = {}
        self._waiting: dict[Hashable, Any] = {}  # message key -> its receiver's parked lock (held until sent)
        self._sums: dict[Hashable, dict] = {}
        self._aborted: str | None = None
        self._wakes = threading.local()  # per sending thread: the parked receivers it has yet to wake

    def send(self, key: Hashable, message: Message, dst_stage: int) -> None:
        with self._lock:
            self._check()
            if key in self._box:
                raise RuntimeError(f"message {key} was sent twice")
            self._box[key] = message
            waiter = self._waiting.pop(key, None)
        if waiter is not None:
            pending = getattr(self._wakes, "locks", None)
            if pending is None:
                pending = self._wakes.locks = []
            pending.append(waiter)

    def wake(self) -> None:
        pending = getattr(self._wakes, "locks", None)
        while pending:
            pending.pop().release()

    def recv(self, key: Hashable, src_stage: int) -> Message:
        self.wake()
        with self._lock:
            if key in self._box:
                return self._box.pop(key)
            self._check()
            waiter = self._waiting[key] = _allocate_lock()
            waiter.acquire()
        while True:
            waiter.acquire(True, POLL_S)  # released by the send, or by an abort
            with self._lock:
                if key in self._box:
                    self._waiting.pop(key, None)
                    return self._box.pop(key)
                self._check()  # an abort has emptied ``_waiting``

    def allreduce(self, key: Hashable, rank: int, value: np.ndarray, ranks: int) -> np.ndarray:
        """Added in rank order, so every rank gets bit-identical results."""
        self.wake()
        with self._cond:
            slot = self._sums.setdefault(key, {"parts": {}, "result": None, "taken": 0})
            slot["parts"][rank] = value
            if len(slot["parts"]) == ranks:
                parts = [slot["parts"][r] for r in range(ranks)]
                slot["result"] = sum(parts[1:], parts[0].copy())
                self._cond.notify_all()
            while slot["result"] is None:
                self._check()
                self._cond.wait(POLL_S)
            slot["taken"] += 1
            if slot["taken"] == ranks:
                del self._sums[key]
            return slot["result"]

    def abort(self, reason: str) -> None:
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()
            waiters, self._waiting = list(self._waiting.values()), {}
        for waiter in waiters:
            waiter.release()

    def flush(self) -> None:
        self.wake()

    def reset(self) -> None:
        with self._cond:
            self._box.clear()
            self._waiting.clear()
            self._sums.clear()
            self._aborted = None

    def _check(self) -> None:
        if self._aborted is not None:
            raise PipelineAborted(self._aborted)
