"""A Channel over ``paddle.distributed``: one pipeline rank per process, tensors moved by Paddle's own
collective engine (gloo on CPU).

Why one process group per direction and a sender thread per peer: gloo's send blocks until the peer
receives, and two ranks sending to each other at once on one group deadlock (measured: also with
``isend``, and with a send thread sharing the receiver's group). 1F1B sends activations forward while
gradients come back, so each ordered pair (a -> b) gets its own group, written only by a's sender thread
and read only by b's worker: sends never block a worker. Only the pairs a plan sends on get one
(``Plan.rank_pairs``: neighbours, skip connections, shared parameters, checkpoint gathering), made when
the plan first runs: 8 groups for a 4-rank 1F1B pipeline instead of 12, 20 for 8 ranks instead of 56.

Why messages carry a header: a schedule may receive two messages from one peer in another order than
they were sent (interleaved chunks). Each message is a small int64 header, a UTF-8 description (key,
names, dtypes, shapes) and the tensors; a receiver files whatever arrives from that peer under its key
until the one it wants is there. Static ``send_v2``/``recv_v2`` have no CPU kernel, so transfers use the
dygraph API inside a ``dygraph.guard`` (thread-local in Paddle; measured to work from a static-mode
process and to leave static mode intact).

Why each group gets a store of its own: Paddle 2.6's gloo process group rendezvouses once without a
key prefix in the job's shared TCPStore, so a new group can read a peer's address left there by an
earlier group (measured with 4 processes: "Connection refused", "address.cc ... 136 vs 408", receive
timeouts in about half the runs; 0 failures in repeated runs with a store per group).

Data x pipeline parallelism: with ``dp`` replicas of a ``p``-rank pipeline, process ``k * p + r`` runs
pipeline rank ``r`` of replica ``k`` (with ZeRO-1, fleet's layout: ``plan.process_of``). Messages stay inside a replica; the cross-stage reductions run on
the replica's pipeline group, the gradient averages on the group of the ranks that hold the same stages.
The same two groups carry the broadcasts that give every process one initial state (``startup_sync.py``).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import json
import os
import queue
import socket
import threading
import time
from typing import Any, Hashable

import numpy as np

from .._paddle import core, paddle
from .channel import Channel, Message, PipelineAborted
from ..placement import connects_lazily, cuda_device_count, place_of, process_gpu, transfer_device
from ..plan import place_of_process, process_of

STORE_TIMEOUT_S = 900  # how long a group's rendezvous waits for its members
_GROUPS_MADE = itertools.count()  # same sequence on every rank: groups are made in the same order


class DistributedChannel(Channel):
    """Point-to-point and all-reduce between the ranks of one ``paddle.distributed`` job.

    ``stage_ranks[s]`` is the pipeline rank that runs stage ``s``; the job holds ``world / pipeline_size``
    replicas of the pipeline. Tensors travel from this process's own GPU with NCCL (a GPU job), or from
    host memory with gloo (``placement.transfer_device``).
    """

    def __init__(self, stage_ranks: list[int], pipeline_size: int, sharding: int = 1):
        import paddle.distributed as dist
        self._dist = dist
        self._place = place_of(transfer_device(dist.get_backend(), process_gpu()))
        self.rank, size = dist.get_rank(), dist.get_world_size()
        self.replicas = size // pipeline_size
        at = self._process = functools.partial(process_of, pipeline=pipeline_size, sharding=sharding)
        replica, pipeline_rank = place_of_process(self.rank, pipeline_size, sharding)
        self.stage_ranks = [at(replica, r) for r in stage_ranks]  # stage -> process
        self._box: dict[tuple[int, str], Message] = {}
        self._aborted: str | None = None
        self._send_error: BaseException | None = None
        replicas = [[at(k, r) for r in range(pipeline_size)] for k in range(self.replicas)]
        with self._eager():  # every rank creates every group, in the same order
            pipelines = [_new_group(ranks) for ranks in replicas]
            holders = [_new_group([at(k, r) for k in range(self.replicas)]) for r in range(pipeline_size)]
            # ZeRO-1: the holders of each pipeline rank in groups of ``sharding`` consecutive replicas
            shards = {(g, r): _new_group([at(g * sharding + j, r) for j in range(sharding)])
                      for g in range(self.replicas // sharding) for r in range(pipeline_size)} if sharding > 1 else {}
        self._pipeline, self._holders = pipelines[replica], holders[pipeline_rank]
        self._first_holder = at(0, pipeline_rank)
        self.sharding, self.shard = sharding, replica % sharding if sharding > 1 else None
        self._shard_group = shards.get((replica // sharding, pipeline_rank))
        self._shard_ranks = [at(replica // sharding * sharding + j, pipeline_rank) for j in range(sharding)]
        self._pipeline_ranks = replicas[replica]
        self._groups: dict[tuple[int, int], object] = {}  # (sender, receiver) process ranks -> their group
        self._outboxes: dict[int, queue.Queue] = {}

    def connect(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Make the point-to-point groups of ``pairs`` of pipeline ranks (``Plan.rank_pairs``; in every
        replica) that this channel lacks, and a sender thread for each of this rank's new peers. Group
        creation is collective: every rank calls this for the same plans in the same order, from the
        thread that runs the step (the main thread), never from sender or worker threads."""
        new = sorted({(self._process(k, a), self._process(k, b)) for k in range(self.replicas) for a, b in pairs}
                     - set(self._groups))
        lazy = connects_lazily(self._dist.get_backend())
        with self._eager():
            for a, b in new:
                self._groups[(a, b)] = group = _new_group([a, b])
                if lazy and self.rank in (a, b):
                    _warm_up(self._dist, group)
        for a, b in new:
            if a == self.rank:
                self._outboxes[b] = queue.Queue()
                threading.Thread(target=self._sender, args=(b,), daemon=True,
                                 name=f"staticpipe-send-{self.rank}>{b}").start()

    def _eager(self):
        """Dygraph mode on the transfer place: new tensors (receive buffers) are created there."""
        return paddle.base.dygraph.guard(self._place)

    def _sender(self, peer: int) -> None:
        group = self._groups[(self.rank, peer)]
        with self._eager():
            while True:
                arrays = self._outboxes[peer].get()
                try:
                    for array in arrays:
                        self._dist.send(paddle.to_tensor(array, place=self._place), dst=peer, group=group)
                except BaseException as exc:  # reported by the worker's next channel call
                    self._send_error = exc
                    return
                finally:
                    self._outboxes[peer].task_done()

    def send(self, key: Hashable, message: Message, dst_stage: int) -> None:
        self._check()
        if self.stage_ranks[dst_stage] == self.rank:  # between two stages of this process
            self._box[(self.rank, repr(key))] = {n: np.array(v) for n, v in message.items()}
            return
        names = sorted(message)
        arrays = [np.array(message[n]) for n in names]
        meta = json.dumps({"key": repr(key), "tensors": _described(names, arrays)}).encode()
        header = np.array([len(meta)], dtype=np.int64)
        outbox = self._outboxes.get(self.stage_ranks[dst_stage])
        if outbox is None:
            raise RuntimeError(f"message {key} to stage {dst_stage} (rank {self.stage_ranks[dst_stage]}): no group "
                               f"connects rank {self.rank} to it; the plan's rank pairs do not include this message")
        outbox.put([header, np.frombuffer(meta, dtype=np.uint8)] + arrays)

    def recv(self, key: Hashable, src_stage: int) -> Message:
        src = self.stage_ranks[src_stage]
        wanted = repr(key)
        if src == self.rank and (src, wanted) not in self._box:
            raise RuntimeError(f"message {key} from stage {src_stage} of this process was never sent")
        started = time.monotonic()
        while (src, wanted) not in self._box:
            self._check()
            try:
                got_key, message = self._receive_one(src)
            except RuntimeError as exc:  # gloo's own words name neither the message nor the rank
                if "TIMEOUT" not in str(exc):
                    raise
                raise RuntimeError(
                    f"rank {self.rank} waited {time.monotonic() - started:.0f} s for message {key} from stage "
                    f"{src_stage} (rank {src}) and none came: rank {src} failed, is that much slower, or is elsewhere "
                    "in the script (a call every rank makes -- staticpipe.save, exe.flush, Paddle's save_persistables "
                    "or save_inference_model on a pipelined program -- made on some ranks only?)") from exc
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

    def allreduce(self, key: Hashable, rank: int, value: np.ndarray, ranks: int) -> np.ndarray:
        """Over this replica's pipeline group; gloo matches the ranks' calls by their order, which is the
        same on every rank (the plan's exchange order), so ``key`` names the sum only in errors. The parts
        are gathered and added in rank order, as the in-process channel adds them: gloo's ring sums three
        or more parts in another order, and a global-norm clip then scaled by a factor an ulp off the one
        process run's (every parameter differed after a step on an Intel Xeon). The parts are a few
        numbers (squared norms, flags), so gathering them costs what summing them did."""
        if ranks != len(self._pipeline_ranks) or self._pipeline_ranks[rank] != self.rank:
            raise RuntimeError(f"all-reduce {key}: rank {rank} of {ranks} does not match this process (rank "
                               f"{self.rank} of the pipeline {self._pipeline_ranks})")
        self._check()
        with self._eager():
            parts: list = []
            self._dist.all_gather(parts, paddle.to_tensor(value, place=self._place), group=self._pipeline)
            parts = [p.numpy() for p in parts]
        return sum(parts[1:], parts[0].copy())

    def replica_mean(self, value: np.ndarray) -> np.ndarray:
        if self.replicas == 1:
            return value
        return self._sum(value, self._holders) / np.asarray(self.replicas, dtype=value.dtype)

    def replica_extreme(self, value: np.ndarray, largest: bool) -> np.ndarray:
        if self.replicas == 1:
            return value
        return self._sum(value, self._holders, self._dist.ReduceOp.MAX if largest else self._dist.ReduceOp.MIN)

    def pipeline_broadcast(self, message: Message | None, src: int) -> Message:
        """``message`` of pipeline rank ``src`` of this replica (None on the others) to every rank of the
        replica's pipeline group; every rank calls it, in the same order."""
        return self._broadcast(message, self._pipeline_ranks[src], self._pipeline)

    def replica_broadcast(self, message: Message | None) -> Message:
        """``message`` of the first replica's rank (None on the others) to the ranks that hold the same
        stages in every replica."""
        if self.replicas == 1:
            return message
        return self._broadcast(message, self._first_holder, self._holders)

    def shard_exchange(self, mine: Message) -> Message:
        if self.sharding == 1:
            return mine
        got: Message = {}
        for j, src in enumerate(self._shard_ranks):  # each member's message in turn, from member 0 on
            got.update(self._broadcast(mine if j == self.shard else None, src, self._shard_group))
        return got

    def gather_bytes(self, mine: bytes) -> list[bytes]:
        """Every process's ``mine``, in rank order, on every rank of the job (a few kB: where each rank's data
        stands, for a checkpoint); every rank calls it."""
        self._check()
        with self._eager():
            sizes: list = []
            self._dist.all_gather(sizes, paddle.to_tensor(np.array([len(mine)], np.int64), place=self._place))
            lengths = [int(s.numpy()[0]) for s in sizes]
            padded = np.zeros(max(lengths), np.uint8)
            padded[:len(mine)] = np.frombuffer(mine, np.uint8)
            parts: list = []
            self._dist.all_gather(parts, paddle.to_tensor(padded, place=self._place))
            return [part.numpy()[:n].tobytes() for part, n in zip(parts, lengths)]

    def agree(self, ok: bool, among: str) -> bool:
        """Whether every rank ``among`` "pipeline" (this replica's) or "replicas" (this rank's holders
        group) says ``ok``; every rank of the group calls it."""
        if among == "replicas" and self.replicas == 1:
            return ok
        group = self._pipeline if among == "pipeline" else self._holders
        return bool(self._sum(np.array([int(ok)], np.int64), group, self._dist.ReduceOp.MIN)[0])

    def _broadcast(self, message: Message | None, src: int, group) -> Message:
        """A broadcast of a message described as ``send``'s (names, dtypes, shapes, then each tensor as
        its bytes): a receiver learns every shape from the description, so no rank needs to know the
        message beforehand, and a receiver holds one tensor at a time besides what it received."""
        self._check()
        with self._eager():
            if self.rank == src:
                arrays = {n: np.asarray(message[n], order="C") for n in sorted(message)}  # 0-d stays 0-d
                meta = np.frombuffer(json.dumps(_described(list(arrays), list(arrays.values()))).encode(),
                                     dtype=np.uint8)
            header = self._cast(np.array([len(meta)] if self.rank == src else [0], np.int64), src, group)
            blob = self._cast(meta if self.rank == src else np.zeros(int(header[0]), np.uint8), src, group)
            got = {}
            for name, dtype, shape in json.loads(blob.tobytes().decode()):
                if self.rank == src:
                    got[name] = arrays[name]
                    if arrays[name].nbytes:
                        self._cast(arrays[name].reshape(-1).view(np.uint8), src, group, back=False)
                    continue
                size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                data = self._cast(np.zeros(size, np.uint8), src, group) if size else np.zeros(0, np.uint8)
                got[name] = data.view(dtype).reshape(shape)
        return got

    def _cast(self, array: np.ndarray, src: int, group, back: bool = True) -> np.ndarray | None:
        """``array`` of process ``src`` broadcast over ``group``: what arrived (``back``)."""
        tensor = paddle.to_tensor(array, place=self._place)
        self._dist.broadcast(tensor, src=src, group=group)
        return tensor.numpy() if back else None

    def _sum(self, value: np.ndarray, group, op: Any = None) -> np.ndarray:
        """gloo's ring all-reduce (a sum, or ``op``): every member ends with the same bits."""
        self._check()
        with self._eager():
            tensor = paddle.to_tensor(value, place=self._place)
            self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM if op is None else op, group=group)
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


