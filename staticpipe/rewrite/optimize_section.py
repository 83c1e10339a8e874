"""The once-per-step sections of each stage, optimize and init, and the exchanges between them.

Why exchanges are data: the optimize sections of different stages talk once per step -- a shared
parameter's partial gradients go to its owner and its new value comes back, and a global-norm clip sums
every stage's part. The plan states each such message as an ``Exchange`` record (as a ``Route`` states a
micro-batch's cut variables), so the runtime executes compute-only runs and performs the exchanges
between them without reading a single op. The section program still shows each exchange as the op
Paddle's own pipeline would hold there (``send_v2``, ``recv_v2``, ``c_allreduce_sum``; on Paddle 3,
``all_reduce``).

Order inside an optimize section: partial gradients of shared parameters (received and added on the
owner, sent by the others), the learning-rate, clipping and update ops (a cross-stage sum where the
program had one), the reset of the gradient buffers, and last the new values of shared parameters.
"""
from __future__ import annotations

from .._paddle import ROLE_OPTIMIZE, core, framework, paddle
from ..plan import INIT, OPTIMIZE, SEND, SUM, CutVar, Exchange, Section
from .optimize import LOSS_SCALING_OPS, Reduction, SharedPartial, StageSlice
from ..ir import ALLREDUCE_SUM, np_dtype
from .programs import (LOW_PRECISION, MERGED_SUFFIX, append_cast, append_comm_op, append_tagged_op, copy_ops,
                       cut_var, declare_merged, declare_var, merged_dtype, section_runs, zero_fill,
                       zero_fills)
from .stages import StageAssignment

PARTIAL_SUFFIX = "@STAGE_PARTIAL"
SUM_SUFFIX = "@STAGE_SUM"


class Exchanges:
    """Every exchange of a plan, in a fixed order, found by what it carries."""

    def __init__(self, block: framework.Block, partials: list[SharedPartial], reductions: list[Reduction],
                 assignment: StageAssignment, overflow_checks: list[int] = ()):
        self.records: list[Exchange] = []
        self.partial: dict[tuple[str, int], Exchange] = {}  # (partial gradient, its stage) -> exchange
        self.reduction: dict[int, Exchange] = {}  # op index of a cross-stage sum -> exchange
        self.value: dict[tuple[str, int], Exchange] = {}  # (shared parameter, reader stage) -> exchange
        for sp in partials:
            # received under a name of its own: on a device holding both stages, the sender's buffer
            # lives in the same scope and must not be replaced by the received copy
            self.partial[(sp.name, sp.stage)] = self._add(
                SEND, cut_var(block, sp.name, sp.name + MERGED_SUFFIX, merged=True), f"{sp.name}{MERGED_SUFFIX}@FROM_STAGE_{sp.stage}",
                f"partial gradient of shared parameter {sp.param}", sp.stage, sp.owner)
        for red in reductions:
            self.reduction[red.op] = self._add_sum(block._var_recursive(red.output), f"cross-stage sum of op "
                                                   f"#{red.op} '{block.ops[red.op].type}'")
        for i in overflow_checks:  # nonzero sum: some stage overflowed
            self.reduction[i] = self._add_sum(block._var_recursive(block.ops[i].output("FoundInfinite")[0]),
                                              f"overflow flag of op #{i} '{block.ops[i].type}', or-ed over the stages")
        for param, readers in sorted(assignment.shared.items()):
            owner = assignment.param_stage[param]
            for peer in readers:
                if peer != owner:
                    self.value[(param, peer)] = self._add(SEND, cut_var(block, param), param,
                                                          f"new value of shared parameter {param}", owner, peer)

    def _add_sum(self, out: framework.Variable, why: str) -> Exchange:
        """The sum over the stages of each stage's part of ``out`` (see ``_append_sum_over_stages``)."""
        cast = _sums_in_float32(out.dtype)
        part = CutVar(out.name + PARTIAL_SUFFIX, tuple(int(d) for d in out.shape),
                      "float32" if cast else np_dtype(out), False)
        return self._add(SUM, part, out.name + SUM_SUFFIX if cast else out.name, why)

    def _add(self, kind: str, var: CutVar, recv_as: str, why: str, src: int = -1, dst: int = -1) -> Exchange:
        record = Exchange(len(self.records), kind, (var,), (recv_as,), why, src, dst)
        self.records.append(record)
        return record


