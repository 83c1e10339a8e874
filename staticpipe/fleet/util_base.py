"""Fleet's job-wide helpers with Paddle's collective meanings: ``fleet.util`` (Paddle's ``UtilBase``),
``barrier_worker``, ``all_reduce``, ``worker_endpoints``, ``node_num``, ``is_worker`` / ``is_server``, and
the parameter-server calls a collective script may still make (``init_worker``, ``stop_worker``,
``save_persistables``), which Paddle's collective fleet only warns about or does nothing for.

Why a module of its own: these talk to the job's other processes (over ``paddle.distributed``'s job group)
or answer from the launcher's variables; they need no strategy or program. In one process there is nobody
to talk to: Paddle's gloo is not started there, and its all_reduce and all_gather return the input as it is,
its barrier returns at once: so do these.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

from .._paddle import np, paddle
from ..placement import launched_world
from .topology import worker_index, worker_num

log = logging.getLogger("staticpipe")
REDUCE_MODES = ("sum", "max", "min")  # Paddle's gloo all_reduce modes


def _in_job_group(work: Callable[[Any], Any]) -> Any:
    """``work(paddle.distributed)`` in dygraph mode on this process's place, in the job's group (joined here
    if no ``staticpipe.Executor`` has yet)."""
    import paddle.distributed as dist

    from ..placement import cuda_device_count, process_gpu
    from ..runtime.distributed import init_distributed

    if not dist.is_initialized():
        init_distributed()
    gpu = process_gpu() if cuda_device_count() else None
    with paddle.base.dygraph.guard(paddle.CPUPlace() if gpu is None else paddle.CUDAPlace(gpu)):
        return work(dist)


def _worker_world(comm_world: str) -> None:
    if comm_world != "worker":
        raise ValueError(f"comm_world={comm_world!r}: a collective job has workers only (no parameter servers); "
                         "use comm_world='worker'")


def barrier_worker() -> None:
    """Paddle's ``fleet.barrier_worker``: wait until every process of the job calls it (nothing to wait for
    in one process). Over ``paddle.distributed``'s job group, which it joins if no ``staticpipe.Executor``
    has yet (Paddle's own waits only where its launcher started gloo, and warns and returns otherwise)."""
    if launched_world() is not None:
        _in_job_group(lambda dist: dist.barrier())


def all_reduce(input: Any, mode: str = "sum") -> Any:  # noqa: A002  (Paddle's parameter name)
    """Paddle's ``fleet.all_reduce``: ``fleet.util.all_reduce`` over the workers."""
    return util.all_reduce(input, mode)


class UtilBase:
    """Paddle's ``fleet.util`` of a collective job: its workers are this job's processes, in rank order."""

    def all_reduce(self, input: Any, mode: str = "sum", comm_world: str = "worker") -> Any:  # noqa: A002
        """``input`` (a number, list, tuple or array) reduced elementwise over the job's processes with
        ``mode`` ("sum", "max", "min"), a numpy array of its shape and dtype; in one process ``input`` itself."""
        _worker_world(comm_world)
        if mode not in REDUCE_MODES:
            raise ValueError(f"all_reduce mode={mode!r}: Paddle's fleet reduces with one of {list(REDUCE_MODES)}")
        if launched_world() is None:
            return input
        values = np.array(list(input) if isinstance(input, tuple) else input)
        wide = values.astype(np.float64 if values.dtype.kind in "fc" else np.int64)

        def reduce(dist: Any) -> Any:
            tensor = paddle.to_tensor(wide.reshape(-1))
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, mode.upper()))
            return tensor.numpy()
        return _in_job_group(reduce).astype(values.dtype).reshape(values.shape)

    def barrier(self, comm_world: str = "worker") -> None:
        """Wait until every process of the job calls it (``barrier_worker``)."""
        _worker_world(comm_world)
        barrier_worker()

    def all_gather(self, input: Any, comm_world: str = "worker") -> Any:  # noqa: A002
        """Every process's ``input`` (a number, as Paddle's), a list in rank order; in one process ``input``."""
        _worker_world(comm_world)
        if launched_world() is None:
            return input
        gathered: list = []
        _in_job_group(lambda dist: dist.all_gather_object(gathered, input))
        return gathered

    def get_file_shard(self, files: list) -> list:
        """This process's share of ``files``: the job's ``worker_num`` processes take consecutive blocks in
        rank order, the first ``len(files) % worker_num`` one file more (Paddle's split)."""
        if not isinstance(files, list):
            raise TypeError("files should be a list of file need to be read.")
        trainers, trainer_id = worker_num(), worker_index()
        blocks = [len(files) // trainers + (i < len(files) % trainers) for i in range(trainers)]
        begin = sum(blocks[:trainer_id])
        return files[begin:begin + blocks[trainer_id]]

    def print_on_rank(self, message: Any, rank_id: int) -> None:
        """Print ``message`` on the process of rank ``rank_id`` only."""
        if worker_index() == rank_id:
            print(message)


util = UtilBase()


def worker_endpoints(to_string: bool = False) -> list[str] | str:
    """Paddle's ``fleet.worker_endpoints``: the job's processes' addresses (``PADDLE_TRAINER_ENDPOINTS``,
    which both launchers set), ","-joined with ``to_string``; in one process Paddle's "127.0.0.1:6170"."""
    endpoints = os.environ.get("PADDLE_TRAINER_ENDPOINTS") or "127.0.0.1:6170"
    return endpoints if to_string else endpoints.split(",")


def node_num() -> int:
    """Paddle's ``fleet.node_num``: the machines of the job (distinct hosts among ``worker_endpoints``)."""
    return len({endpoint.split(":")[0] for endpoint in worker_endpoints()})


def is_worker() -> bool:
    """Paddle's ``fleet.is_worker``: every process of a collective job is a worker."""
    return True


def is_server() -> bool:
    """Paddle's ``fleet.is_server``: a collective job has no parameter servers."""
    return False


def not_in_collective(name: str, minimized: bool, message: str) -> None:
    """What Paddle's collective fleet does for parameter-server call ``name``: in one process warn that it
    does nothing there; launched, refuse it before ``minimize`` (Paddle makes its runtime there), after it
    log ``message`` and do nothing."""
    if launched_world() is None:
        log.warning("%s() function doesn't work when use non_distributed fleet.", name)
    elif not minimized:
        raise ValueError(f"fleet.{name} before minimize: Fleet can not find suitable runtime handler (Paddle's fleet "
                         "makes it in minimize); call it after the distributed optimizer's minimize")
    else:
        log.warning(message)


__all__ = ["UtilBase", "util", "barrier_worker", "all_reduce", "worker_endpoints", "node_num", "is_worker",
           "is_server", "not_in_collective", "REDUCE_MODES"]
