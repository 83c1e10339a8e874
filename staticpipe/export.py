"""Inference export: the stages merged back into one program that plain Paddle loads and runs.

The main program of a pipeline is still the whole single-device program (the plan sits beside it), so
exporting is Paddle's own ``save_inference_model`` on it, pruned to the requested outputs, with the
trained values gathered from every stage and the device tags removed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ._paddle import framework, paddle
from .ir import clear_device_tags, fetch_target, free_scope, is_pir_program

if TYPE_CHECKING:
    from .executor import Executor


def export_inference(program: framework.Program, feed_vars: Sequence, fetch_vars: Sequence, path: str,
                     exe: "Executor") -> None:
    """Write ``path.pdmodel`` / ``path.pdiparams`` (``paddle.static.load_inference_model`` format)."""
    scope = paddle.static.Scope()
    try:
        _save(program, feed_vars, fetch_vars, path, exe.state_dict(program), scope)
    finally:  # a scope is Paddle's until freed (``ir.free_scope``), and this one holds the whole model
        free_scope(scope)


def _save(program: framework.Program, feed_vars: Sequence, fetch_vars: Sequence, path: str, state: dict,
          scope: Any) -> None:
    for name, value in state.items():
        scope.var(name).get_tensor().set(value, paddle.CPUPlace())
    if is_pir_program(program):  # Paddle's PIR saver sets is_test itself, and serializes no op_device
        mapping = paddle.pir.IrMapping()
        inference = clear_device_tags(program.clone(mapping))
        feeds, fetches = ([mapping.look_up(fetch_target(program, v) if isinstance(v, str) else v) for v in values]
                          for values in (feed_vars, fetch_vars))
    else:
        inference = clear_device_tags(program.clone(for_test=True))
        block = inference.global_block()
        feeds = [block.var(v if isinstance(v, str) else v.name) for v in feed_vars]
        fetches = [block.var(v if isinstance(v, str) else v.name) for v in fetch_vars]
    with paddle.static.scope_guard(scope):
        paddle.static.save_inference_model(path, feeds, fetches, paddle.static.Executor(paddle.CPUPlace()),
                                           program=inference)
