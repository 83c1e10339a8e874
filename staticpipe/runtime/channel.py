"""Channels: how a route's tensors travel from one stage worker to another.

The runtime only calls ``send``, ``recv`` and ``abort``; the in-process implementation below keeps a
mailbox keyed by (route, micro-batch), so that a message can never be matched to the wrong receiver. A
transport on ``paddle.distributed`` implements the same three methods.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any

Message = dict[str, Any]  # cut variable name -> tensor (already on the receiver's place)
POLL_S = 0.05


class PipelineAborted(RuntimeError):
    """Raised in a worker blocked on a channel when another stage failed."""


class Channel(ABC):
    @abstractmethod
    def send(self, route: int, microbatch: int, message: Message) -> None: ...

    @abstractmethod
    def recv(self, route: int, microbatch: int) -> Message: ...

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Wake every blocked ``recv`` with ``PipelineAborted``; later calls raise it too."""

    @abstractmethod
    def reset(self) -> None:
        """Forget pending messages and a past abort (between steps)."""


class InProcessChannel(Channel):
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._box: dict[tuple[int, int], Message] = {}
        self._aborted: str | None = None

    def send(self, route: int, microbatch: int, message: Message) -> None:
        with self._cond:
            self._check()
            key = (route, microbatch)
            if key in self._box:
                raise RuntimeError(f"route {route} micro-batch {microbatch} was sent twice")
            self._box[key] = message
            self._cond.notify_all()

    def recv(self, route: int, microbatch: int) -> Message:
        key = (route, microbatch)
        with self._cond:
            while key not in self._box:
                self._check()
                self._cond.wait(POLL_S)
            return self._box.pop(key)

    def abort(self, reason: str) -> None:
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._box.clear()
            self._aborted = None

    def pending(self) -> list[tuple[int, int]]:
        with self._cond:
            return sorted(self._box)

    def _check(self) -> None:
        if self._aborted is not None:
            raise PipelineAborted(self._aborted)
