"""Paddle's legacy-IR ``minimize`` with its two per-parameter scans made single passes, and its backward
shown only the part of the no-gradient set each op can use.

Why: ``paddle.base.backward.append_backward`` ends by finding, for each parameter, the op that last
writes its gradient -- a backwards walk over the whole block per parameter -- and
``Optimizer._update_param_device_map`` finds, for each parameter, the first op that reads it -- a forward
walk per parameter. Both cost parameters x ops: on models' GPT of 96 layers (10k ops after minimize) they
are half of Paddle's minimize (4.8 s -> 2.5 s without them), and at 384 layers they dominate it. A
pipelined job runs ``minimize`` on every rank, on the largest programs.

``linear_scans()`` swaps in versions that make one pass over the ops each and hand Paddle back exactly
what its own code computes: the same ``(parameter, gradient)`` list in the same order, the same
``op_role_var`` attributes on the same ops, the same device map (the tests compare the serialized
programs). Everything else stays Paddle's own: the backward is built by Paddle's ``append_backward``, asked
for no parameter list so that its tail has nothing to scan. Calls the fast tail does not cover (a
control-flow block, a second backward, recompute checkpoints, a distributed context, a parameter list
Paddle would reject, a gradient name already taken, which Paddle's backward renames around) go to
Paddle's function unchanged.

The third swap: Paddle's backward hands ``core.get_grad_op_desc`` the block's whole no-gradient set for
every op it differentiates, and the binding copies that set into C++ on each call: ops x set, the set
growing with the model (0.12 ms per op at 96 layers, 0.3 ms at 192). An op's gradient maker reads the set
only for the gradients of its own arguments, so ``_grad_op_desc`` passes the members named after them;
an op with a sub-block gets the whole set. The binding is swapped on Paddle's ``core`` module itself, so
every caller meanwhile (control flow, recompute passes) gets the same trimmed call, with the same
results. The swaps last while a ``with`` block holds them.
"""
from __future__ import annotations

from typing import Any

from ._paddle import core, framework, paddle
from .process_switch import ProcessSwitch


def _names(parameter_list: Any) -> list[str] | None:
    """The parameter names ``append_backward`` would read from ``parameter_list``; None when Paddle's own
    checks would reject it (Paddle's function then runs, and raises its own error)."""
    if not isinstance(parameter_list, (list, tuple, set)):
        return None
    if not all(isinstance(p, (framework.Variable, str)) for p in parameter_list):
        return None
    return [p if isinstance(p, str) else p.name for p in parameter_list]


def _append_backward(loss: Any, parameter_list: Any = None, no_grad_set: Any = None, callbacks: Any = None,
                     checkpoints: Any = None, distop_context: Any = None) -> Any:
    """``append_backward`` with its parameter-gradient tail in one backwards pass over the ops."""
    real = paddle.base.backward.append_backward  # Paddle's own: only the optimizer module's name is swapped
    program = loss.block.program
    block = program.global_block()
    names = ([p.name for p in block.all_parameters() if p.trainable] if parameter_list is None
             else _names(parameter_list))
    suffix = core.grad_var_suffix()
    if (checkpoints or distop_context is not None or program.current_block_idx != 0
            or program._appending_grad_times != 0 or names is None
            or any(block.has_var(n + suffix) for n in names)):  # a name taken: Paddle renames the gradient
        return real(loss, parameter_list, no_grad_set, callbacks, checkpoints, distop_context)
    real(loss, [], no_grad_set, callbacks)
    # In block 0 Paddle pairs a parameter with its gradient exactly when the backward made one (named
    # parameter + @GRAD; partial sums are renamed and summed into it).
    pairs = [(block.var(n), block.var(n + suffix)) for n in names if block.has_var(n + suffix)]
    writer: dict[str, Any] = {}
    wanted = {grad.name for _, grad in pairs}
    for op in reversed(block.ops):
        for out in op.output_arg_names:
            if out in wanted and out not in writer:
                writer[out] = op
    role_var = core.op_proto_and_checker_maker.kOpRoleVarAttrName()
    for param, grad in pairs:
        grad.op = writer.get(grad.name)
        if grad.op is None:
            raise ValueError("Unexpected branch")  # Paddle's own words for a gradient no op writes
        value = [param.name, grad.name]
        if grad.op.has_attr(role_var):
            value.extend(grad.op.attr(role_var))
        grad.op._set_attr(role_var, value)
    return pairs


def _update_param_device_map(self: Any, parameters_and_grads: Any, target_block: Any) -> None:
    """``Optimizer._update_param_device_map`` in one pass: each trainable parameter's device is that of the
    first op reading it."""
    wanted = {pg[0].name for pg in parameters_and_grads if pg[0].stop_gradient is False}
    device_attr = core.op_proto_and_checker_maker.kOpDeviceAttrName()
    for op in target_block.ops:
        if not wanted:
            return
        for name in op.input_arg_names:
            if name in wanted:
                wanted.discard(name)
                self._param_device_map[name] = op.attr(device_attr)


_SUFFIX = core.grad_var_suffix()


def _grad_op_desc(real: Any) -> Any:
    """``core.get_grad_op_desc`` given, for an op without sub-blocks, only the no-gradient names of its own
    arguments' gradients: the only members its gradient maker looks up."""
    def grad_op_desc(op_desc: Any, no_grad_set: set, grad_sub_blocks: list) -> Any:
        if grad_sub_blocks or op_desc.has_attr("sub_block"):
            return real(op_desc, no_grad_set, grad_sub_blocks)
        own = {n + _SUFFIX for n in op_desc.input_arg_names() + op_desc.output_arg_names()}
        return real(op_desc, own.intersection(no_grad_set), grad_sub_blocks)
    return grad_op_desc


def _swap_in() -> tuple:
    module = paddle.optimizer.optimizer  # the module whose Optimizer.backward calls append_backward
    backward_core = paddle.base.backward.core  # the module through which Paddle's backward calls the binding
    saved = (module, module.append_backward, module.Optimizer.__dict__["_update_param_device_map"],
             backward_core, backward_core.get_grad_op_desc)
    module.append_backward = _append_backward
    module.Optimizer._update_param_device_map = _update_param_device_map
    backward_core.get_grad_op_desc = _grad_op_desc(backward_core.get_grad_op_desc)
    return saved


def _swap_out(saved: tuple) -> None:
    module, append_backward, device_map, backward_core, grad_op_desc = saved
    module.append_backward = append_backward
    module.Optimizer._update_param_device_map = device_map
    backward_core.get_grad_op_desc = grad_op_desc


linear_scans = ProcessSwitch(_swap_in, _swap_out).held
"""Paddle's ``append_backward`` (as its optimizers call it), ``_update_param_device_map`` and the binding its
backward asks for gradient ops swapped for the versions above while a ``with linear_scans():`` block runs
(process-wide: a minimize on another thread meanwhile takes them too, and gets Paddle's results all the
same)."""
