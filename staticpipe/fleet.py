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
the launched processes over ``pp_degree``) of ``pp_degree`` devices. Micro-batch gradients are averaged
whatever the loss's reduction, as Paddle's pipeline does. Every other feature of the strategy
(sharding, tensor parallelism, LAMB, ...) is refused by name when it is set; settings that only tune
Paddle's own collectives (fusion sizes, NCCL rings) change nothing here.

Why a strategy class of our own: Paddle 2.6's ``DistributedStrategy`` cannot read or set its ``*_configs``
with the protobuf that pip installs beside it (``FieldDescriptor`` has no ``label``); this one is Paddle's
class with those four properties read and written through the same protobuf messages, so names, defaults
and key checks stay Paddle's.
"""
from __future__ import annotations

import logging
from typing import Any

from ._paddle import paddle
from .optimizer import PipelineOptimizer
from .placement import launched_world

log = logging.getLogger("staticpipe")
SCHEDULES = {"1F1B": "1F1B", "F-then-B": "F-then-B"}  # Paddle's schedule_mode names
# strategy features that change what training computes and that staticpipe does not implement
UNSUPPORTED = ("sharding", "tensor_parallel", "lamb", "lars", "dgc", "localsgd", "adaptive_localsgd", "gradient_merge",
               "asp", "qat", "fp16_allreduce", "heter_ccl_mode", "semi_auto", "auto", "auto_search", "elastic",
               "sync_batch_norm", "fuse_grad_merge", "use_hierarchical_allreduce")
HYBRID_ONE = ("mp_degree", "sharding_degree", "sep_degree", "ep_degree", "cp_degree", "moe_sharding_degree",
              "cp_sharding_degree")  # parallelisms staticpipe does not run: each must stay 1


def _configs(name: str) -> property:
    """A ``*_configs`` property over the strategy's protobuf message ``name``: a dict of its fields to read,
    and a dict of some of them to set, each key checked as Paddle checks it."""
    def get(self: Any) -> dict:
        return config_of(self, name)

    def set_(self: Any, configs: dict) -> None:
        message = getattr(self.strategy, name)
        fields = message.DESCRIPTOR.fields_by_name
        for key, value in configs.items():
            if key not in fields:
                raise ValueError(f"strategy.{name}: unknown key {key!r}; its keys are {sorted(fields)}")
            if fields[key].message_type is not None and not _repeated(getattr(message, key)):
                raise ValueError(f"strategy.{name}[{key!r}] configures what staticpipe does not run; leave it unset")
            if _repeated(getattr(message, key)):
                del getattr(message, key)[:]
                getattr(message, key).extend(value)
            else:
                try:
                    setattr(message, key, value)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"strategy.{name}[{key!r}] = {value!r}: {exc}") from None

    return property(get, set_, doc=f"Paddle's ``{name}``, read and written through its protobuf message.")


def _repeated(value: Any) -> bool:
    return hasattr(value, "extend") and not isinstance(value, (str, bytes))


def config_of(strategy: Any, name: str) -> dict:
    """``strategy``'s ``name`` configs as a dict (this module's strategy or Paddle's own)."""
    message = getattr(strategy.strategy, name)
    return {f.name: list(v) if _repeated(v := getattr(message, f.name)) else v
            for f in message.DESCRIPTOR.fields if f.message_type is None or _repeated(getattr(message, f.name))}


class DistributedStrategy(paddle.distributed.fleet.DistributedStrategy):
    """Paddle's ``fleet.DistributedStrategy``, its configs readable and settable with any protobuf."""

    pipeline_configs = _configs("pipeline_configs")
    amp_configs = _configs("amp_configs")
    recompute_configs = _configs("recompute_configs")
    hybrid_configs = _configs("hybrid_configs")


_initialised: dict[str, Any] = {}


def init(role_maker: Any = None, is_collective: bool = False, strategy: Any = None, log_level: Any = "INFO") -> None:
    """Paddle's ``fleet.init`` for a collective job: this process's rank and world come from its launcher
    (``staticpipe.launch``, ``paddle.distributed.launch``), or it is the only one. A parameter-server job
    (``is_collective=False``) is refused."""
    collective = is_collective or bool(getattr(role_maker, "_is_collective", False))
    if not collective:
        raise ValueError("fleet.init(is_collective=False) starts a parameter-server job, which staticpipe does not "
                         "run; pipelines are collective: fleet.init(is_collective=True)")
    _initialised.update(strategy=strategy)


def worker_index() -> int:
    world = launched_world()
    return world[0] if world else 0


def worker_num() -> int:
    world = launched_world()
    return world[1] if world else 1


def is_first_worker() -> bool:
    return worker_index() == 0


