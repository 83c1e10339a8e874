"""Where this process stands in the job, with fleet's names: ranks, device ids and the hybrid group.

Why a module of its own: these answers come from staticpipe's own process layout, not from Paddle's
launcher alone. The layout is fleet's (``plan.process_of``): with a ``p``-rank pipeline and R replicas of
it, process ``k * p + r`` of a launched job runs pipeline rank ``r`` of replica ``k``; with ZeRO-1 sharding
of degree ``s``, R = dp_degree x s, replica ``k`` is data-parallel rank ``k // s`` and sharding rank
``k % s``, and process ``((k // s) * p + r) * s + k % s`` runs its pipeline rank ``r`` (the members of a
sharding group are neighbours, as in fleet's static ShardingOptimizer). One process (no launcher) runs
every stage, as threads.
"""
from __future__ import annotations

import os
from typing import Any

from ..placement import cuda_device_count, launched_world, process_gpu
from ..plan import place_of_process, process_of
from .strategy import config_of


def worker_index() -> int:
    """Paddle's ``fleet.worker_index``: this process's rank in the job (0 in one process)."""
    world = launched_world()
    return world[0] if world else 0


def worker_num() -> int:
    """Paddle's ``fleet.worker_num``: the job's processes (1 in one process)."""
    world = launched_world()
    return world[1] if world else 1


def local_rank() -> str:
    """Paddle's ``fleet.local_rank``: this process's rank on its machine, a string as Paddle gives it
    (``PADDLE_RANK_IN_NODE``, which Paddle's launchers set). Under ``staticpipe.launch`` (one machine) it is
    the job rank; in one process "0" (Paddle's fleet gives None there)."""
    found = os.environ.get("PADDLE_RANK_IN_NODE")
    return found if found is not None else str(worker_index())


def local_device_ids() -> str:
    """Paddle's ``fleet.local_device_ids``: the ids of this process's accelerators, comma-separated
    (``PADDLE_LOCAL_DEVICE_IDS`` where Paddle's launcher set it). Else the GPU its launcher selected
    (``FLAGS_selected_gpus``); in one process on a CUDA machine every GPU (its stages run on them as
    threads); "" on CPU (no accelerator, as Paddle's launcher gives a CPU trainer)."""
    found = os.environ.get("PADDLE_LOCAL_DEVICE_IDS")
    if found is not None:
        return found
    if process_gpu() is not None:
        return str(process_gpu())
    return ",".join(str(i) for i in range(cuda_device_count())) if launched_world() is None else ""


def world_device_ids() -> str:
    """Paddle's ``fleet.world_device_ids``: every process's ``local_device_ids``, ":"-joined within a process
    and ","-joined over the processes in rank order (``PADDLE_WORLD_DEVICE_IDS`` where Paddle's launcher set
    it). Else, launched with a GPU per process: process ``g`` on GPU ``g % PADDLE_LOCAL_SIZE`` (the ranks of a
    machine), as both launchers select; in one process ``local_device_ids`` ":"-joined; on CPU one "" each."""
    found = os.environ.get("PADDLE_WORLD_DEVICE_IDS")
    if found is not None:
        return found
    world = launched_world()
    if world is None:
        return local_device_ids().replace(",", ":")
    if process_gpu() is None:
        return ",".join([""] * world[1])
    per_machine = int(os.environ.get("PADDLE_LOCAL_SIZE", world[1]))
    return ",".join(str(g % per_machine) for g in range(world[1]))


