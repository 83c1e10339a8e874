"""Section programs of a PIR program: the PIR half of what ``programs.py`` and ``optimize_section.py`` do.

A section is a clone of the differentiated program with every op it does not run erased (in reverse
order, so no erased op still has a user). A value it reads from another section becomes a ``pd_op.data``
of the value's name, which the runtime feeds from the micro-batch's scope (``runtime/pir_runs.py``); the
values it produces for later sections are fetched by name (the section program's ``VALUES`` attribute
maps names to its values). Stage-free ops (parameters, persistable state, constants: ``pir_ir.FREE_OPS``)
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

What a per-micro-batch section leaves for later sections (its ``keep``) is written into the device's
scope under its name (``HANDED_OVER``), from where the runtime moves each value's buffer to the
micro-batch's scope after the run: no fetch, no copy (a fetched value aliases the executor's fetch
buffer and must be copied; 60 -> 45 µs a run for a small forward section).
"""
from __future__ import annotations

from typing import Any

from .._paddle import core, paddle
from ..pir_ir import FEEDS, HANDED_OVER, VALUES, PirView
from ..plan import BACKWARD, INIT, OPTIMIZE, Route, Run, Section
from .programs import MERGED_SUFFIX
from .stages import op_label


def check_supported(partials: list, held: frozenset, recompute: frozenset, split_backward: bool) -> None:
    """Refuse, naming it, what the PIR builders do not build yet (README: "PIR programs")."""
    missing = [what for what, used in (
        ("shared parameters (read on several stages)", partials), ("AMP", held), ("recompute", recompute),
        ("schedules that split the backward (ZB-H1, ZB-V)", split_backward)) if used]
    if missing:
        raise ValueError(f"staticpipe does not pipeline PIR programs with {', '.join(missing)} yet; build the "
                         "program in legacy-IR mode for it (STATICPIPE_LEGACY_IR=1, see README)")


def cut_program(view: PirView, ops: list[int], persistent: dict[str, str] | None = None) -> Any:
    """A clone of ``view.program`` running only ``view.ops[i]`` for ``i`` in ``ops`` (in program order).

    Values those ops read that they do not produce become data ops of their names; ``persistent`` maps
    some of those names to a persistable variable of the stage's scope read instead (a gradient's
    ``@MERGED`` buffer)."""
    from paddle import pir

    persistent = persistent or {}
    original = list(view.program.global_block().ops)
    kept = {view.ops[i].op for i in ops}
    produced = {n for i in ops for n in view.ops[i].output_arg_names}
    inputs: list[str] = []
    for i in sorted(ops):
        for name in view.ops[i].input_arg_names:
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
            data = paddle._pir_ops.data(persistent.get(name, name), list(var.shape), var.dtype, core.Place())
            if name in persistent:
                data.persistable = True
            mapping.look_up(var.value).replace_all_uses_with(data)
            values[persistent.get(name, name)] = data
    clones = list(block.ops)[len(inputs):]
    for op, clone in zip(reversed(original), reversed(clones)):
        if op not in kept:
            clone.erase()
    for name, var in view.vars.items():
        if var.value.get_defining_op() in kept and name not in values:
            values[name] = mapping.look_up(var.value)
    if hasattr(program, "lr_scheduler"):  # the runtime sets the learning rate itself, in the stage's scope
        del program.lr_scheduler
    setattr(program, VALUES, values)
    setattr(program, FEEDS, tuple(n for n, v in values.items() if _is_fed(v)))
    return program


def _is_fed(value: Any) -> bool:
    op = value.get_defining_op()
    return op is not None and op.name() == "pd_op.data" and not value.persistable


def per_microbatch_section(view: PirView, sec: Any, routes: list[Route], merge: dict[str, str],
                           num_microbatches: int) -> Section:
    """The forward or backward section ``sec`` (``sections.SectionOps``; see the module docstring)."""
    ref, ops = sec.ref, sec.ops
    program = cut_program(view, ops)
    values = getattr(program, VALUES)
    if ref.kind == BACKWARD:
        with paddle.static.program_guard(program):
            loss_grad = view.loss + "@GRAD"
            if loss_grad in values and num_microbatches > 1:
                _scale_after(values[loss_grad], 1.0 / num_microbatches)
            for grad in merge:
                if grad in values:
                    g = values[grad]
                    paddle.pir.set_insertion_point_to_block_end(program.global_block())
                    paddle._C_ops.add_(_persistable_data(g, grad + MERGED_SUFFIX), g)
                    g.persistable = True  # its buffer stays in the stage's scope, reused by every micro-batch
                    paddle._C_ops.set_persistable_value(g, grad)
    keep = tuple(sorted(sec.keep))
    fed = set(getattr(program, FEEDS))
    made = [n for n in keep if n in values and n not in fed and not values[n].persistable]
    with paddle.static.program_guard(program):
        paddle.pir.set_insertion_point_to_block_end(program.global_block())
        for name in made:  # written into the device's scope under its name: pir_runs moves it to the micro-batch's
            values[name].persistable = True
            paddle._C_ops.set_persistable_value(values[name], name)
    setattr(program, HANDED_OVER, tuple(made))
    return Section(ref.stage, ref.kind, program, feeds=tuple(sec.feeds), keep=keep,
                   recv_routes=tuple(r.index for r in routes if r.dst == ref),
                   send_routes=tuple(r.index for r in routes if r.src == ref), source_ops=tuple(ops),
                   runs=(Run(program, keep),))


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
    data = paddle._pir_ops.data(name, list(like.shape), like.dtype, core.Place())
    data.persistable = True
    return data


def optimize_section(view: PirView, stage: int, ops: list, merge: dict[str, str]) -> Section:
    """Stage ``stage``'s once-per-step ops, reading the accumulated gradients, then zeroing them."""
    plain = []
    for item in ops:
        if not isinstance(item, int):
            raise ValueError(f"stage {stage}: {type(item).__name__} of {op_label(item.op, view.ops[item.op])} needs "
                             "an exchange between the stages' optimize sections, which staticpipe does not build "
                             "for PIR programs yet (global-norm clipping, AMP loss scaling)")
        plain.append(item)
    program = cut_program(view, plain, persistent={g: g + MERGED_SUFFIX for g in merge})
    values = getattr(program, VALUES)
    with paddle.static.program_guard(program):
        paddle.pir.set_insertion_point_to_block_end(program.global_block())
        for grad in merge:
            buffer = values.get(grad + MERGED_SUFFIX)
            if buffer is not None:
                paddle._C_ops.full_(buffer, list(buffer.shape), 0.0, buffer.dtype, core.Place())
    return Section(stage, OPTIMIZE, program, source_ops=tuple(plain), runs=(Run(program),))


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
