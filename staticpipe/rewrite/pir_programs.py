"""Section programs of a PIR program: the PIR half of what ``programs.py`` and ``optimize_section.py`` do.

A section is a clone of the differentiated program with every op it does not run erased (in reverse
order, so no erased op still has a user). A value it reads from another section becomes a ``pd_op.data``
of the value's name, which the runtime feeds from the micro-batch's scope (``runtime/pir_runs.py``); the
values it produces for later sections are handed over to that scope (see below; the section program's
``VALUES`` attribute maps names to its values). Stage-free ops (parameters, persistable state, constants: ``pir_ir.FREE_OPS``)
are kept in every section that reads them.

The same section analysis as the legacy IR's (``sections.py``) decides what each section runs, keeps and
sends; only these builders differ:
- backward: the loss gradient scaled by 1/M after the op that makes it, and every parameter gradient
  added in place into the persistable ``<grad>@MERGED`` buffer at the end. The gradient itself is made
  persistable too, as the legacy sections declare it: a fresh gradient buffer on every run (a 768 x 768
  matrix: 2.4 MB, allocated and first touched) made a backward section 2.3x slower than with the buffer
  kept in the stage's scope and reused (3.5 ms -> 1.5 ms, ``bench/ir_compare.py``'s wide MLP);
- optimize: the update ops reading the ``@MERGED`` buffers where they read the gradients, then the buffers
  filled with zeros in place;
- init: the buffers made (zero) as persistable values of the stage's scope.

What a section leaves for later sections (its ``keep``) is written into the device's scope
(``_hand_over``), from where the runtime moves each value's buffer to the micro-batch's scope after the
run: no fetch, no copy (a fetched value aliases the executor's fetch buffer and must be copied; 60 -> 45 µs
a run for a small forward section).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from .._paddle import core, paddle
from ..pir_ir import FEEDS, FREE_OPS, HANDED_OVER, VALUES, is_pir_data
from ..pir_view import PirView
from ..plan import BACKWARD, INIT, OPTIMIZE, WEIGHT, Route, Run, Section
from .optimize import Reduction
from .programs import MERGED_SUFFIX
from .stages import op_label


def check_supported(held: frozenset) -> None:
    """Refuse, naming it, what the PIR builders do not build yet (README: "PIR programs")."""
    if held:
        raise ValueError("staticpipe does not pipeline PIR programs with AMP yet; build the program in legacy-IR "
                         "mode for it (STATICPIPE_LEGACY_IR=1, see README)")


def cut_program(view: PirView, ops: list[int], persistent: dict[str, str] | None = None,
                reads: tuple[str, ...] = (), drop: dict[int, set[str]] | None = None,
                drop_out: dict[int, set[str]] | None = None, private_state: tuple[int, ...] = ()) -> Any:
    """A clone of ``view.program`` running only ``view.ops[i]`` for ``i`` in ``ops`` (in program order).

    Values those ops (and ``reads``, which the caller reads in ops it appends) read that they do not
    produce become data ops of their names; ``persistent`` maps some of those names to a persistable
    variable of the stage's scope read instead (a gradient's ``@MERGED`` buffer). ``drop``: sum op ->
    inputs it leaves out here (a shared parameter's partial gradients from other stages, which arrive once
    per step). ``drop_out``: backward op -> the gradients it does not compute here (the other half of a split
    backward computes them): the op is rebuilt by Paddle's vjp of its forward op for the others only.
    ``private_state``: ops whose in-place update of persistable state (batch norm's running statistics)
    updates a copy here instead: their recomputation in a backward must not update the state again."""
    from paddle import pir

    persistent, drop, drop_out = persistent or {}, drop or {}, drop_out or {}
    original = list(view.program.global_block().ops)
    kept = {op for i in ops for op in view.ops[i].ops}
    produced = {n for i in ops for n in view.ops[i].output_arg_names if n not in drop_out.get(i, ())}
    inputs: list[str] = []
    read = [n for i in sorted(ops) for n in view.ops[i].input_arg_names if n not in drop.get(i, ())]
    for name in read + list(reads):
        if name in view.free_ops:
            kept.add(view.free_ops[name])
        elif name not in produced and name not in inputs:
            inputs.append(name)
    mapping = pir.IrMapping()
    program = view.program.clone(mapping)
    block = program.global_block()
    values: dict[str, Any] = {}
    with paddle.static.program_guard(program):
        for name in inputs:
            var = view.var(name)
            pir.reset_insertion_point_to_start()
            data = (_persistable_data(var, persistent[name]) if name in persistent else
                    paddle._pir_ops.data(name, list(var.shape), var.dtype, core.Place()))
            mapping.look_up(var.value).replace_all_uses_with(data)
            values[persistent.get(name, name)] = data
    clones = list(block.ops)[len(inputs):]
    with paddle.static.program_guard(program):
        for i in private_state:
            _update_a_copy(view.ops[i], mapping)
        rebuilt = {view.ops[i].output_arg_names[0]: _sum_without(view.ops[i], names, mapping)
                   for i, names in drop.items() if i in ops and names}
        for i, names in drop_out.items():
            if i in ops and names:
                rebuilt.update(_half(view, view.ops[i], names, mapping, {**values, **rebuilt}))
                kept.discard(view.ops[i].op)
    for op, clone in zip(reversed(original), reversed(clones)):
        if op not in kept:
            clone.erase()
    gone = {view.ops[i].ops[0] for i, names in drop.items() if i in ops and names}  # sums' combines, erased
    for name, var in view.vars.items():
        op = var.value.get_defining_op()
        if name in rebuilt or (op in kept and op not in gone and name not in values):
            values[name] = rebuilt[name] if name in rebuilt else mapping.look_up(var.value)
    if hasattr(program, "lr_scheduler"):  # the runtime sets the learning rate itself, in the stage's scope
        del program.lr_scheduler
    setattr(program, VALUES, values)
    setattr(program, FEEDS, tuple(n for n, v in values.items() if is_pir_data(v)))
    return program


def _update_a_copy(op: Any, mapping: Any) -> None:
    """Give the clone of in-place op ``op`` a copy, made just before it, of each persistable value it reads:
    the state it updates (batch norm's running statistics) is left as it was; the parameters it only reads
    (its scale and shift) are copied too, alike in value."""
    clone = mapping.look_up(next(r for r in op.op.results() if r.initialized())).get_defining_op()
    for k in range(clone.num_operands()):
        source = clone.operand_source(k)
        if source.persistable:
            paddle.pir.set_insertion_point(clone)
            clone.operand(k).set_source(paddle.assign(source))


def _sum_without(op: Any, names: set[str], mapping: Any) -> Any:
    """Replace the clone of the sum ``op`` (``add_n(combine(values))``) by an ``add_n`` of its other inputs;
    returns the new sum."""
    combine, add_n = (mapping.look_up(o.result(0)).get_defining_op() for o in op.ops)
    kept = [v for name, v in zip(op.input("X"), combine.operands_source()) if name not in names]
    paddle.pir.set_insertion_point_after(add_n)
    total = paddle.add_n(kept) if len(kept) > 1 else paddle.assign(kept[0])
    add_n.result(0).replace_all_uses_with(total)
    add_n.erase()
    combine.erase()
    return total


def _half(view: PirView, op: Any, dropped: set[str], mapping: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Replace the clone of backward op ``op`` by Paddle's vjp of its forward op (``core.call_vjp``) asked
    for every gradient ``op`` computes but ``dropped``; returns name -> new gradient. What the vjp reads
    (the forward's inputs and outputs, its outputs' gradients) is the section's value of that name."""
    fwd = op.forward
    clone = mapping.look_up(next(r for r in op.op.results() if r.initialized())).get_defining_op()

    def here(value: Any) -> Any:
        name = view.names[value]
        return values[name] if name in values else mapping.look_up(value)

    # result k of a backward op is the gradient of its forward op's operand k; named by position, not as
    # "<operand>@GRAD": a gradient that is one term of a sum (a residual, a second head) has a name of its own
    results = list(op.op.results())
    if len(results) != fwd.num_operands():
        raise ValueError(f"{op_label(op.index, op)}: its {len(results)} results are not the gradients of its forward "
                         f"op's {fwd.num_operands()} inputs, so it cannot be split into B and W halves; use a "
                         "schedule that does not split the backward (1F1B)")
    out = [view.names[r] if r.initialized() else None for r in results]
    stops = [[name is None or name in dropped] for name in out]
    grads_out = [[here(view.var(f"{view.names[r]}@GRAD").value)] for r in fwd.results()]
    paddle.pir.set_insertion_point_after(clone)
    made = paddle.base.core.call_vjp(mapping.look_up(fwd.result(0)).get_defining_op(),
                                     [[here(v)] for v in fwd.operands_source()],
                                     [[here(r)] for r in fwd.results()], grads_out, stops)
    new = {name: made[k][0] for k, name in enumerate(out) if not stops[k][0]}
    for result, name in zip(results, out):
        if name in new:
            mapping.look_up(result).replace_all_uses_with(new[name])
    return new  # the old op goes with the ops the section does not run (its dropped outputs' users first)


def per_microbatch_section(view: PirView, sec: Any, routes: list[Route], merge: dict[str, str],
                           seed: tuple[int, int], drop: dict[int, set[str]], recompute: list[int] = (),
                           drop_out: dict[int, set[str]] | None = None) -> Section:
    """The forward or backward section ``sec`` (``sections.SectionOps``; see the module docstring); ``drop``:
    sum op -> its inputs computed elsewhere (as ``cut_program``'s); ``recompute``: the stage's forward ops,
    run again first (activation checkpointing: the forward kept only its inputs)."""
    ref, ops = sec.ref, sec.ops
    # a recomputed in-place update of state (batch norm's running statistics) updates a copy: once per step
    updating = tuple(i for i in recompute if view.ops[i].op.name().endswith("_")
                     and any(v.persistable for v in view.ops[i].op.operands_source()))
    program = cut_program(view, list(recompute) + list(ops), drop=drop, drop_out=drop_out, private_state=updating)
    values = getattr(program, VALUES)
    if ref.kind in (BACKWARD, WEIGHT):
        with paddle.static.program_guard(program):
            loss_grad = view.loss + "@GRAD"
            if loss_grad in values and seed != (1, 1):
                _scale_after(values[loss_grad], seed[0] / seed[1])
            for grad in merge:
                if grad in values:
                    g = values[grad]
                    paddle.pir.set_insertion_point_to_block_end(program.global_block())
                    paddle._C_ops.add_(_persistable_data(g, grad + MERGED_SUFFIX), g)
                    g.persistable = True  # its buffer stays in the stage's scope, reused by every micro-batch
                    paddle._C_ops.set_persistable_value(g, grad)
    keep = tuple(sorted(sec.keep))
    fed = set(getattr(program, FEEDS))
    _hand_over(program, [n for n in keep if n in values and n not in fed and not values[n].persistable], ref.stage)
    return Section(ref.stage, ref.kind, program, feeds=tuple(sec.feeds), keep=keep,
                   recv_routes=tuple(r.index for r in routes if r.dst == ref),
                   send_routes=tuple(r.index for r in routes if r.src == ref), source_ops=tuple(ops),
                   recomputed_ops=tuple(recompute), runs=(Run(program, keep),))


def _hand_over(program: Any, names: list[str], stage: int) -> None:
    """Write the values ``names`` of ``program`` into the device's scope, as ``<name>@TO_<stage>`` (two stages
    of one device compute values of one name in their optimize sections), for the runtime to move into the
    scope of the micro-batch or optimize section (``HANDED_OVER``: name -> the device scope's name)."""
    values = getattr(program, VALUES)
    # not the result of an in-place op (assign_value_, add_, ...: it is its input's variable) nor an element
    # of a vector split apart (builtin.split: a variable inside the vector's), which the interpreter cannot
    # rename ("Original variable ... is not found in the scope"); such a value is fetched and copied (pir_runs)
    names = [n for n in names if not _unrenamable(values[n].get_defining_op().name())]
    with paddle.static.program_guard(program):
        paddle.pir.set_insertion_point_to_block_end(program.global_block())
        for name in names:
            values[name].persistable = True
            paddle._C_ops.set_persistable_value(values[name], f"{name}@TO_{stage}")
    setattr(program, HANDED_OVER, {name: f"{name}@TO_{stage}" for name in names})


def _unrenamable(op_name: str) -> bool:
    return op_name.endswith("_") or op_name == "builtin.split"


def _scale_after(value: Any, factor: float) -> None:
    """Multiply ``value`` by ``factor`` for all its users (the loss gradient: the mean over one micro-batch
    counts 1/M of the step's mean)."""
    users = [(op, k) for op in value.all_used_ops() for k in range(op.num_operands())
             if op.operand_source(k).is_same(value)]
    paddle.pir.set_insertion_point_after(value.get_defining_op())
    scaled = paddle.scale(value, factor)
    for op, k in users:
        op.operand(k).set_source(scaled)


def _persistable_data(like: Any, name: str) -> Any:
    """A data op reading the persistable ``name`` of the stage's scope, shaped as ``like`` (a value or var)."""
    data = paddle._pir_ops.data(name, list(like.shape), like.dtype, core.Place())
    data.persistable = True
    return data


@dataclass
class _Piece:
    """One run of a PIR optimize section: received partial gradients added into buffers (recv name, buffer
    name), then ``ops``, then this stage's part of ``reduction``; the last computing piece zeroes the buffers."""

    ops: list[int] = field(default_factory=list)
    adds: list[tuple[str, str, str]] = field(default_factory=list)  # (received as, into buffer, partial)
    reduction: Reduction | None = None
    zero: bool = False


def optimize_section(view: PirView, stage: int, ops: list, grads: dict[str, str], merge: dict[str, str],
                     partials: list, assignment: Any, exchanges: Any) -> Section:
    """Stage ``stage``'s once-per-step ops, in the legacy section's order (``optimize_section.py``): the
    partial gradients of shared parameters to their owner, the updates reading the accumulated gradients,
    the buffers zeroed, the shared parameters' new values to their readers. One run per stretch between
    two exchanges. Before a cross-stage sum (``Reduction``) a run adds up the stage's own inputs into the
    exchange's part; the exchange leaves the total under the sum's name in the scope the optimize section
    runs in, from where later runs read it, as they read every value an earlier run made."""
    pieces, taken = [_Piece()], []

    def exchange(index: int) -> None:
        taken.append(index)
        pieces.append(_Piece())

    for sp in partials:
        ex = exchanges.partial[(sp.name, sp.stage)]
        if sp.owner == stage:
            exchange(ex.index)
            pieces[-1].adds.append((ex.recv_as[0], grads[sp.param] + MERGED_SUFFIX, sp.name))
        elif sp.stage == stage:
            exchange(ex.index)
    for item in ops:
        if isinstance(item, Reduction):
            pieces[-1].reduction = item
            exchange(exchanges.reduction[item.op].index)
        elif isinstance(item, int):
            pieces[-1].ops.append(item)
        else:
            raise ValueError(f"stage {stage}: {type(item).__name__} of {op_label(item.op, view.ops[item.op])} is not "
                             "built for PIR programs yet (AMP loss scaling)")
    pieces[-1].zero = True
    for param, readers in sorted(assignment.shared.items()):
        owner = assignment.param_stage[param]
        for peer in readers:
            if peer != owner and stage in (owner, peer):
                exchange(exchanges.value[(param, peer)].index)
    buffers = {g: g + MERGED_SUFFIX for g in merge}
    runs = []
    for k, piece in enumerate(pieces):
        later = {n for p_ in pieces[k + 1:] for i in p_.ops for n in view.ops[i].input_arg_names}
        later |= {n for p_ in pieces[k + 1:] if p_.reduction is not None for n in p_.reduction.inputs}
        runs.append(_optimize_run(view, stage, piece, buffers, later, exchanges))
    return Section(stage, OPTIMIZE, next((r.program for r in runs if r.program is not None), None),
                   exchanges=tuple(taken), runs=tuple(runs),
                   source_ops=tuple(item if isinstance(item, int) else item.op for item in ops))


def _optimize_run(view: PirView, stage: int, piece: _Piece, buffers: dict[str, str], later: set[str],
                  exchanges: Any) -> Run:
    if not (piece.ops or piece.adds or piece.reduction or piece.zero):
        return Run(None)
    reads = tuple(piece.reduction.inputs) if piece.reduction is not None else ()
    program = cut_program(view, piece.ops, persistent=buffers, reads=reads)
    values, feeds = getattr(program, VALUES), list(getattr(program, FEEDS))
    handed = [n for n in sorted(later) if n in values and not values[n].persistable and n not in feeds]
    with paddle.static.program_guard(program):
        leading = [op for op in itertools.takewhile(lambda o: o.name() in FREE_OPS, program.global_block().ops)]
        if leading:  # after the data ops (the buffer's among them), before every op that may read the buffer
            paddle.pir.set_insertion_point_after(leading[-1])
        for received, buffer, partial in piece.adds:
            like = view.var(partial)
            values[received] = paddle._pir_ops.data(received, list(like.shape), like.dtype, core.Place())
            feeds.append(received)
            if buffer not in values:
                values[buffer] = _persistable_data(like, buffer)
            paddle._C_ops.add_(values[buffer], values[received])
        paddle.pir.set_insertion_point_to_block_end(program.global_block())
        if piece.reduction is not None:
            part = exchanges.reduction[piece.reduction.op].vars[0]
            local = [values[buffers.get(n, n)] for n in piece.reduction.inputs]
            values[part.name] = paddle.sum(paddle.stack(local)) if local else paddle.full(list(part.shape), 0.0,
                                                                                         part.dtype)
            handed.append(part.name)
        if piece.zero:
            for grad, buffer in buffers.items():
                if buffer not in values:
                    values[buffer] = _persistable_data(view.var(grad), buffer)
                paddle._C_ops.full_(values[buffer], list(values[buffer].shape), 0.0, values[buffer].dtype,
                                    core.Place())
    setattr(program, FEEDS, tuple(feeds))
    _hand_over(program, handed, stage)
    return Run(program, tuple(handed))


def init_section(view: PirView, stage: int, merge: dict[str, str]) -> Section:
    """Zero the stage's gradient buffers (after startup, and after a failed step)."""
    program = paddle.static.Program()
    values = {}
    with paddle.static.program_guard(program):
        for grad in merge:
            var = view.var(grad)
            zero = paddle.full(list(var.shape), 0.0, var.dtype)
            zero.persistable = True
            paddle._C_ops.set_persistable_value(zero, grad + MERGED_SUFFIX)
            values[grad + MERGED_SUFFIX] = zero
    setattr(program, VALUES, values)
    setattr(program, FEEDS, ())
    return Section(stage, INIT, program, runs=(Run(program),))
