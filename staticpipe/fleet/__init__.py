"""``staticpipe.fleet``: Paddle's fleet names for static pipelines, with Paddle's meanings.

Fleet is how Paddle 2.x users write static pipelines; a fleet script runs here by changing its imports
(``import paddle.distributed.fleet as fleet`` -> ``from staticpipe import fleet``) and its executor
(``staticpipe.Executor``), in one process (stages as threads) or launched (``staticpipe.launch`` or
``paddle.distributed.launch``, one process per device and replica):

    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": 4, "micro_batch_size": 2, "schedule_mode": "1F1B"}
    strategy.hybrid_configs = {"dp_degree": 2, "pp_degree": 2}
    opt = fleet.distributed_optimizer(paddle.optimizer.Momentum(0.1, momentum=0.9), strategy)
    opt.minimize(loss)

What the strategy means here, as in Paddle's fleet: ``accumulate_steps`` micro-batches per step;
``micro_batch_size`` one replica's micro-batch (a loader batch), so each process is fed its own
replica's batches and the global batch is dp_degree x accumulate_steps x micro_batch_size (ignored on a
one-stage pipeline, as Paddle ignores it); ``schedule_mode`` "1F1B" or "F-then-B" (staticpipe's other
schedule names are accepted too); ``amp`` and ``amp_configs`` Paddle's fp16 AMP decorator with those
settings; ``recompute`` with ``checkpoints`` recomputes every stage's activations (Paddle's recompute
without checkpoints does nothing, and neither does this); ``hybrid_configs`` ``dp_degree`` replicas (-1:
the launched processes over ``pp_degree``) of ``pp_degree`` devices (with ``sharding`` on, Paddle's static
fleet reads both from ``sharding_configs``: so does this). Micro-batch gradients are averaged whatever the
loss's reduction, as Paddle's pipeline does. ``sharding`` with ``sharding_degree`` k > 1 is ZeRO stage 1
over groups of k replicas (``PipelineOptimizer(sharding_degree=k)``). A feature staticpipe does not
implement (sharding stage 2 or 3, tensor parallelism, gradient merge, LAMB, ...) is refused by name where
it is on with a degree or setting that changes what training computes; at degree 1, or where Paddle's fleet would not apply it (LAMB with
Momentum, DGC without replicas), it runs. Settings that only tune Paddle's own collectives (fusion sizes,
NCCL rings, hierarchical allreduce) change nothing here.

Besides: ``local_rank``, ``local_device_ids``, ``world_device_ids`` and ``get_hybrid_communicate_group``
(``topology.py``); ``util``, ``barrier_worker``, ``all_reduce``, ``worker_endpoints``, ``node_num`` and the
parameter-server calls Paddle's collective fleet only warns about (``util_base.py``); ``minimize``,
``_final_strategy`` and ``_get_applied_meta_list``, and after ``minimize`` of a pipeline (``strategy.pipeline``)
the main program's ``_pipeline_opt`` (``pipeline_opt.py``). The package's modules: ``strategy`` (the strategy
class), ``refusals`` (what is refused, and the degrees), ``topology`` (ranks and groups), ``util_base``
(job-wide helpers), ``pipeline_opt``; the functions a script calls are here.
"""
from __future__ import annotations

import copy
from typing import Any

from .._paddle import paddle
from ..optimizer import PipelineOptimizer
from .pipeline_opt import set_pipeline_opt
# every name staticpipe/fleet.py had stays importable from here (noqa: the re-exported ones)
from .refusals import (HYBRID_ONE, NO_MERGE, ZERO_1, OFFLOAD, ONLY_PP_DP, REFUSED_SWITCHES, _degrees, _refuse,
                       _refuse_with_replicas, _setting)  # noqa: F401
from .strategy import _MODULE, _PADDLE, CONFIGS, ConfigKeyError, DistributedStrategy, config_of  # noqa: F401
from .topology import (HybridCommunicateGroup, hybrid_group, local_device_ids, local_rank, world_device_ids,
                       worker_index, worker_num)
from .util_base import (UtilBase, all_reduce, barrier_worker, is_server, is_worker, node_num, not_in_collective, util,
                        worker_endpoints)