def optimize_section(block: framework.Block, stage: int, device: str, ops: list[int | Reduction],
                     grads: dict[str, str], merge: dict[str, str], partials: list[SharedPartial],
                     assignment: StageAssignment, exchanges: Exchanges) -> Section:
    """Stage ``stage``'s optimize section: ``ops`` (placed by ``place_optimize_ops``) reading the merged
    gradients, with its exchanges in the order of the module docstring."""
    prog = paddle.static.Program()
    dst = prog.global_block()
    taken: list[int] = []  # the section's exchanges, in order
    comm_ops: list[int] = []  # the op of each

    def comm(op_type: str, ex: Exchange, var: CutVar, peer: int) -> None:
        comm_ops.append(append_comm_op(dst, op_type, var, peer, device, ROLE_OPTIMIZE, None))
        taken.append(ex.index)

    for g in merge:
        declare_merged(dst, block, g)
    owned = {g: g + MERGED_SUFFIX for g, p_ in merge.items() if assignment.param_stage[p_] == stage}
    for sp in partials:
        ex = exchanges.partial[(sp.name, sp.stage)]
        if sp.owner == stage:  # add the other stages' partial sums into the owner's buffer
            name, g = ex.recv_as[0], block._var_recursive(sp.name)
            dst.create_var(name=name, shape=g.shape, dtype=merged_dtype(g), persistable=False, stop_gradient=True)
            comm("recv_v2", ex, cut_var(block, sp.name, name, merged=True), sp.stage)
            target = grads[sp.param] + MERGED_SUFFIX
            append_tagged_op(dst, "elementwise_add", device, ROLE_OPTIMIZE, inputs={"X": [target], "Y": [name]},
                             outputs={"Out": [target]}, attrs={"axis": -1})
        elif sp.stage == stage:
            comm("send_v2", ex, ex.vars[0], sp.owner)

    for g in [g for g, merged in owned.items() if dst.var(merged).dtype != block._var_recursive(g).dtype]:
        declare_var(dst, block._var_recursive(g))  # the update reads the gradient in its own dtype, once
        append_cast(dst, owned[g], g, dst.var(g).dtype, device, ROLE_OPTIMIZE)
        del owned[g]

    def read_merged(i: int, desc: core.OpDesc) -> None:
        for g in set(desc.input_arg_names() + desc.output_arg_names()).intersection(owned):
            desc._rename_input(g, owned[g])
            desc._rename_output(g, owned[g])

    run: list[int] = []  # consecutive plain ops, copied together (each copy re-syncs the whole block)
    for item in ops:
        if isinstance(item, (Reduction, StageSlice)) and run:
            copy_ops(dst, block, run, edit=read_merged)
            run = []
        if isinstance(item, Reduction):
            comm_ops.append(_append_reduction(dst, block, item, device, owned))
            taken.append(exchanges.reduction[item.op].index)
        elif isinstance(item, StageSlice):
            comm_op = _append_stage_slice(dst, block, item, device, owned)
            if comm_op is not None:
                comm_ops.append(comm_op)
                taken.append(exchanges.reduction[item.op].index)
        else:
            run.append(item)
    if run:
        copy_ops(dst, block, run, edit=read_merged)
    zero_fills(dst, [g + MERGED_SUFFIX for g in merge], device, ROLE_OPTIMIZE)
    for param, readers in sorted(assignment.shared.items()):
        owner = assignment.param_stage[param]
        if owner == stage:
            if not dst.has_var(param):  # a ZeRO-1 shard that does not update it sends the value it holds
                declare_var(dst, block._var_recursive(param))
            for peer in readers:
                if peer != stage:
                    ex = exchanges.value[(param, peer)]
                    comm("send_v2", ex, ex.vars[0], peer)
        elif stage in readers:
            ex = exchanges.value[(param, stage)]
            declare_var(dst, block._var_recursive(param))
            comm("recv_v2", ex, ex.vars[0], owner)
    return Section(stage, OPTIMIZE, prog, exchanges=tuple(taken),
                   source_ops=tuple(item if isinstance(item, int) else item.op for item in ops),
                   comm_ops=tuple(comm_ops), runs=section_runs(prog, OPTIMIZE, comm_ops=tuple(comm_ops)))