def distributed_optimizer(optimizer: Any, strategy: Any = None) -> DistributedOptimizer:
    """Paddle's ``fleet.distributed_optimizer``: ``optimizer`` trained as ``strategy`` says (the one given
    to ``fleet.init`` when None)."""
    if not _initialised:
        raise ValueError("fleet.distributed_optimizer before fleet.init: call fleet.init(is_collective=True) first")
    strategy = strategy if strategy is not None else _initialised.get("strategy") or DistributedStrategy()
    if not hasattr(strategy, "strategy"):
        raise ValueError(f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}")
    return DistributedOptimizer(optimizer, strategy)


class DistributedOptimizer:
    """What ``distributed_optimizer`` returns: ``minimize`` builds the pipeline the strategy describes."""

    def __init__(self, optimizer: Any, strategy: Any):
        self.inner_opt, self.user_defined_strategy = optimizer, strategy
        self.pipeline: PipelineOptimizer | None = None
        self._inner = _decorated(optimizer, strategy)  # refusals first, before a program is touched

    def minimize(self, loss: Any, startup_program: Any = None, parameter_list: Any = None,
                 no_grad_set: Any = None) -> tuple[list, list]:
        strategy = self.user_defined_strategy
        pipe = config_of(strategy, "pipeline_configs")
        if not strategy.pipeline:
            pipe.update(accumulate_steps=1)  # data parallelism alone: one micro-batch, one stage
        checkpoints = config_of(strategy, "recompute_configs")["checkpoints"]
        dp, pp = _degrees(strategy)
        self.pipeline = PipelineOptimizer(self._inner, num_microbatches=pipe["accumulate_steps"],
                                          schedule=SCHEDULES.get(pipe["schedule_mode"], pipe["schedule_mode"]),
                                          recompute=bool(strategy.recompute and checkpoints), replica_batches="own",
                                          loss_reduction="mean")  # Paddle's pipeline averages, whatever the loss
        assignment, ranks, _ = self.pipeline.layout(loss)
        if not strategy.pipeline and len(ranks) > 1:
            raise ValueError(f"the program is guarded on {len(ranks)} devices {ranks} but strategy.pipeline is False: "
                             "set strategy.pipeline = True to train it as a pipeline")
        if pp is not None and pp != len(ranks):
            raise ValueError(f"strategy.hybrid_configs['pp_degree'] = {pp}, but the program's device_guard tags name "
                             f"{len(ranks)} devices {ranks}")
        # Paddle's dp_degree -1: the launched processes over the pipeline's devices
        self.pipeline.dp_degree = dp if dp is not None else max(1, worker_num() // len(ranks))
        if len(assignment.devices) > 1:  # it sizes the activations that cross stages; one stage has none
            self.pipeline.micro_batch_size = pipe["micro_batch_size"]
        return self.pipeline.minimize(loss, startup_program, parameter_list, no_grad_set)

    def amp_init(self, place: Any = None, scope: Any = None, test_program: Any = None, **kwargs: Any) -> None:
        if self.pipeline is None:
            raise ValueError("amp_init before minimize: call minimize(loss) first, then run the startup program")
        self.pipeline.amp_init(place, scope, test_program, **kwargs)

    @property
    def plan(self):
        return self.pipeline.plan if self.pipeline is not None else None


def _decorated(optimizer: Any, strategy: Any) -> Any:
    """``optimizer`` with the strategy's AMP around it, after refusing what the strategy asks that
    staticpipe does not do (each by name)."""
    for name in UNSUPPORTED:
        if getattr(strategy, name, False) is True:
            raise ValueError(f"strategy.{name} = True: staticpipe does not implement {name}; unset it (a pipeline "
                             "with data parallelism is hybrid_configs' dp_degree)")
    recompute = config_of(strategy, "recompute_configs")
    if strategy.recompute and recompute["enable_offload"]:
        raise ValueError("strategy.recompute_configs['enable_offload'] = True: staticpipe does not offload "
                         "checkpoints to host memory; unset it")
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


def _degrees(strategy: Any) -> tuple[int | None, int | None]:
    """(dp_degree, pp_degree) from ``hybrid_configs``, each None where it is left to the job: dp_degree -1
    (Paddle's default) and pp_degree 1 (the default: the pipeline's devices are its guards)."""
    hybrid = config_of(strategy, "hybrid_configs")
    for name in HYBRID_ONE:
        if hybrid.get(name, 1) != 1:
            raise ValueError(f"strategy.hybrid_configs[{name!r}] = {hybrid[name]}: staticpipe runs pipeline and data "
                             "parallelism only (pp_degree, dp_degree); set it to 1")
    return (None if hybrid["dp_degree"] == -1 else hybrid["dp_degree"],
            None if hybrid["pp_degree"] == 1 else hybrid["pp_degree"])


__all__ = ["DistributedStrategy", "DistributedOptimizer", "init", "worker_index", "worker_num", "is_first_worker",
           "distributed_optimizer"]
