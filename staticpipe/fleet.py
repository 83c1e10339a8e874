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
loss's reduction, as Paddle's pipeline does. A feature staticpipe does not implement (sharding_degree > 1,
tensor parallelism, gradient merge, LAMB, ...) is refused by name where it is on with a degree or setting
that changes what training computes; at degree 1, or where Paddle's fleet would not apply it (LAMB with
Momentum, DGC without replicas), it runs. Settings that only tune Paddle's own collectives (fusion sizes,
NCCL rings, hierarchical allreduce) change nothing here.

Why a strategy class of our own: Paddle 2.6 reads and writes its ``*_configs`` with helpers that ask a
protobuf field for its ``label``, which today's protobuf no longer has (Paddle 3 asks ``is_repeated``), so
its getters fail and its setters with them ("sharding_configs is not a attribute of DistributedStrategy").
This class runs Paddle's own getter and setter of every ``*_configs`` property that uses those helpers,
with Paddle 3.3's label-free helpers where Paddle's fail: names, defaults and merging stay Paddle's, and an
unknown key is refused (an ``AssertionError``, as Paddle's, and a ``ValueError``) naming the keys there are.
"""
from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Callable

from ._paddle import paddle
from .optimizer import PipelineOptimizer
from .placement import launched_world

SCHEDULES = {"1F1B": "1F1B", "F-then-B": "F-then-B"}  # Paddle's schedule_mode names
# strategy switches that change what training computes whatever their settings, and that staticpipe does not
# implement: refused whenever on
REFUSED_SWITCHES = ("asp", "qat", "fp16_allreduce", "auto", "semi_auto", "auto_search", "heter_ccl_mode")
HYBRID_ONE = ("mp_degree", "sep_degree", "ep_degree", "cp_degree", "moe_sharding_degree",
              "cp_sharding_degree")  # parallelisms staticpipe does not run: each must stay 1
_PADDLE = paddle.distributed.fleet.DistributedStrategy
_MODULE = sys.modules[_PADDLE.__module__]  # Paddle's distributed_strategy module: its helpers and protobuf


class ConfigKeyError(ValueError, AssertionError):
    """An unknown key in a ``*_configs`` dict: an AssertionError as Paddle's, a ValueError as staticpipe's."""


# --- Paddle's protobuf helpers without FieldDescriptor.label (Paddle 3.3's: label is gone from protobuf 7) ---
def _is_repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)
    if repeated is None:
        return field.label == field.LABEL_REPEATED
    return repeated if isinstance(repeated, bool) else repeated()


def _msg_dict(msg: Any) -> dict:
    return {f.name: ((_repeated_msg_dicts(v) if f.type == f.TYPE_MESSAGE else list(v)) if _is_repeated(f) else v)
            for f in msg.DESCRIPTOR.fields for v in (getattr(msg, f.name),)}


def _repeated_msg_dicts(msgs: Any) -> list[dict]:
    return [{f.name: list(v) if _is_repeated(f) else v for f in item.DESCRIPTOR.fields
             for v in (getattr(item, f.name),)} for item in msgs]


def _assign(msg: Any, config: Any, _items: bool = False) -> None:
    """Paddle's ``assign_configs_value`` and (``_items``) ``assign_repeated_msg``, as Paddle 3.3 has them."""
    for key in config:
        item = msg.add() if _items else msg
        for f in item.DESCRIPTOR.fields:
            if key == f.name and not _is_repeated(f):
                setattr(item, f.name, config[f.name])
            elif key == f.name and config[f.name] is not None and f.type == f.TYPE_MESSAGE:
                _assign(getattr(msg, f.name), config[f.name], not _items)
            elif key == f.name and config[f.name] is not None:
                getattr(msg, f.name).extend(config[f.name])


def _check_keys(name: str, msg: Any, config: dict, field_name: str) -> None:
    """Paddle's ``check_configs_key``, naming the property and its keys (Paddle names some otherwise)."""
    keys = msg.DESCRIPTOR.fields_by_name
    for key in config:
        if key not in keys:
            raise ConfigKeyError(f"strategy.{name}: unknown key {key!r}; its keys are {sorted(keys)}")


_HELPERS = {"get_msg_dict": _msg_dict, "get_repeated_msg_dict": _repeated_msg_dicts, "assign_configs_value": _assign,
            "assign_repeated_msg": functools.partial(_assign, _items=True)}


def _paddles_helpers_work() -> bool:
    try:
        _MODULE.get_msg_dict(_MODULE.distributed_strategy_pb2.DistributedStrategy())
    except AttributeError:  # Paddle 2.6 under protobuf 7: FieldDescriptor has no label
        return False
    return True


def _rebound(function: Callable | None, names: dict) -> Callable | None:
    """Paddle's ``function`` (a property's getter or setter) calling ``names`` for its module's globals."""
    if function is None:
        return None
    inner = inspect.unwrap(function)  # Paddle's setters are wrapped by is_strict_auto
    copy = types.FunctionType(inner.__code__, {**inner.__globals__, **names}, inner.__name__, inner.__defaults__,
                              inner.__closure__)
    copy.__doc__, copy.__qualname__ = inner.__doc__, inner.__qualname__
    return _MODULE.is_strict_auto(copy) if inner is not function else copy


def _configs_properties() -> dict[str, property]:
    """Every ``*_configs`` property of Paddle's strategy that reads or writes through the helpers above, as
    Paddle's getter and setter with this module's key check, and its helpers where Paddle's fail."""
    helpers = {} if _paddles_helpers_work() else _HELPERS
    found = {}
    for name, prop in inspect.getmembers(_PADDLE, lambda p: isinstance(p, property)):
        used = {n for f in (prop.fget, prop.fset) if f is not None for n in inspect.unwrap(f).__code__.co_names}
        if name.endswith("_configs") and used & {*_HELPERS, "check_configs_key"}:
            names = {**helpers, "check_configs_key": functools.partial(_check_keys, name)}
            found[name] = property(_rebound(prop.fget, names), _rebound(prop.fset, names), doc=prop.__doc__)
    return found


class DistributedStrategy(_PADDLE):
    """Paddle's ``fleet.DistributedStrategy``, its ``*_configs`` readable and settable with any protobuf."""


CONFIGS = _configs_properties()
for _name, _property in CONFIGS.items():
    setattr(DistributedStrategy, _name, _property)


def config_of(strategy: Any, name: str) -> dict:
    """``strategy``'s ``name`` configs as Paddle's getter gives them (this module's strategy or Paddle's own)."""
    return CONFIGS[name].fget(strategy)


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
        if pp is not None and pp[1] != len(ranks):
            raise ValueError(f"strategy.{pp[0]}['pp_degree'] = {pp[1]}, but the program's device_guard tags name "
                             f"{len(ranks)} devices {ranks}")
        # Paddle's dp_degree -1: the launched processes over the pipeline's devices
        self.pipeline.dp_degree = dp if dp is not None else max(1, worker_num() // len(ranks))
        _refuse_with_replicas(strategy, self.inner_opt, self.pipeline.dp_degree)
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


ONLY_PP_DP = "staticpipe runs pipeline and data parallelism only (pp_degree, dp_degree); set it to 1"
NO_MERGE = ("staticpipe does not merge gradients over steps; set it to 1 (a step already averages the gradients of "
            "pipeline_configs['accumulate_steps'] micro-batches)")
NOT_YET = "sharding_degree > 1 is not supported yet; set it to 1"
OFFLOAD = "staticpipe does not offload %s to host memory; unset it"


def _setting(configs: str, key: str, value: Any, switch: str | None = None) -> str:
    return f"strategy.{configs}[{key!r}] = {value}" + (f" (strategy.{switch} = True)" if switch else "")


def _refuse(strategy: Any, optimizer: Any) -> None:
    """Refuse, naming the option and its value, a feature the strategy switches on that staticpipe does not
    implement, where its degree or setting changes what training computes (``_refuse_with_replicas``: where
    that depends on the number of replicas)."""
    for name in REFUSED_SWITCHES:
        if getattr(strategy, name, False) is True:
            raise ValueError(f"strategy.{name} = True: staticpipe does not implement {name}; unset it")
    configs = {name: config_of(strategy, f"{name}_configs")
               for name in ("sharding", "tensor_parallel", "gradient_merge", "recompute")}
    shard = configs["sharding"]
    for switch, key, applies, problem in (
            ("sharding", "sharding_degree", shard["sharding_degree"] != 1, f"{NOT_YET} (sharding_configs' pp_degree "
             "and dp_degree then give the pipeline's devices and its replicas)"),
            ("sharding", "mp_degree", shard["mp_degree"] != 1, ONLY_PP_DP),
            # with pp_degree > 1 Paddle merges the pipeline's accumulate_steps instead
            ("sharding", "gradient_merge_acc_step", shard["gradient_merge_acc_step"] > 1 and shard["pp_degree"] == 1,
             NO_MERGE),
            ("sharding", "optimize_offload", shard["optimize_offload"], OFFLOAD % "optimizer states"),
            ("sharding", "_dp_as_optimizer_sharding", shard["_dp_as_optimizer_sharding"] and shard["dp_degree"] > 1
             and shard["pp_degree"] > 1, f"sharding the optimizer states over the {shard['dp_degree']} replicas is not "
             "supported yet; unset it"),
            ("tensor_parallel", "tensor_parallel_degree", configs["tensor_parallel"]["tensor_parallel_degree"] != 1,
             ONLY_PP_DP),
            ("gradient_merge", "k_steps", configs["gradient_merge"]["k_steps"] > 1, NO_MERGE),
            ("recompute", "enable_offload", configs["recompute"]["enable_offload"], OFFLOAD % "checkpoints")):
        if getattr(strategy, switch) and applies:
            raise ValueError(f"{_setting(f'{switch}_configs', key, configs[switch][key], switch)}: {problem}")
    for switch, kind, method in (("lamb", paddle.optimizer.Adam, "LAMB"), ("lars", paddle.optimizer.Momentum, "LARS")):
        if getattr(strategy, switch) and isinstance(optimizer, kind):  # Paddle's fleet applies it to these only
            raise ValueError(f"strategy.{switch} = True with the optimizer {type(optimizer).__name__}: Paddle's fleet "
                             f"trains it as {method}, which staticpipe does not implement; unset strategy.{switch}")


def _refuse_with_replicas(strategy: Any, optimizer: Any, replicas: int) -> None:
    """``_refuse`` for the features that change training only across data-parallel replicas."""
    if replicas == 1:
        return
    momentum = isinstance(optimizer, paddle.optimizer.Momentum)
    local = momentum or isinstance(optimizer, paddle.optimizer.SGD)  # Paddle's local SGD applies to these only
    k_steps = config_of(strategy, "localsgd_configs")["k_steps"]
    with_replicas = f"with {replicas} data-parallel replicas"
    for applies, message in (
            (strategy.dgc and momentum, f"strategy.dgc = True with the optimizer {type(optimizer).__name__} and "
             f"{replicas} data-parallel replicas: Paddle's fleet compresses their gradients (DGC), which staticpipe "
             "does not implement; unset it"),
            (strategy.localsgd and local and k_steps > 1, _setting("localsgd_configs", "k_steps", k_steps, "localsgd")
             + f" {with_replicas}: staticpipe averages the replicas' gradients every step, not their parameters every "
             "k_steps; set it to 1"),
            (strategy.adaptive_localsgd and local, f"strategy.adaptive_localsgd = True {with_replicas}: staticpipe "
             "averages the replicas' gradients every step, not their parameters every few steps; unset it"),
            (strategy.sync_batch_norm, f"strategy.sync_batch_norm = True {with_replicas}: staticpipe does not "
             "synchronise batch-norm statistics across replicas; unset it")):
        if applies:
            raise ValueError(message)


def _degrees(strategy: Any) -> tuple[int | None, tuple[str, int] | None]:
    """(dp_degree, (the configs that give pp_degree, pp_degree)) from ``hybrid_configs``, and from
    ``sharding_configs`` when sharding is on (Paddle's static fleet reads them there); None where left to the job:
    dp_degree -1 (hybrid's default: the launched processes over the stages), pp_degree 1 (the guards say)."""
    hybrid = config_of(strategy, "hybrid_configs")
    for name in HYBRID_ONE:
        if hybrid.get(name, 1) != 1:
            raise ValueError(f"{_setting('hybrid_configs', name, hybrid[name])}: {ONLY_PP_DP}")
    if hybrid["sharding_degree"] != 1:
        raise ValueError(f"{_setting('hybrid_configs', 'sharding_degree', hybrid['sharding_degree'])}: {NOT_YET}")
    given = {"dp_degree": {}, "pp_degree": {}}
    for configs, values in (("hybrid_configs", hybrid),
                            ("sharding_configs", config_of(strategy, "sharding_configs") if strategy.sharding else {})):
        given["dp_degree"].update({configs: values["dp_degree"]} if values.get("dp_degree", -1) != -1 else {})
        given["pp_degree"].update({configs: values["pp_degree"]} if values.get("pp_degree", 1) != 1 else {})
    for key, values in given.items():
        if len(set(values.values())) > 1:
            raise ValueError(f"{_setting('hybrid_configs', key, values['hybrid_configs'])} but "
                             f"{_setting('sharding_configs', key, values['sharding_configs'], 'sharding')}: Paddle's "
                             "static fleet reads the sharding_configs one; make them agree")
    return next(iter(given["dp_degree"].values()), None), next(iter(given["pp_degree"].items()), None)


__all__ = ["DistributedStrategy", "DistributedOptimizer", "init", "worker_index", "worker_num", "is_first_worker",
           "distributed_optimizer"]
