"""A Channel over ``paddle.distributed``: one pipeline rank per process, tensors moved by Paddle's own
collective engine (gloo on CPU).

Why one process group per direction and a sender thread per peer: gloo's send blocks until the peer
receives, and two ranks sending to each other at once on one group deadlock (measured: also with
``isend``, and with a send thread sharing the receiver's group). 1F1B sends activations forward while
gradients come back, so each ordered pair (a -> b) gets its own group, written only by a's sender thread
and read only by b's worker: sends never block a worker.

Why messages carry a header: a schedule may receive two messages from one peer in another order than
they were sent (interleaved chunks). Each message is a small int64 header, a UTF-8 description (key,
names, dtypes, shapes) and the tensors; a receiver files whatever arrives from that peer under its key
until the one it wants is there. Static ``send_v2``/``recv_v2`` have no CPU kernel, so transfers use the
dygraph API inside a ``dygraph.guard`` (thread-local in Paddle; measured to work from a static-mode
process and to leave static mode intact).
"""
from __future__ import annotations

import json
import queue
import threading
from typing import Hashable

import numpy as np

from .._paddle import paddle
from .channel import Channel, Message, PipelineAborted


class DistributedChannel(Channel):
    """Point-to-point and all-reduce between pipeline ranks of one ``paddle.distributed`` job.

    ``stage_ranks[s]`` is the process that runs stage ``s``.
    """

    def __init__(self, stage_ranks: list[int]):
        import paddle.distributed as dist
        self._dist = dist
        self.rank, size = dist.get_rank(), dist.get_world_size()
        self.stage_ranks = stage_ranks
        self._box: dict[tuple[int, str], Message] = {}
        self._aborted: str | None = None
        self._send_error: BaseException | None = None
        with self._eager():  # every rank creates every group, in the same order
            self._groups = {(a, b): dist.new_group(sorted((a, b)))
                            for a in range(size) for b in range(size) if a != b}
        self._outboxes: dict[int, queue.Queue] = {}
        for peer in range(size):
            if peer != self.rank:
                self._outboxes[peer] = queue.Queue()
                threading.Thread(target=self._sender, args=(peer,), daemon=True,
                                 name=f"staticpipe-send-{self.rank}>{peer}").start()

    def _eager(self):
        return paddle.base.dygraph.guard(paddle.CPUPlace())

    def _sender(self, peer: int) -> None:
        group = self._groups[(self.rank, peer)]
        with self._eager():
            while True:
                arrays = self._outboxes[peer].get()
                try:
                    for array in arrays:
                        self._dist.send(paddle.to_tensor(array), dst=peer, group=group)
                except BaseException as exc:  # reported by the worker's next channel call
                    self._send_error = exc
                    return
                finally:
                    self._outboxes[peer].task_done()

    def send(self, key: Hashable, message: Message, dst_stage: int) -> None:
        self._check()
        names = sorted(message)
        arrays = [np.array(message[n]) for n in names]
        meta = json.dumps({"key": repr(key), "tensors": [[n, str(a.dtype), list(a.shape)]
                                                         for n, a in zip(names, arrays)]}).encode()
        header = np.array([len(meta)], dtype=np.int64)
        self._outboxes[self.stage_ranks[dst_stage]].put([header, np.frombuffer(meta, dtype=np.uint8)] + arrays)

    def recv(self, key: Hashable, src_stage: int) -> Message:
        src = self.stage_ranks[src_stage]
        wanted = repr(key)
        while (src, wanted) not in self._box:
            self._check()
            got_key, message = self._receive_one(src)
            self._box[(src, got_key)] = message
        return self._box.pop((src, wanted))

    def _receive_one(self, src: int) -> tuple[str, Message]:
        group = self._groups[(src, self.rank)]
        with self._eager():
            header = paddle.zeros([1], dtype="int64")
            self._dist.recv(header, src=src, group=group)
            blob = paddle.zeros([int(header.numpy()[0])], dtype="uint8")
            self._dist.recv(blob, src=src, group=group)
            meta = json.loads(blob.numpy().tobytes().decode())
            message = {}
            for name, dtype, shape in meta["tensors"]:
                tensor = paddle.zeros(shape, dtype=dtype)
                self._dist.recv(tensor, src=src, group=group)
                message[name] = tensor.numpy()
        return meta["key"], message

    def allreduce(self, key: Hashable, member: int, value: np.ndarray, group: tuple[int, ...]) -> np.ndarray:
        self._check()
        with self._eager():
            tensor = paddle.to_tensor(value)
            self._dist.all_reduce(tensor)
            return tensor.numpy()

    def flush(self) -> None:
        for outbox in self._outboxes.values():
            outbox.join()
        self._check()

    def abort(self, reason: str) -> None:
        self._aborted = reason

    def reset(self) -> None:
        self._box.clear()
        self._aborted = None

    def _check(self) -> None:
        if self._send_error is not None:
            raise RuntimeError(f"sending to another rank failed: {self._send_error}") from self._send_error
        if self._aborted is not None:
            raise PipelineAborted(self._aborted)


def launched_world() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by a launcher with more than one process."""
    import os
    size = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    return (int(os.environ.get("PADDLE_TRAINER_ID", "0")), size) if size > 1 else None


def init_distributed() -> None:
    """Join the ``paddle.distributed`` job (gloo on CPU); works from a static-mode process."""
    import paddle.distributed as dist
    with paddle.base.dygraph.guard(paddle.CPUPlace()):
        dist.init_parallel_env()