def init_distributed() -> None:
    """Join the ``paddle.distributed`` job (gloo on CPU, NCCL on the GPU the launcher selected); works
    from a static-mode process."""
    import paddle.distributed as dist

    gpu = process_gpu() if cuda_device_count() else None
    with paddle.base.dygraph.guard(paddle.CPUPlace() if gpu is None else paddle.CUDAPlace(gpu)):
        dist.init_parallel_env()
    atexit.register(_end_before_native_teardown)


def _end_before_native_teardown() -> None:
    """Once this rank's Python has finished (this runs among its exit handlers), make the C library's exit
    end the process at once with its exit status, before the C++ static destructors: Paddle 3's teardown,
    with gloo's threads still running, crashed ranks whose work was done (SIGSEGV in oneDNN's graph pass
    registry destructor, 2 of ~40 runs of a 4-process job), and the launcher then saw a failed rank. The
    handler registered last runs first, hence from here and not earlier (glibc's ``on_exit``; elsewhere,
    nothing changes)."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "on_exit"):
        libc.on_exit(libc._exit, None)


def _warm_up(dist: Any, group: Any) -> None:
    """Make ``group``'s communicator now, in this (the main) thread: a one-element all-reduce between its
    members (``placement.connects_lazily``: under NCCL it is otherwise made by the first send, in a sender
    thread). Every rank makes its groups in the same order, so the members meet."""
    dist.all_reduce(paddle.zeros([1]), group=group)


def _described(names: list[str], arrays: list[np.ndarray]) -> list[list]:
    """How a message's receiver learns its tensors before their bytes: [name, dtype, shape] of each."""
    return [[n, str(a.dtype), list(a.shape)] for n, a in zip(names, arrays)]


