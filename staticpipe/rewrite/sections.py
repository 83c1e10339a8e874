"""Build per-stage sections and the routes between them. A pure pass: program in, plan pieces out.

For every stage, four programs:
- forward: the stage's forward ops for one micro-batch, ``recv_v2`` ops first, ``send_v2`` ops last;
- backward: its backward ops for one micro-batch; the loss gradient is scaled by 1/M and every
  parameter gradient is added into a persistable ``<grad>@MERGED`` buffer, so that after M micro-batches
  the buffer holds the full-batch gradient;
- optimize and init (``optimize_section.py``): once per step, the learning-rate, clipping and update ops
  reading the merged gradients, then a reset of the buffers; once after startup, the buffers' zero-fill.

A variable read by a section but produced by another stage's section becomes a cut variable on a route
between the two sections; data variables are fed straight to every stage that reads them.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .._paddle import GRAD_SUFFIX, OP_ROLE, ROLE_BACKWARD, ROLE_LOSS, core, framework, paddle
from ..ir import arg_names, declared
from ..pir_view import PirView
from ..plan import BACKWARD, FORWARD, INIT, OPTIMIZE, PER_MICROBATCH, WEIGHT, Exchange, Route, Section, SectionRef, Stage
from ..schedule import KINDS
from .optimize import LOSS_SCALING_OPS, Reduction, StageSlice, place_optimize_ops, shared_partials
from . import pir_programs
from .optimize_section import Exchanges, init_section, optimize_section
from .sharding import shard_stages
from .programs import (MERGED_SUFFIX, append_cast, append_comm_op, append_tagged_op, copy_ops, cut_var, declare_merged,
                       declare_var, section_runs)
from .stages import BWD, FWD, OPT, StageAssignment, grad_base, op_label

RECOMPUTE_SUFFIX = "@RECOMPUTE"
WHOLE_IN_B = {"batch_norm_grad", "sync_batch_norm_grad", "layer_norm_grad", "group_norm_grad",
              "instance_norm_grad"}


@dataclass
class SectionOps:
    """Analysis of one per-micro-batch section before its program is built."""

    ref: SectionRef
    ops: list[int]
    reads: list[str] = field(default_factory=list)  # read before written in this section, in order
    writes: set[str] = field(default_factory=set)
    feeds: list[str] = field(default_factory=list)
    keep: set[str] = field(default_factory=set)


Drops = dict[int, set[str]]  # op index -> argument names removed from that op's copy in one section


def _analyse(block: framework.Block, ref: SectionRef, ops: list[int], drop_in: Drops, drop_out: Drops,
             step_values: frozenset[str] = frozenset()) -> SectionOps:
    sec = SectionOps(ref, ops)
    for i in ops:
        op = block.ops[i]
        for name in arg_names(op.input_arg_names):
            if name in drop_in.get(i, ()) or name in step_values:
                continue
            if name not in sec.writes and name not in sec.reads and not block._var_recursive(name).persistable:
                sec.reads.append(name)
        sec.writes.update(n for n in arg_names(op.output_arg_names) if n not in drop_out.get(i, ())
                          and n not in step_values and not block._var_recursive(n).persistable)
    return sec


def step_values(block: framework.Block, assignment: StageAssignment) -> frozenset[str]:
    """Values the same for every micro-batch of a step, held once per stage instead of once per micro-batch
    in flight: AMP's low-precision copies of parameters (a ``cast`` of a parameter, which O1 inserts in
    front of every white-list op), read only on the cast's own stage. Each forward still computes its
    copy (a cheap cast: the parameters change only between steps), into the stage's scope, so the
    backwards of every micro-batch in flight read one copy rather than keeping one each."""
    params = {p.name for p in block.all_parameters()}
    readers: dict[str, set[int]] = {}
    for i, op in enumerate(block.ops):
        for name in op.input_arg_names:
            readers.setdefault(name, set()).add(assignment.stage[i])
    found = set()
    for i, op in enumerate(block.ops):
        if assignment.role[i] != FWD or op.type != "cast":
            continue
        [source], [out] = op.input_arg_names, op.output_arg_names  # PIR names a cast's slots x and out
        if source in params and not block._var_recursive(out).persistable and \
                readers.get(out, set()) <= {assignment.stage[i]}:
            found.add(out)
    return frozenset(found)


def split_weight_gradients(block: framework.Block, ops: list[int], params: set[str]
                           ) -> tuple[list[int], Drops, list[int], Drops]:
    """Split backward ops into B (activation gradients, on the critical path) and W (weight gradients).

    An op producing both kinds (``mul_grad``: dX and dW) is copied into both, each copy with the other
    kind's outputs removed, which Paddle's grad kernels treat as "not needed". Normalisation grads stay
    whole in B: their scale/bias gradients are by-products of the input gradient, so a W copy would
    compute most of the op a second time.
    Returns (B ops, their dropped outputs, W ops, their dropped outputs).
    """
    b_ops, b_drop, w_ops, w_drop = [], {}, [], {}
    whole = getattr(block, "keeps_whole", None)  # a PirView: ops whose two halves it cannot build apart
    for i in ops:
        outs = set(arg_names(block.ops[i].output_arg_names))
        if block.ops[i].type in WHOLE_IN_B or (whole is not None and whole(i)):
            b_ops.append(i)
            continue
        weight = {n for n in outs if grad_base(n) in params}
        if outs - weight or not outs:
            b_ops.append(i)
            if weight:
                b_drop[i] = weight
        if weight:
            w_ops.append(i)
            if outs - weight:
                w_drop[i] = outs - weight
    return b_ops, b_drop, w_ops, w_drop


def param_grads(block: framework.Block, assignment: StageAssignment) -> dict[str, str]:
    """parameter -> the gradient its backward ops produce (``<param>@GRAD``), for trained parameters.

    The raw backward gradient is what accumulates over micro-batches; whatever the optimizer does to it
    afterwards (clipping, regularization) happens once per step on the accumulated sum.
    """
    produced = {n for i, op in enumerate(block.ops) if assignment.role[i] == BWD for n in op.output_arg_names}
    return {p.name: p.name + GRAD_SUFFIX for p in block.all_parameters()
            if p.name + GRAD_SUFFIX in produced}


def build_sections(program: framework.Program, assignment: StageAssignment, stage_ranks: list[int],
                   num_microbatches: int, micro_batch_size: int | None, recompute: frozenset[int] = frozenset(),
                   split_backward: bool = False, seed: tuple[int, int] | None = None, shards: int = 1
                   ) -> tuple[list[Stage], list[Route], list[Exchange], dict[str, tuple[int, ...]],
                              dict[str, SectionRef], dict[int, str]]:
    """Return (stages, routes, exchanges, data variable -> stages that read it, per-micro-batch var ->
    producer, replicated op -> why). ``stage_ranks[s]``: the worker that runs stage s.

    Stages in ``recompute`` keep only their inputs between forward and backward; their backward section
    starts with a second run of the forward ops. ``split_backward`` gives every stage a third
    per-micro-batch section, weight, with the parameter-gradient half of the backward. ``seed``: (numerator,
    denominator) the loss-gradient seed is scaled by (``rewrite/loss.py``); default 1 / num_microbatches.
    ``shards`` > 1: each stage also gets an optimize section per shard of its optimizer state (``sharding.py``).
    """
    seed = seed or (1, num_microbatches)
    block = program.global_block()
    pir = isinstance(program, PirView)
    p = len(assignment.devices)
    by_section: dict[SectionRef, list[int]] = defaultdict(list)
    for i, role in enumerate(assignment.role):
        if role in (FWD, BWD):
            by_section[SectionRef(assignment.stage[i], FORWARD if role == FWD else BACKWARD)].append(i)
    grads = param_grads(block, assignment)
    partials, drop_in = shared_partials(block, assignment, grads)
    held = step_values(block, assignment)
    if pir:
        pir_programs.check_supported(held)
    drop_out: dict[SectionRef, Drops] = defaultdict(dict)
    if split_backward:
        if recompute:
            split = ", ".join(k.name for k in KINDS.values() if k.split_backward)
            raise ValueError(f"recompute is not supported with schedules that split the backward ({split}) yet")
        params = {prm.name for prm in block.all_parameters()} | held  # AMP's copies: their gradients are W's too
        for s in range(p):
            b, w = SectionRef(s, BACKWARD), SectionRef(s, WEIGHT)
            by_section[b], drop_out[b], by_section[w], drop_out[w] = split_weight_gradients(
                block, by_section[b], params)
    kinds = PER_MICROBATCH if split_backward else (FORWARD, BACKWARD)
    order = sorted((SectionRef(s, k) for s in range(p) for k in kinds), key=lambda r: r.order(p))
    secs = {ref: _analyse(block, ref, by_section.get(ref, []), drop_in, drop_out[ref], held) for ref in order}

    producer: dict[str, SectionRef] = {}
    for ref in order:
        for name in secs[ref].writes:
            other = producer.setdefault(name, ref)
            if other.stage != ref.stage:
                raise ValueError(f"variable '{name}' is written on {other} and on {ref}; a variable may be "
                                 "produced on one stage only")

    data_vars: dict[str, list[int]] = defaultdict(list)
    route_vars: dict[tuple[SectionRef, SectionRef], list[str]] = defaultdict(list)
    holder: dict[int, dict[str, SectionRef]] = defaultdict(dict)  # stage -> value -> section that has it
    for ref in order:
        sec = secs[ref]
        here = holder[ref.stage]
        for name in sec.reads:
            var = block._var_recursive(name)
            src = producer.get(name)
            if name in here:
                # produced, received or fed earlier on this stage: every section from there to here
                # must spare it from the garbage collector
                for between in order:
                    if between.stage == ref.stage and here[name].order(p) <= between.order(p) < ref.order(p):
                        secs[between].keep.add(name)
            elif getattr(var, "is_data", False) and src is None:
                fwd = secs[SectionRef(ref.stage, FORWARD)]
                data_vars[name].append(ref.stage)
                fwd.feeds.append(name)
                here[name] = fwd.ref
                if ref != fwd.ref:
                    fwd.keep.add(name)
            elif src is None:
                raise ValueError(f"variable '{name}' read on {ref} is never produced: it is not a data "
                                 "variable, a parameter or the output of an earlier op")
            elif src == ref:
                raise ValueError(f"variable '{name}' is read on {ref} before the op that writes it")
            elif src.order(p) > ref.order(p) or src.stage == ref.stage:
                i = next(j for j in sec.ops if name in block.ops[j].input_arg_names)
                raise ValueError(f"{op_label(i, block.ops[i])} on {ref} reads '{name}', which {src} produces "
                                 "later in the micro-batch's path: data may only flow forward through the "
                                 "stages and gradients backward")
            else:
                # a weight-gradient half reading another stage's gradient (the W of a bias-free linear on a
                # data feed, whose B computes nothing) receives it with its stage's B, which keeps it for W
                dst = SectionRef(ref.stage, BACKWARD) if ref.kind == WEIGHT else ref
                route_vars[(src, dst)].append(name)
                secs[src].keep.add(name)
                if dst != ref:
                    secs[dst].keep.add(name)
                here[name] = dst
        for name in sec.writes:
            here.setdefault(name, ref)

    routes = [Route(k, src, dst, tuple(cut_var(block, n) for n in names))
              for k, ((src, dst), names) in enumerate(sorted(route_vars.items(),
                                                             key=lambda kv: (kv[0][0].order(p), kv[0][1].order(p))))]
    placement = place_optimize_ops(block, assignment, grads)
    _check_sparse_updates(block, assignment, grads)
    reductions = {item.op: item for ops in placement.ops.values() for item in ops if isinstance(item, Reduction)}
    checks = sorted({item.op for ops in placement.ops.values() for item in ops
                     if isinstance(item, StageSlice) and block.ops[item.op].type == LOSS_SCALING_OPS[0]})
    exchanges = Exchanges(block, partials, [reductions[i] for i in sorted(reductions)], assignment, checks)
    sharded = shard_stages(block, assignment, placement.ops, shards) if shards > 1 else None
    stages = []
    for s, device in enumerate(assignment.devices):
        # gradients accumulated here: owned parameters' gradients and partials of shared parameters
        merge = {g: p_ for p_, g in grads.items() if assignment.param_stage.get(p_) == s}
        merge.update({sp.name: sp.param for sp in partials if sp.stage == s})
        sections: dict[str, Section] = {}
        fwd = secs[SectionRef(s, FORWARD)]
        if s in recompute:
            _check_recomputable(block, fwd)
            # the backward reruns every forward op: it needs all of the forward's inputs (fed, received),
            # even those only the forward reads (an AMP cast's input), and nothing the forward computed
            sent = {v.name for r in routes if r.src == fwd.ref for v in r.vars}
            inputs = set(fwd.feeds) | {v.name for r in routes if r.dst == fwd.ref for v in r.vars}
            fwd.keep = {n for n in fwd.keep if n not in fwd.writes} | sent | inputs
        for kind in kinds:
            ref = SectionRef(s, kind)
            if pir:
                sections[kind] = pir_programs.per_microbatch_section(
                    block, secs[ref], routes, merge, seed, drop_in,
                    recompute=fwd.ops if s in recompute and kind == BACKWARD else [], drop_out=drop_out[ref])
            else:
                sections[kind] = _per_microbatch_section(
                    block, secs[ref], routes, device, micro_batch_size, merge, seed, drop_in,
                    drop_out[ref], recompute=fwd.ops if s in recompute and kind == BACKWARD else [], held=held)
        built = [pir_programs.optimize_section(block, s, ops, grads, merge, partials, assignment, exchanges) if pir
                 else optimize_section(block, s, device, ops, grads, merge, partials, assignment, exchanges)
                 for ops in [placement.ops[s], *(sharded[s].ops if sharded else ())]]
        sections[OPTIMIZE] = built[0]
        sections[INIT] = pir_programs.init_section(block, s, merge) if pir else init_section(block, s, device, merge)
        names = [(name, persistable) for sec in sections.values() for p_ in sec.programs
                 for name, persistable in declared(p_)]
        stages.append(Stage(
            index=s, device=device, rank=stage_ranks[s], sections=sections, recompute=s in recompute,
            parameters=tuple(n for n, st in assignment.param_stage.items() if st == s),
            grad_buffers=tuple(g + MERGED_SUFFIX for g in merge),
            step_values=tuple(sorted(held & {name for name, _ in names})), shard_optimize=tuple(built[1:]),
            param_shards=sharded[s].params if sharded else {}, state_shards=sharded[s].state if sharded else {},
            persistables=tuple(sorted({name for name, persistable in names
                                       if persistable and name not in merge and name not in held}))))
    return (stages, routes, exchanges.records, {k: tuple(v) for k, v in data_vars.items()}, producer,
            placement.replicated)


def _check_sparse_updates(block: framework.Block, assignment: StageAssignment, grads: dict[str, str]) -> None:
    """Sparse (SelectedRows) gradients are summed over micro-batches into a dense buffer. For SGD that is
    exact; Paddle's sparse momentum and Adam kernels skip the rows absent from a batch, which a dense
    sum cannot reproduce, so those combinations are refused instead of silently changing the update."""
    sparse = {g for g in grads.values() if block._var_recursive(g).type == core.VarDesc.VarType.SELECTED_ROWS}
    for i, op in enumerate(block.ops):
        if assignment.role[i] == OPT and "Grad" in op.input_names and op.type != "sgd":
            for g in op.input("Grad"):
                if g in sparse:
                    raise ValueError(
                        f"optimizer {op_label(i, op)} updates '{g[:-len(GRAD_SUFFIX)]}' from a sparse gradient; "
                        "micro-batch accumulation makes it dense, which changes this optimizer's sparse "
                        "(lazy) update: use is_sparse=False for that embedding, or the SGD optimizer")


def _check_recomputable(block: framework.Block, fwd: SectionOps) -> None:
    for i in fwd.ops:
        op = block.ops[i]
        if op.has_attr("fix_seed") and not op.attr("fix_seed"):
            raise ValueError(f"recompute on stage {fwd.ref.stage}: {op_label(i, op)} draws new random numbers on "
                             "every run, so its recomputation would differ; set main_program.random_seed "
                             "before building the network (or pass a seed to the op)")


def _per_microbatch_section(block: framework.Block, sec: SectionOps, routes: list[Route], device: str,
                            micro_batch_size: int | None, merge: dict[str, str], seed: tuple[int, int],
                            drop_in: Drops, drop_out: Drops, recompute: list[int] = (),
                            held: frozenset[str] = frozenset()) -> Section:
    role = 0 if sec.ref.kind == FORWARD else ROLE_BACKWARD
    prog = paddle.static.Program()
    dst = prog.global_block()
    recvs = [r for r in routes if r.dst == sec.ref]
    sends = [r for r in routes if r.src == sec.ref]
    comm = []
    for r in recvs:
        for v in r.vars:
            declare_var(dst, block._var_recursive(v.name))
            comm.append(append_comm_op(dst, "recv_v2", v, r.src.stage, device, role, micro_batch_size))

    def edit(i: int, desc: core.OpDesc) -> None:
        if i in drop_in:  # a shared parameter's partial gradients from other stages arrive once per step
            desc.set_input("X", [n for n in desc.input("X") if n not in drop_in[i]])
        if i in drop_out:  # the other half of a split backward op computes these
            for slot in desc.output_names():
                desc.set_output(slot, [n for n in desc.output(slot) if n not in drop_out[i]])
        if (desc.has_attr(OP_ROLE) and desc.attr(OP_ROLE) == ROLE_BACKWARD | ROLE_LOSS
                and desc.type() == "fill_constant" and seed != (1, 1)):
            value = desc.attr("value") * seed[0] / seed[1]
            desc._set_attr("value", value)
            if desc.has_attr("str_value") and desc.attr("str_value"):
                desc._set_attr("str_value", repr(value))

    produced = set()
    for i in sec.ops:
        produced.update(n for n in block.ops[i].output_arg_names if n not in drop_out.get(i, ()))
    grads_here = [g for g in merge if g in produced]

    def recompute_edit(i: int, desc: core.OpDesc) -> None:
        """A second forward run must not update state again (batch-norm running statistics): its
        persistable outputs go to copies (seeded from the state where the op reads it in place)."""
        for name in desc.output_arg_names():
            if block._var_recursive(name).persistable:
                desc._rename_output(name, name + RECOMPUTE_SUFFIX)
                desc._rename_input(name, name + RECOMPUTE_SUFFIX)

    for i in recompute:
        op = block.ops[i]
        for name in op.output_arg_names:
            var = block._var_recursive(name)
            if var.persistable:
                declare_var(dst, var)
                dst.create_var(name=name + RECOMPUTE_SUFFIX, shape=var.shape, dtype=var.dtype)
                if name in op.input_arg_names:
                    append_tagged_op(dst, "assign", device, ROLE_BACKWARD, inputs={"X": [name]},
                                     outputs={"Out": [name + RECOMPUTE_SUFFIX]})
        copy_ops(dst, block, [i], edit=recompute_edit, persistable=held)
    copy_ops(dst, block, sec.ops, edit=edit, persistable=set(grads_here) | held)
    for g in grads_here:  # accumulate: g@MERGED += g (sum also adds sparse rows of embedding gradients)
        merged = declare_merged(dst, block, g)
        if dst.var(merged).dtype != dst.var(g).dtype:  # a low-precision gradient adds up in float32
            dst.create_var(name=g + "@FP32", shape=dst.var(g).shape, dtype=dst.var(merged).dtype)
            append_cast(dst, g, g + "@FP32", dst.var(merged).dtype, device, ROLE_BACKWARD)
            g += "@FP32"
        append_tagged_op(dst, "sum", device, ROLE_BACKWARD, inputs={"X": [merged, g]}, outputs={"Out": [merged]})
    for r in sends:
        for v in r.vars:
            comm.append(append_comm_op(dst, "send_v2", v, r.dst.stage, device, role, micro_batch_size))
    keep = tuple(sorted(sec.keep))
    return Section(sec.ref.stage, sec.ref.kind, prog, feeds=tuple(sec.feeds), keep=keep,
                   recv_routes=tuple(r.index for r in recvs), send_routes=tuple(r.index for r in sends),
                   source_ops=tuple(sec.ops), recomputed_ops=tuple(recompute), comm_ops=tuple(comm),
                   runs=section_runs(prog, sec.ref.kind, keep, tuple(comm)))