def strategy_degrees(strategy: Any, processes: int) -> tuple[int, int, int]:
    """(pp, dp, sharding) degrees a strategy asks for before ``minimize``: ``sharding_configs``' when
    ``strategy.sharding`` (Paddle's static fleet reads them there), else ``hybrid_configs``' (dp_degree -1:
    the processes over pp x sharding). Without a strategy, Paddle's defaults: every process a replica."""
    if strategy is None:
        return 1, processes, 1
    configs = config_of(strategy, "sharding_configs" if strategy.sharding else "hybrid_configs")
    pp, sharding = max(1, configs.get("pp_degree", 1)), max(1, configs.get("sharding_degree", 1))
    dp = configs.get("dp_degree", -1)
    return pp, (dp if dp > 0 else max(1, processes // (pp * sharding))), sharding


class HybridCommunicateGroup:
    """What ``fleet.get_hybrid_communicate_group()`` returns: the getters of Paddle's
    ``HybridCommunicateGroup`` (``paddle.distributed.fleet.base.topology``) for pipeline, data and sharding
    parallelism, computed from staticpipe's process layout (module docstring); tensor, sequence and expert
    parallelism are never on here (world size 1, rank 0). No communication groups: staticpipe makes its own.

    Paddle's meanings: ``get_stage_id()`` is this process's pipeline rank (the stages of an interleaved
    schedule that rank holds are ``plan.stages_of_process``); ``get_pipe_parallel_world_size()`` the
    pipeline's ranks; ``nranks`` the processes. In one process, which runs every stage, the stage id is 0
    and ``is_first_stage`` and ``is_last_stage`` are both True (the loss is fetched there)."""

    def __init__(self, global_rank: int, nranks: int, pp: int, dp: int, sharding: int = 1):
        self.global_rank, self.nranks = global_rank, nranks
        self._pp_degree, self._dp_degree, self._sharding_degree = pp, dp, sharding
        self._mp_degree = self._sep_degree = 1
        replica, self.stage_id = place_of_process(global_rank, pp, sharding)
        self._data_parallel_id, self._sharding_parallel_id = replica // sharding, replica % sharding
        self._model_parallel_id = self._sep_parallel_id = 0
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == pp - 1 or nranks == 1

    def __repr__(self) -> str:
        return (f"HybridCommunicateGroup(global_rank={self.global_rank}, nranks={self.nranks}, "
                f"pp={self._pp_degree}, dp={self._dp_degree}, sharding={self._sharding_degree}, "
                f"stage_id={self.stage_id}, dp_rank={self._data_parallel_id}, "
                f"sharding_rank={self._sharding_parallel_id})")

    def get_parallel_mode(self) -> int | None:
        """Paddle's rule (``ParallelMode``): pipeline when pp > 1, else sharding when its degree > 1, else
        data when dp > 1; None when every degree is 1, as Paddle returns."""
        from paddle.distributed.fleet.base.topology import ParallelMode

        if self._pp_degree > 1:
            return ParallelMode.PIPELINE_PARALLEL
        if self._sharding_degree > 1:
            return ParallelMode.SHARDING_PARALLEL
        return ParallelMode.DATA_PARALLEL if self._dp_degree > 1 else None

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_data_parallel_rank(self) -> int:
        return self._data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self._dp_degree

    def get_model_parallel_rank(self) -> int:
        return self._model_parallel_id

    def get_model_parallel_world_size(self) -> int:
        return self._mp_degree

    def get_sep_parallel_rank(self) -> int:
        return self._sep_parallel_id

    def get_sep_parallel_world_size(self) -> int:
        return self._sep_degree

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self._pp_degree

    def get_sharding_parallel_rank(self) -> int:
        return self._sharding_parallel_id

    def get_sharding_parallel_world_size(self) -> int:
        return self._sharding_degree

    def get_rank_from_stage(self, stage_id: int, **kwargs: int) -> int:
        """The process that runs pipeline rank ``stage_id`` of this process's replica (``data=`` or
        ``sharding=``, as Paddle's, of another's)."""
        unknown = sorted(set(kwargs) - {"data", "sharding", "model", "sep"})
        if unknown or kwargs.get("model", 0) or kwargs.get("sep", 0):
            raise ValueError(f"get_rank_from_stage: {kwargs} names no process of this job (its axes: data, "
                             "sharding; model and sep parallelism have degree 1 here)")
        replica = (kwargs.get("data", self._data_parallel_id) * self._sharding_degree
                   + kwargs.get("sharding", self._sharding_parallel_id))
        return process_of(replica, stage_id, self._pp_degree, self._sharding_degree)


def hybrid_group(plan: Any, strategy: Any) -> HybridCommunicateGroup:
    """The group of this process: from the plan of the last ``minimize`` (its pipeline ranks, replicas and
    sharding degree) when there is one, else from the strategy given to ``fleet.init``."""
    rank, processes = worker_index(), worker_num()
    if plan is not None:
        sharding = plan.sharding_degree
        pp, dp = len(plan.ranks), max(1, plan.dp_degree // sharding)
    else:
        pp, dp, sharding = strategy_degrees(strategy, processes)
    return HybridCommunicateGroup(rank, processes, pp, dp, sharding)


__all__ = ["worker_index", "worker_num", "local_rank", "local_device_ids", "world_device_ids",
           "HybridCommunicateGroup", "hybrid_group", "strategy_degrees"]