SCHEDULES = {"1F1B": "1F1B", "F-then-B": "F-then-B"}  # Paddle's schedule_mode names
# switches Paddle's fleet turns off in its valid strategy when their meta-optimizer does not apply; here: all
# but pipeline, amp, recompute and sharding, which staticpipe applies (the others run as without them)
UNAPPLIED = ("lamb", "lars", "dgc", "localsgd", "adaptive_localsgd", "gradient_merge", "tensor_parallel",
             "sync_batch_norm")
_initialised: dict[str, Any] = {}


def init(role_maker: Any = None, is_collective: bool = False, strategy: Any = None, log_level: Any = "INFO") -> None:
    """Paddle's ``fleet.init`` for a collective job: this process's rank and world come from its launcher
    (``staticpipe.launch``, ``paddle.distributed.launch``), or it is the only one. A parameter-server job
    (``is_collective=False``) is refused."""
    collective = is_collective or bool(getattr(role_maker, "_is_collective", False))
    if not collective:
        raise ValueError("fleet.init(is_collective=False) starts a parameter-server job, which staticpipe does not "
                         "run; pipelines are collective: fleet.init(is_collective=True)")
    _initialised.clear()  # a new job description: what the last minimize applied is gone
    _initialised.update(strategy=strategy)


def is_first_worker() -> bool:
    return worker_index() == 0


rank, nranks, world_size, rank_in_node = worker_index, worker_num, worker_num, local_rank  # Paddle's aliases


def init_worker(scopes: Any = None) -> None:
    """Paddle's ``fleet.init_worker``, for parameter servers: a collective job's only warns (``util_base``)."""
    not_in_collective("init_worker", "minimized" in _initialised,
                      "You should not call 'init_worker' method for collective mode.")


def stop_worker() -> None:
    """Paddle's ``fleet.stop_worker``, for parameter servers: a collective job's only warns."""
    not_in_collective("stop_worker", "minimized" in _initialised,
                      "You should not call 'stop_worker' method for collective mode.")


def save_persistables(executor: Any, dirname: str, main_program: Any = None, mode: int = 0) -> None:
    """Paddle's ``fleet.save_persistables``: in a collective job Paddle's saves nothing (its collective
    runtime's does nothing), and neither does this, with a warning saying so."""
    not_in_collective("save_persistables", "minimized" in _initialised,
                      f"fleet.save_persistables(dirname={dirname!r}) saves nothing in a collective job, as Paddle's "
                      "fleet; save with paddle.static.save_persistables(executor, dirname, main_program) or "
                      "staticpipe.save")


def minimize(loss: Any, startup_program: Any = None, parameter_list: Any = None, no_grad_set: Any = None) -> Any:
    """Paddle's ``fleet.minimize``: the last ``distributed_optimizer``'s ``minimize``."""
    optimizer = _initialised.get("optimizer")
    if optimizer is None:
        raise ValueError("fleet.minimize before fleet.distributed_optimizer: call "
                         "fleet.distributed_optimizer(optimizer, strategy) first")
    return optimizer.minimize(loss, startup_program, parameter_list, no_grad_set)


def distributed_optimizer(optimizer: Any, strategy: Any = None) -> DistributedOptimizer:
    """Paddle's ``fleet.distributed_optimizer``: ``optimizer`` trained as ``strategy`` says (the one given
    to ``fleet.init`` when None)."""
    if not _initialised:
        raise ValueError("fleet.distributed_optimizer before fleet.init: call fleet.init(is_collective=True) first")
    strategy = strategy if strategy is not None else _initialised.get("strategy") or DistributedStrategy()
    if not hasattr(strategy, "strategy"):
        raise ValueError(f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}")
    _initialised["optimizer"] = DistributedOptimizer(optimizer, strategy)
    return _initialised["optimizer"]