def _append_reduction(dst: framework.Block, src: framework.Block, red: Reduction, device: str,
                      owned: dict[str, str]) -> int:
    """This stage's part of a cross-stage sum: sum the local inputs, then all-reduce into the output;
    returns the index of the all-reduce op."""
    out = src._var_recursive(red.output)
    declare_var(dst, out)
    local = red.output + PARTIAL_SUFFIX + ("@LOCAL" if _sums_in_float32(out.dtype) else "")
    dst.create_var(name=local, shape=out.shape, dtype=out.dtype, persistable=False)
    inputs = [owned.get(n, n) for n in red.inputs]
    for name in red.inputs:
        if not dst.has_var(owned.get(name, name)):
            declare_var(dst, src._var_recursive(name))
    if inputs:
        append_tagged_op(dst, "sum", device, ROLE_OPTIMIZE, inputs={"X": inputs}, outputs={"Out": [local]})
    else:
        zero_fill(dst, local, device, ROLE_OPTIMIZE)
    return _append_sum_over_stages(dst, local, red.output, device)


def _append_stage_slice(dst: framework.Block, src: framework.Block, item: StageSlice, device: str,
                        owned: dict[str, str]) -> int | None:
    """This stage's copy of a loss-scaling op, on its own gradients. ``check_finite_and_unscale``: its flag,
    cast to float32, all-reduced over the stages and cast back (nonzero: some stage overflowed), so every
    stage reads the same flag; returns the all-reduce op's index. ``update_loss_scaling`` where another stage
    of this scope updates the state: ``stop_update`` (it still zeroes the gradients after an overflow)."""
    op = src.ops[item.op]
    grads = [owned.get(n, n) for n in item.grads]
    flag = op.output("FoundInfinite")[0] if op.type == LOSS_SCALING_OPS[0] else None
    if not grads:  # a stage training nothing (frozen layers, activations only): Paddle's kernels need an X,
        grads = [f"{op.output_arg_names[0]}@NO_GRADIENTS"]  # and the stage still votes and keeps the state
        if not dst.has_var(grads[0]):
            dst.create_var(name=grads[0], shape=[1], dtype=core.VarDesc.VarType.FP32, persistable=False)
        zero_fill(dst, grads[0], device, ROLE_OPTIMIZE)

    def edit(i: int, desc: core.OpDesc) -> None:
        desc.set_input("X", grads)
        desc.set_output("Out", grads)
        if flag is not None:
            desc.set_output("FoundInfinite", [flag + "@LOCAL"])
        elif not item.updates_state:
            desc.set_input("StopUpdate", [])
            desc._set_attr("stop_update", True)

    if flag is not None:
        declare_var(dst, src._var_recursive(flag))
        dst.create_var(name=flag + "@LOCAL", shape=[1], dtype=core.VarDesc.VarType.BOOL, persistable=False)
    copy_ops(dst, src, [item.op], edit=edit)
    return None if flag is None else _append_sum_over_stages(dst, flag + "@LOCAL", flag, device)


def _sums_in_float32(dtype: int) -> bool:
    """Whether a value of ``dtype`` crosses the stages as float32: the channels add numbers (numpy would add
    bfloat16's uint16 bit patterns as integers, and gloo takes no bool), and float16 parts add more exactly."""
    return dtype in LOW_PRECISION or dtype == core.VarDesc.VarType.BOOL


def _append_sum_over_stages(dst: framework.Block, local: str, out: str, device: str) -> int:
    """All-reduce this stage's part ``local`` into ``out`` (declared in ``dst``), through float32 where
    ``_sums_in_float32`` (a bool flag comes back true where any stage's was); ``local`` is ``out``'s
    ``PARTIAL_SUFFIX`` name otherwise. Returns the all-reduce op's index: the exchange happens there."""
    dtype, partial, total = dst.var(out).dtype, out + PARTIAL_SUFFIX, out + SUM_SUFFIX
    cast = _sums_in_float32(dtype)
    if cast:
        for name in (partial, total):
            dst.create_var(name=name, shape=dst.var(out).shape, dtype=core.VarDesc.VarType.FP32, persistable=False)
        append_cast(dst, local, partial, core.VarDesc.VarType.FP32, device, ROLE_OPTIMIZE)
    op_type, attrs, x, y = ALLREDUCE_SUM
    index = append_tagged_op(dst, op_type, device, ROLE_OPTIMIZE, inputs={x: [partial]},
                             outputs={y: [total if cast else out]}, attrs=attrs)
    if cast:
        append_cast(dst, total, out, dtype, device, ROLE_OPTIMIZE)
    return index


def init_section(block: framework.Block, stage: int, device: str, merge: dict[str, str]) -> Section:
    """Zero-fills the stage's gradient buffers: once after the startup program, and after a failed step."""
    prog = paddle.static.Program()
    dst = prog.global_block()
    zero_fills(dst, [declare_merged(dst, block, g) for g in merge], device, ROLE_OPTIMIZE)
    return Section(stage, INIT, prog, runs=section_runs(prog, INIT))
