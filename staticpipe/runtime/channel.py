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
        """Return once every message sent so far has left this process (nothing to wait for in-process)."""

    replicas = 1  # data-parallel copies of the pipeline this channel's job runs

    def replica_mean(self, value: np.ndarray) -> np.ndarray:
        """The mean of ``value`` over the data-parallel replicas of this rank's stages, the same bits on
        each; a single pipeline is its own mean."""
        return value

    def replica_extreme(self, value: np.ndarray, largest: bool) -> np.ndarray:
        """The elementwise max (``largest``) or min of ``value`` over the replicas, as ``replica_mean``."""
        return value


class InProcessChannel(Channel):
    """Workers of one process: a mailbox keyed by message, under one lock. A receiver waits on a condition
    of its own message's (on that lock), so a send wakes only the thread that waits for it: with one
    condition for all, every send woke every waiting worker (three at p = 4) to find nothing, each wake-up
    a context switch on the cores the stages share. (An event per message, with its own lock, measured
    slower: 48 µs against 40 µs per round trip between two threads.)"""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # guards everything here
        self._cond = threading.Condition(self._lock)  # allreduce's and abort's
        self._box: dict[Hashable, Message] = {}
        self._waiting: dict[Hashable, threading.Condition] = {}  # message key -> its receiver's condition
        self._sums: dict[Hashable, dict] = {}
        self._aborted: str | None = None

    def send(self, key: Hashable, message: Message, dst_stage: int) -> None:
        with self._cond:
            self._check()
            if key in self._box:
                raise RuntimeError(f"message {key} was sent twice")
            self._box[key] = message
            waiter = self._waiting.pop(key, None)
            if waiter is not None:
                waiter.notify()

    def recv(self, key: Hashable, src_stage: int) -> Message:
        with self._cond:
            while key not in self._box:
                self._check()
                self._waiting.setdefault(key, threading.Condition(self._lock)).wait(POLL_S)
            self._waiting.pop(key, None)
            return self._box.pop(key)

    def allreduce(self, key: Hashable, rank: int, value: np.ndarray, ranks: int) -> np.ndarray:
        """Added in rank order, so every rank gets bit-identical results."""
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
            for waiter in self._waiting.values():
                waiter.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._box.clear()
            self._waiting.clear()
            self._sums.clear()
            self._aborted = None

    def _check(self) -> None:
        if self._aborted is not None:
            raise PipelineAborted(self._aborted)
