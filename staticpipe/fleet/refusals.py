"""What ``staticpipe.fleet`` refuses of a strategy, naming the option and its value, and the degrees it reads.

Why a module of its own: the refusals are a table of Paddle's options against what staticpipe implements,
read and changed apart from the functions that build a pipeline (``__init__``) or describe it
(``topology``, ``pipeline_opt``).
"""
from __future__ import annotations

from typing import Any

from .._paddle import paddle
from .strategy import config_of

# strategy switches that change what training computes whatever their settings, and that staticpipe does not
# implement: refused whenever on
REFUSED_SWITCHES = ("asp", "qat", "fp16_allreduce", "auto", "semi_auto", "auto_search", "heter_ccl_mode")
HYBRID_ONE = ("mp_degree", "sep_degree", "ep_degree", "cp_degree", "moe_sharding_degree",
              "cp_sharding_degree")  # parallelisms staticpipe does not run: each must stay 1
ONLY_PP_DP = "staticpipe runs pipeline and data parallelism only (pp_degree, dp_degree); set it to 1"
NO_MERGE = ("staticpipe does not merge gradients over steps; set it to 1 (a step already averages the gradients of "
            "pipeline_configs['accumulate_steps'] micro-batches)")
ZERO_1 = ("staticpipe shards the optimizer state only (ZeRO stage 1: sharding_configs['stage'] = 1); gradients and "
          "parameters (stages 2 and 3) are not sharded; set it to 1")
OFFLOAD = "staticpipe does not offload %s to host memory; unset it"
DEGREES = {"dp_degree": "the data-parallel replicas; -1: the launched processes over the others",
           "pp_degree": "the pipeline's devices", "sharding_degree": "the replicas that share one copy of the "
           "optimizer state; 1: not sharded"}


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
            ("sharding", "stage", shard["stage"] != 1, ZERO_1),
            ("sharding", "mp_degree", shard["mp_degree"] != 1, ONLY_PP_DP),
            # with pp_degree > 1 Paddle merges the pipeline's accumulate_steps instead
            ("sharding", "gradient_merge_acc_step", shard["gradient_merge_acc_step"] > 1 and shard["pp_degree"] == 1,
             NO_MERGE),
            ("sharding", "optimize_offload", shard["optimize_offload"], OFFLOAD % "optimizer states"),
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


def _degrees(strategy: Any) -> tuple[int | None, tuple[str, int] | None, int]:
    """(dp_degree, (the configs that give pp_degree, pp_degree), sharding_degree) from ``hybrid_configs``, and
    from ``sharding_configs`` when sharding is on (Paddle's static fleet reads them there); None where left to the
    job: dp_degree -1 (hybrid's default: the launched processes over the stages and shards), pp_degree 1 (the
    guards say). ``_dp_as_optimizer_sharding`` with a pipeline shards the optimizer state over the dp_degree
    replicas too, as Paddle's static sharding does."""
    hybrid = config_of(strategy, "hybrid_configs")
    for name in HYBRID_ONE:
        if hybrid.get(name, 1) != 1:
            raise ValueError(f"{_setting('hybrid_configs', name, hybrid[name])}: {ONLY_PP_DP}")
    shard = config_of(strategy, "sharding_configs") if strategy.sharding else {}
    given: dict[str, dict[str, int]] = {"dp_degree": {}, "pp_degree": {}, "sharding_degree": {}}
    for configs, values in (("hybrid_configs", hybrid), ("sharding_configs", shard)):
        given["dp_degree"].update({configs: values["dp_degree"]} if values.get("dp_degree", -1) != -1 else {})
        given["pp_degree"].update({configs: values["pp_degree"]} if values.get("pp_degree", 1) != 1 else {})
        given["sharding_degree"].update({configs: values["sharding_degree"]}
                                        if values.get("sharding_degree", 1) != 1 else {})
    for key, values in given.items():
        for configs, value in values.items():  # -1 (dp_degree's default) is left to the job above
            if not isinstance(value, int) or value < 1:
                switch = "sharding" if configs == "sharding_configs" else None
                raise ValueError(f"{_setting(configs, key, value, switch)}: {key} must be an integer >= 1 "
                                 f"({DEGREES[key]})")
        if len(set(values.values())) > 1:
            raise ValueError(f"{_setting('hybrid_configs', key, values['hybrid_configs'])} but "
                             f"{_setting('sharding_configs', key, values['sharding_configs'], 'sharding')}: Paddle's "
                             "static fleet reads the sharding_configs one; make them agree")
    dp, pp = next(iter(given["dp_degree"].values()), None), next(iter(given["pp_degree"].items()), None)
    sharding = next(iter(given["sharding_degree"].values()), 1)
    if shard.get("_dp_as_optimizer_sharding") and pp is not None and dp is not None and dp > 1:
        dp, sharding = 1, sharding * dp  # the replicas of the data-parallel group shard the state as well
    return dp, pp, sharding
