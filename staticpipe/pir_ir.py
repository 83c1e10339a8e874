"""Paddle 3's PIR programs seen through the small interface staticpipe's analysis passes read.

Why: the passes that decide where ops run and what crosses a stage boundary (``rewrite/stages.py``,
``rewrite/optimize.py``, the section analysis of ``rewrite/sections.py``) read a program as a list of
ops, each with a type, named inputs and outputs, a role and a device, over named variables with a shape,
a dtype and a persistence. The legacy IR is that already. A PIR program is a graph of SSA values without
names, whose ops carry no device, and whose backward ops are not tied to their forward op.
``pir_view.PirView`` presents a PIR program in exactly those terms, so those passes run unchanged on both
IRs, and only the building of section programs (``rewrite/pir_programs.py``) and the running of them
(``runtime/pir_runs.py``) know PIR.

How a PIR program gets what the legacy IR records by itself:

- devices: ``tag_new_ops`` writes ``op_device`` (a string attribute, which survives cloning) on the ops
  a ``staticpipe.device_guard`` block created; Paddle's own guard records nothing on PIR ops;
- roles: ``differentiate`` runs the optimizer's backward under ``pir_op_role_guard(1)`` and its update
  under ``pir_op_role_guard(2)``, as Paddle's auto-parallel passes do;
- backward devices: Paddle's ``ir_backward`` knows which backward ops each forward op produced
  (``state.op_to_opgrad``) and which value is the gradient of which (``state.value_to_valuegrad``) while
  it builds them; ``differentiate`` reads both at the point where Paddle itself completes backward
  attributes, copies each forward op's device to its gradient ops (as the legacy ``append_backward``
  does) and names each gradient ``<value>@GRAD``;
- names: a parameter or data value has its own name; every other value is named after its op and
  position (``relu_12.tmp_0``), gradients after their value;
- stage-free ops: ops without operands that make a parameter, a data value or a constant
  (``FREE_OPS``) are left out of the op list; each section that reads one holds its own copy, as a
  legacy section declares the variable. To the passes a constant is like a persistable: nothing to feed
  or send.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from ._paddle import OP_DEVICE, ROLE_BACKWARD, ROLE_LRSCHED, ROLE_OPTIMIZE, paddle

FREE_OPS = ("builtin.parameter", "pd_op.data", "pd_op.full", "pd_op.full_int_array", "builtin.constant")
_HOOK = "_complete_grad_op_chunk_id"  # where ir_backward completes backward ops' attributes
SPLIT_POINTS = "_staticpipe_split_points"  # as placement.SPLIT_POINTS, which reads this one
VALUES = "_staticpipe_values"  # section program attribute: name -> value of that program
FEEDS = "_staticpipe_feeds"  # section program attribute: names of its non-persistable data ops (fed each run)
HANDED_OVER = "_staticpipe_handed_over"  # section program attribute: value -> its name in the device's scope


def is_pir_program(program: Any) -> bool:
    """Whether ``program`` is a PIR program (Paddle 3's default IR) rather than a legacy one."""
    pir = getattr(paddle, "pir", None)
    return pir is not None and hasattr(pir, "Program") and isinstance(program, pir.Program)


def is_pir_value(value: Any) -> bool:
    pir = getattr(paddle, "pir", None)
    return pir is not None and hasattr(pir, "Value") and isinstance(value, pir.Value)


def is_pir_data(value: Any) -> bool:
    """Whether ``value`` is a PIR value made by ``paddle.static.data`` (a feed variable)."""
    if not is_pir_value(value):
        return False
    op = value.get_defining_op()
    return op is not None and op.name() == "pd_op.data" and not value.persistable


def pir_mode() -> bool:
    """Whether Paddle builds PIR programs now (Paddle 3 by default, or inside ``paddle.pir_utils.IrGuard``)."""
    in_pir = getattr(paddle.framework, "in_pir_mode", None)
    return bool(in_pir and in_pir())


def tag_new_ops(block: Any, before: set, device: str) -> None:
    """Write ``device`` on every op of ``block`` not in ``before`` that has no device yet (an inner
    guard tagged its ops first; the innermost guard wins, as with Paddle's legacy ``device_guard``)."""
    for op in block.ops:
        if op not in before and not op.has_attr(OP_DEVICE):
            op.set_str_attr(OP_DEVICE, device)


@dataclass
class Gradients:
    """What ``ir_backward`` knew while it differentiated (each backward op's device is already copied from
    its forward op): ``of``: gradient value -> the forward value it is the gradient of."""

    of: Any = None  # paddle.autograd.backward_utils.ValueDict
    forward_of: dict = field(default_factory=dict)  # backward op -> the forward op it differentiates


def differentiate(inner: Any, loss: Any, startup: Any, parameters: Any, no_grad_set: Any) -> tuple[Any, Gradients]:
    """``inner.minimize(loss, ...)`` on a PIR program with backward ops tagged role 1 and update ops role 2,
    every backward op carrying its forward op's device. Returns (what ``minimize`` returns, gradients)."""
    from paddle.autograd import ir_backward
    from paddle.autograd.backward_utils import ValueDict, ValueSet
    from paddle.base.framework import pir_op_role_guard

    original = getattr(ir_backward, _HOOK, None)
    if original is None:
        raise RuntimeError(f"staticpipe's PIR path reads backward ops from paddle.autograd.ir_backward.{_HOOK}, which "
                           f"paddle {paddle.__version__} does not have")
    grads = Gradients(of=ValueDict())

    def complete(block: Any, state: Any) -> Any:
        for fwd, bwd_ops in state.op_to_opgrad.items():
            for op in bwd_ops:
                grads.forward_of[op] = fwd
                if fwd.has_attr(OP_DEVICE) and not op.has_attr(OP_DEVICE):
                    op.set_str_attr(OP_DEVICE, fwd.str_attr(OP_DEVICE))
        for value, grad_lists in state.value_to_valuegrad.items():
            for grad_list in grad_lists:
                for g in grad_list:
                    if g is not None and g.initialized() and g not in grads.of:
                        grads.of[g] = value
        return original(block, state)

    setattr(ir_backward, _HOOK, complete)
    try:
        with pir_op_role_guard(ROLE_BACKWARD):
            params_grads = inner.backward(loss, startup_program=startup, parameters=parameters,
                                          no_grad_set=no_grad_set)
    finally:
        setattr(ir_backward, _HOOK, original)
    # only values the program still holds: ir_backward erases ops it made and then pruned, and a value made
    # later (by the update ops) may reuse a freed value's address, which is what a ValueDict keys by
    live = ValueSet([value for op in loss.block.ops for value in op.results()])
    grads.of = ValueDict({g: v for g, v in grads.of.items() if g in live and v in live})
    ops = set(loss.block.ops)
    grads.forward_of = {b: f for b, f in grads.forward_of.items() if b in ops and f in ops}
    with pir_op_role_guard(ROLE_OPTIMIZE):
        optimize_ops = inner._apply_optimize(loss, startup_program=startup, params_grads=params_grads)
    return (optimize_ops, params_grads), grads


# what a PIR section runs under (``runtime/pir_runs.py`` says why), and a profile times its ops under too
SERIAL_RUN = "FLAGS_new_executor_serial_run"
TRACE_RUN = "FLAGS_enable_pir_in_executor_trace_run"
EAGER_DELETION = "FLAGS_eager_delete_tensor_gb"  # read when an interpreter first runs: its garbage collector


@contextlib.contextmanager
def flags_set(flags: dict[str, Any]) -> Iterator[None]:
    """Paddle's ``flags`` set while inside, restored after (the process's: Paddle's flags are global)."""
    before = paddle.get_flags(list(flags))
    paddle.set_flags(flags)
    try:
        yield
    finally:
        paddle.set_flags(before)


@contextlib.contextmanager
def pir_thread() -> Iterator[None]:
    """PIR mode for this thread while inside. Whether Paddle's executor takes the PIR path is thread-local
    state (``global_var._use_pir_api_``), which a new thread sets from the ``FLAGS_enable_pir_api``
    environment variable, not from the thread that built the program (``paddle.pir_utils.IrGuard`` changes
    only its own thread), so whatever runs a PIR program sets it."""
    mode = paddle.base.framework.global_var
    outside, mode._use_pir_api_ = mode._use_pir_api_, True
    try:
        yield
    finally:
        mode._use_pir_api_ = outside


@contextlib.contextmanager
def guarded(block: Any, device: str) -> Iterator[None]:
    """Tag the ops created inside with ``device`` (``tag_new_ops``)."""
    before = set(block.ops)
    yield
    tag_new_ops(block, before, device)


def section_values(program: Any) -> dict[str, Any]:
    """name -> value of a PIR section program built by the rewrite (empty for any other program)."""
    return getattr(program, VALUES, {})


VIEW = "_staticpipe_view"  # program attribute: the ``pir_view.PirView`` its plan was built from


def value_name(program: Any, value: Any, what: str) -> str:
    """The rewrite's name of ``value``, a value of the pipelined PIR ``program``; ``ValueError`` naming
    ``what`` for a value of another program or of a program that was not pipelined."""
    view = getattr(program, VIEW, None)
    if view is None:
        raise ValueError(f"{what} is a PIR value, but the program it is fetched from was not pipelined by "
                         "staticpipe.PipelineOptimizer.minimize; fetch it by name")
    try:
        return view.name_of(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def test_mode_forward(program: Any) -> Any:
    """A clone of the differentiated PIR ``program`` with its forward ops only, each ``is_test`` attribute set
    (dropout passes values through, batch norm reads its running statistics and leaves them): what
    ``clone(for_test=True)`` gives a legacy program, which PIR programs lack. Device tags and split points
    come along; the values keep their places in the program, and so the names a view gives them."""
    mapping = paddle.pir.IrMapping()
    twin = program.clone(mapping)
    for op in reversed(list(twin.global_block().ops)):
        if op.op_role in (ROLE_BACKWARD, ROLE_OPTIMIZE, ROLE_LRSCHED) and op.name() not in FREE_OPS:
            op.erase()  # an optimizer's parameters and data stay (unread): every op keeps its index, and name
        elif op.has_attr("is_test"):
            op.set_bool_attr("is_test", True)
    anchors = getattr(program, SPLIT_POINTS, None)
    if anchors is not None:
        setattr(twin, SPLIT_POINTS, [None if a is None else mapping.look_up(a.result(0)).get_defining_op()
                                     for a in anchors])
    return twin

