"""``evaluate``: an evaluation program run over a loader as a forward-only pipeline on the trained stages."""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from .._paddle import framework, np
from ..ir import as_float, is_pir_program, program_view, var_names
from ..placement import op_device
from ..plan import Plan, attach_plan, plan_of
from ..rewrite import build_forward_plan



class Runner(Protocol):
    """What an evaluation uses of an executor (``staticpipe.Executor`` is one): running a program on a batch."""

    def run(self, program: framework.Program, feed: dict | None = None, fetch_list: Sequence | None = None) -> list: ...


def evaluate(exe: Runner, program: framework.Program, dataset: Any, fetch_list: Sequence,
             num_microbatches: int = 1, like: framework.Program | None = None) -> list[np.ndarray | None]:
    """See ``Executor.evaluate``."""
    if plan_of(program) is None:  # rewritten once; the plan stays on the program
        plan_like(program, plan_of(like) if like is not None else None, num_microbatches)
    names = var_names(fetch_list, program)
    dtypes = [program_view(program).global_block()._var_recursive(n).dtype for n in names]
    kinds = [plan_of(program).reduction(n) for n in names]
    totals, samples = None, 0
    for batch in dataset.epoch():
        n = len(next(iter(batch.values())))
        values = [None if v is None else v if k == "each" else as_float(v, dtype).astype(np.float64) * (
                  n if k == "mean" else 1) for v, dtype, k in zip(exe.run(program, feed=batch, fetch_list=names),
                                                                  dtypes, kinds)]
        totals = values if totals is None else [None if t is None else _combined(t, v, k)
                                                for t, v, k in zip(totals, values, kinds)]
        samples += n
    if totals is None:
        raise ValueError("the evaluation data set gave no batch")
    return [None if t is None else t / samples if k == "mean" else t  # None: computed by another process
            for t, k in zip(totals, kinds)]


def plan_like(program: framework.Program, trained: Plan | None, num_microbatches: int = 1) -> Plan:
    """Plan evaluation ``program`` as a forward-only pipeline following ``trained``'s chunking and
    replicas, and attach the plan to it."""
    chunked = trained is not None and len(trained.stages) > len(trained.ranks)
    plan = build_forward_plan(program, num_microbatches, chunked, dp_degree=trained.dp_degree if trained else 1,
                              replica_batches=trained.replica_batches if trained is not None else "split",
                              sharding_degree=trained.sharding_degree if trained is not None else 1)
    attach_plan(plan, program)
    return plan


def is_clone_of(program: framework.Program, trained: Plan) -> bool:
    """Whether ``program`` (without a plan) is an evaluation program of ``trained``
    (``main.clone(for_test=True)``, or the forward network built again in the same device guards): its ops
    are placed on ``trained``'s devices, it is fed through data variables ``trained`` is fed through, and
    it reads state the trained stages hold. A startup program (no data), a network built without the
    guards, Paddle's save and load programs are not: they run as plain Paddle."""
    ops = list(program.global_block().ops)
    devices = {op_device(op) for op in ops} - {None}
    if not devices or not devices <= set(trained.ranks):
        return False
    if is_pir_program(program):
        data = {op.attrs()["name"] for op in ops if op.name() == "pd_op.data"}
        names = [p.name for p in program.global_block().all_parameters()]
    else:
        data = {v.name for v in program.list_vars() if getattr(v, "is_data", False)}
        names = [v.name for v in program.list_vars() if v.persistable]
    return bool(data & set(trained.data_vars)) and any(trained.stage_of_var(name) for name in names)


def _combined(total: Any, value: Any, kind: str) -> Any:
    """The epoch's value so far with one more batch's, as the value reduces the batch (``Plan.reduction``):
    means weighted by their batches' sizes, sums added, maxima and minima taken, per-micro-batch lists joined."""
    if kind == "each":
        return list(total) + list(value)
    return {"max": np.maximum, "min": np.minimum}.get(kind, np.add)(total, value)