class DistributedOptimizer:
    """What ``distributed_optimizer`` returns: ``minimize`` builds the pipeline the strategy describes."""

    def __init__(self, optimizer: Any, strategy: Any):
        self.inner_opt, self.user_defined_strategy = optimizer, strategy
        self.user_defined_optimizer, self._user_defined_strategy = optimizer, strategy  # Paddle's Fleet's names
        self.pipeline: PipelineOptimizer | None = None
        self._inner = _decorated(optimizer, strategy)  # refusals first, before a program is touched

    def minimize(self, loss: Any, startup_program: Any = None, parameter_list: Any = None,
                 no_grad_set: Any = None) -> tuple[list, list]:
        strategy = self.user_defined_strategy
        pipe = config_of(strategy, "pipeline_configs")
        if not strategy.pipeline:
            pipe.update(accumulate_steps=1)  # data parallelism alone: one micro-batch, one stage
        checkpoints = config_of(strategy, "recompute_configs")["checkpoints"]
        dp, pp, sharding = _degrees(strategy)
        self.pipeline = PipelineOptimizer(self._inner, num_microbatches=pipe["accumulate_steps"],
                                          schedule=SCHEDULES.get(pipe["schedule_mode"], pipe["schedule_mode"]),
                                          recompute=bool(strategy.recompute and checkpoints), replica_batches="own",
                                          loss_reduction="mean")  # Paddle's pipeline averages, whatever the loss
        assignment, ranks, _ = self.pipeline.layout(loss)
        if not strategy.pipeline and len(ranks) > 1:
            raise ValueError(f"the program is guarded on {len(ranks)} devices {ranks} but strategy.pipeline is False: "
                             "set strategy.pipeline = True to train it as a pipeline")
        if pp is not None and pp[1] != len(ranks):
            raise ValueError(f"strategy.{pp[0]}['pp_degree'] = {pp[1]}, but the program's device_guard tags name "
                             f"{len(ranks)} devices {ranks}")
        # Paddle's dp_degree -1: the launched processes over the pipeline's devices (and the shards); each
        # member of a sharding group is a replica of its own data, as in Paddle's static sharding
        self.pipeline.dp_degree = dp * sharding if dp is not None else max(sharding, worker_num() // len(ranks))
        self.pipeline.sharding_degree = sharding
        _refuse_with_replicas(strategy, self.inner_opt, self.pipeline.dp_degree)
        if len(assignment.devices) > 1:  # it sizes the activations that cross stages; one stage has none
            self.pipeline.micro_batch_size = pipe["micro_batch_size"]
        result = self.pipeline.minimize(loss, startup_program, parameter_list, no_grad_set)
        if strategy.pipeline:  # Paddle's pipeline meta-optimizer leaves it; data parallelism alone does not
            set_pipeline_opt(loss.block.program, self.pipeline.plan, pipe["schedule_mode"])
        _initialised.update(minimized=self, applied=_applied(strategy, bool(checkpoints)))
        return result

    def amp_init(self, place: Any = None, scope: Any = None, test_program: Any = None, **kwargs: Any) -> None:
        if self.pipeline is None:
            raise ValueError("amp_init before minimize: call minimize(loss) first, then run the startup program")
        self.pipeline.amp_init(place, scope, test_program, **kwargs)

    def get_loss_scaling(self) -> Any:
        """Paddle's: the AMP decorator's loss-scaling variable (``strategy.amp``, or an optimizer decorated
        already), which a script fetches to read the real-time factor."""
        return self._amp("get_loss_scaling").get_loss_scaling()

    def _amp(self, name: str) -> Any:
        if not hasattr(self._inner, "amp_init"):
            raise StrategyOffError(f"{name} can only be used when the amp(auto mixed precision) strategy is turned on "
                                   "(strategy.amp = True), as in Paddle's fleet")
        return self._inner

    def qat_init(self, place: Any, scope: Any = None, test_program: Any = None) -> None:
        """Paddle's: only with ``strategy.qat``, which staticpipe refuses (it does not implement QAT)."""
        raise StrategyOffError("qat_init can only be used when the qat(quantization aware training) strategy is turned "
                               "on (strategy.qat = True), which staticpipe does not implement")

    def _final_strategy(self) -> Any:  # Paddle's distributed optimizer is its Fleet, which has these
        return _final_strategy()

    def _get_applied_meta_list(self) -> list[str]:
        return _get_applied_meta_list()

    @property
    def plan(self):
        return self.pipeline.plan if self.pipeline is not None else None


class StrategyOffError(ValueError, AssertionError):
    """A call for a strategy that is off: an AssertionError as Paddle's, a ValueError as staticpipe's."""


def _decorated(optimizer: Any, strategy: Any) -> Any:
    """``optimizer`` with the strategy's AMP around it, after refusing what the strategy asks that
    staticpipe does not do (each by name)."""
    _refuse(strategy, optimizer)
    if not strategy.amp:
        return optimizer
    amp = config_of(strategy, "amp_configs")
    for key in ("use_optimizer_fp16", "use_pure_bf16"):
        if amp.get(key):
            raise ValueError(f"strategy.amp_configs[{key!r}] = True: Paddle's fleet AMP decorates for float16 and "
                             "staticpipe follows it; for bfloat16 wrap the optimizer in "
                             "paddle.static.amp.bf16.decorate_bf16 yourself")
    lists = paddle.static.amp.AutoMixedPrecisionLists(set(amp["custom_white_list"]), set(amp["custom_black_list"]),
                                                     set(amp["custom_black_varnames"]))
    # positionally, as Paddle's own AMP meta-optimizer calls it (decorate dispatches among overloads)
    return paddle.static.amp.decorate(optimizer, lists, *(amp[key] for key in (
        "init_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio",
        "use_dynamic_loss_scaling", "use_pure_fp16", "use_fp16_guard")))


def get_hybrid_communicate_group() -> HybridCommunicateGroup:
    """Paddle's ``fleet.get_hybrid_communicate_group``: this process's ranks and degrees in pipeline, data
    and sharding parallelism (``topology.HybridCommunicateGroup``), from the last ``minimize``'s plan, or
    before it from the strategy given to ``fleet.init``."""
    if not _initialised:
        raise ValueError("fleet.get_hybrid_communicate_group before fleet.init: call fleet.init(is_collective=True) "
                         "first")
    optimizer = _initialised.get("minimized")
    return hybrid_group(optimizer.plan if optimizer is not None else None, _initialised.get("strategy"))


def _final_strategy() -> Any:
    """Paddle's ``fleet._final_strategy``: a copy of the strategy the last ``minimize`` trained with, the
    options that did not apply switched off (as Paddle's valid strategy has them); {} before ``minimize``,
    with Paddle's warning."""
    optimizer = _initialised.get("minimized")
    if optimizer is None:
        print("WARNING: You may need to call minimize function before this function is called")
        return {}
    final = copy.deepcopy(optimizer.user_defined_strategy)
    for name in UNAPPLIED:
        if getattr(final, name):
            setattr(final, name, False)
    if "RecomputeOptimizer" not in _initialised["applied"]:  # Paddle's recompute without checkpoints does not apply
        final.recompute = False
    return final


def _get_applied_meta_list() -> list[str]:
    """Paddle's ``fleet._get_applied_meta_list``: the names of Paddle's meta-optimizers the last ``minimize``
    did the work of ("AMPOptimizer", "RecomputeOptimizer", "PipelineOptimizer", "ShardingOptimizer"); [] before
    ``minimize``, with Paddle's warning."""
    if "applied" not in _initialised:
        print("WARNING: You may need to call minimize function before _get_applied_meta_list called")
        return []
    return list(_initialised["applied"])


def _applied(strategy: Any, checkpoints: bool) -> list[str]:
    return [name for name, on in (("AMPOptimizer", strategy.amp), ("RecomputeOptimizer", strategy.recompute and
                                  checkpoints), ("PipelineOptimizer", strategy.pipeline),
                                  ("ShardingOptimizer", strategy.sharding)) if on]


__all__ = ["DistributedStrategy", "DistributedOptimizer", "init", "worker_index", "worker_num", "is_first_worker",
           "distributed_optimizer", "local_rank", "local_device_ids", "world_device_ids", "barrier_worker",
           "get_hybrid_communicate_group", "HybridCommunicateGroup", "ConfigKeyError", "config_of", "CONFIGS", "util",
           "UtilBase", "all_reduce", "worker_endpoints", "node_num", "is_worker", "is_server", "rank", "nranks",
           "world_size", "rank_in_node", "init_worker", "stop_worker", "save_persistables", "minimize",
           "StrategyOffError"]