def _new_group(ranks: list[int]):
    """``paddle.distributed.new_group(ranks)`` rendezvousing in a TCPStore of its own (see the module
    docstring): the group's first rank serves it on a free port, which it publishes in the job's store."""
    import paddle.distributed as dist
    from paddle.distributed import collective

    job_store = collective._default_store
    key, first, rank = f"staticpipe/group-store/{next(_GROUPS_MADE)}", ranks[0], dist.get_rank()
    store = job_store
    if rank == first:
        host = _host_of(rank)
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        job_store.set(key, f"{host}:{port}".encode())
        store = core.TCPStore(host, port, True, len(ranks), STORE_TIMEOUT_S)
    elif rank in ranks:
        host, port = bytes(job_store.get(key)).decode().rsplit(":", 1)
        store = core.TCPStore(host, int(port), False, len(ranks), STORE_TIMEOUT_S)
    collective._set_default_store(store)
    try:
        return dist.new_group(ranks)
    finally:
        collective._set_default_store(job_store)


def _host_of(rank: int) -> str:
    """This rank's address as the launcher gave it (``PADDLE_TRAINER_ENDPOINTS``), else loopback."""
    endpoints = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")
    return endpoints[rank].rsplit(":", 1)[0] if len(endpoints) > rank and endpoints[rank] else "127.0.0.1"
