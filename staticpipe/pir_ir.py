"""Paddle 3's PIR programs seen through the small interface staticpipe's analysis passes read.

Why: the passes that decide where ops run and what crosses a stage boundary (``rewrite/stages.py``,
``rewrite/optimize.py``, the section analysis of ``rewrite/sections.py``) read a program as a list of
ops, each with a type, named inputs and outputs, a role and a device, over named variables with a shape,
a dtype and a persistence. The legacy IR is that already. A PIR program is a graph of SSA values without
names, whose ops carry no device, and whose backward ops are not tied to their forward op. ``PirView``
presents a PIR program in exactly those terms, so those passes run unchanged on both IRs, and only the
building of section programs (``rewrite/pir_programs.py``) and the running of them
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

from ._paddle import OP_DEVICE, OP_ROLE, ROLE_BACKWARD, ROLE_OPTIMIZE, core, paddle

FREE_OPS = ("builtin.parameter", "pd_op.data", "pd_op.full", "pd_op.full_int_array", "builtin.constant")
_HOOK = "_complete_grad_op_chunk_id"  # where ir_backward completes backward ops' attributes
SPLIT_POINTS = "_staticpipe_split_points"  # as placement.SPLIT_POINTS, which reads this one
VALUES = "_staticpipe_values"  # section program attribute: name -> value of that program
FEEDS = "_staticpipe_feeds"  # section program attribute: names of its non-persistable data ops (fed each run)
HANDED_OVER = "_staticpipe_handed_over"  # section program attribute: values it writes into the device's scope


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
    """What ``ir_backward`` knew while it differentiated: backward op -> its forward op's device is already
    copied; ``of``: gradient value -> the forward value it is the gradient of."""

    of: Any = None  # paddle.autograd.backward_utils.ValueDict
    params_grads: list = field(default_factory=list)


def differentiate(inner: Any, loss: Any, startup: Any, parameters: Any, no_grad_set: Any) -> tuple[Any, Gradients]:
    """``inner.minimize(loss, ...)`` on a PIR program with backward ops tagged role 1 and update ops role 2,
    every backward op carrying its forward op's device. Returns (what ``minimize`` returns, gradients)."""
    from paddle.autograd import ir_backward
    from paddle.autograd.backward_utils import ValueDict
    from paddle.base.framework import pir_op_role_guard

    original = getattr(ir_backward, _HOOK, None)
    if original is None:
        raise RuntimeError(f"staticpipe's PIR path reads backward ops from paddle.autograd.ir_backward.{_HOOK}, which "
                           f"paddle {paddle.__version__} does not have")
    grads = Gradients(of=ValueDict())

    def complete(block: Any, state: Any) -> Any:
        for fwd, bwd_ops in state.op_to_opgrad.items():
            if fwd.has_attr(OP_DEVICE):
                for op in bwd_ops:
                    if not op.has_attr(OP_DEVICE):
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
    with pir_op_role_guard(ROLE_OPTIMIZE):
        optimize_ops = inner._apply_optimize(loss, startup_program=startup, params_grads=params_grads)
    grads.params_grads = list(params_grads)
    return (optimize_ops, params_grads), grads


@dataclass(frozen=True, eq=False)
class PirVar:
    """A named value, in the terms of a legacy variable."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    persistable: bool
    is_data: bool = False
    value: Any = None  # the PIR value in the viewed program
    type: Any = core.VarDesc.VarType.LOD_TENSOR  # or SELECTED_ROWS, as a legacy variable's
    constant: bool = False  # made by an operand-free op such as pd_op.full: "persistable" to the passes only


class PirOp:
    """One PIR operation in the terms of a legacy op: ``type`` (without the dialect), argument names,
    ``op_role`` (legacy bits) and ``op_device`` attributes, slots by Paddle's input and output names."""

    def __init__(self, op: Any, index: int, inputs: list[str | None], outputs: list[str]):
        self.op, self.index = op, index
        self.type = op.name().split(".", 1)[-1]
        self._inputs, self._outputs = inputs, outputs
        self.input_arg_names = [n for n in inputs if n is not None]
        self.output_arg_names = [n for n in outputs if n is not None]
        role = op.op_role
        self._role = ROLE_OPTIMIZE if role == ROLE_OPTIMIZE else ROLE_BACKWARD if role == ROLE_BACKWARD else 0

    def has_attr(self, name: str) -> bool:
        if name == "sub_block":
            return self.op.num_regions() > 0
        return name == OP_ROLE or self.op.has_attr(name)

    def attr(self, name: str) -> Any:
        if name == OP_ROLE:
            return self._role
        return self.op.str_attr(name) if name == OP_DEVICE else self.op.attrs()[name]

    @property
    def input_names(self) -> list[str]:
        return list(self.op.get_input_names())

    def input(self, slot: str) -> list[str]:
        return [n for s, n in zip(self.op.get_input_names(), self._inputs) if s == slot and n is not None]

    def output(self, slot: str) -> list[str]:
        return [n for s, n in zip(self.op.get_output_names(), self._outputs) if s == slot and n is not None]

    def __repr__(self) -> str:
        return f"{self.op.name()}({', '.join(self.input_arg_names)}) -> {', '.join(self.output_arg_names)}"


class PirView:
    """A differentiated PIR program as the analysis passes read it: ``global_block()`` is the view itself,
    with ``ops`` (``PirOp``), ``all_parameters()``, ``var(name)``; ``free_ops``: name -> the op that makes a
    stage-free value; ``names``: value -> name (for the user's values: the loss, a fetch list)."""

    def __init__(self, program: Any, grads: Gradients, loss: Any):
        from paddle.autograd.backward_utils import ValueDict

        self.program = program
        self.names = ValueDict()
        self.vars: dict[str, PirVar] = {}
        self.free_ops: dict[str, Any] = {}
        self.ops: list[PirOp] = []
        self.grad_of: dict[str, str] = {}  # gradient name -> forward value name
        counted: dict[Any, int] = {}  # op -> how many of the view's ops come before it or are it
        for position, op in enumerate(program.global_block().ops):
            free = op.name() in FREE_OPS and op.num_operands() == 0
            counted[op] = len(self.ops) + (0 if free else 1)
            outputs = [self._name(v, op, position, k, grads) if v.initialized() else None
                       for k, v in enumerate(op.results())]  # an absent optional output: None
            if free:
                self.free_ops[outputs[0]] = op
                continue
            inputs = [self.names[v] if v.initialized() else None for v in op.operands_source()]
            self.ops.append(PirOp(op, len(self.ops), inputs, outputs))
        self.param_grads = {p.name: self.names[g] for p, g in grads.params_grads}
        self._params = [self.vars[p.name] for p in program.global_block().all_parameters()]
        self.loss = self.name_of(loss)
        # placement.split_point's anchors (the op before each point) as the legacy IR's op indices
        setattr(self, SPLIT_POINTS, {0 if a is None else counted[a] for a in getattr(program, SPLIT_POINTS, [])})

    def _name(self, value: Any, op: Any, index: int, k: int, grads: Gradients) -> str:
        kind = op.name()
        if kind in ("builtin.parameter", "pd_op.data"):
            name = value.name
        elif grads.of is not None and value in grads.of and grads.of[value] in self.names:
            base = self.names[grads.of[value]]
            name = base + "@GRAD"
            self.grad_of[name] = base
        else:
            name = f"{kind.split('.', 1)[-1]}_{index}.tmp_{k}"
        if name in self.vars:  # a second gradient of one value (never seen), or a clash: stay unique
            name = f"{name}@{index}.{k}"
        constant = kind in FREE_OPS and op.num_operands() == 0 and kind not in ("pd_op.data", "builtin.parameter")
        persistable = kind == "builtin.parameter" or bool(value.persistable) or constant
        is_data = kind == "pd_op.data" and not value.persistable
        if value.is_dense_tensor_type() or value.is_selected_row_type():
            var_type = (core.VarDesc.VarType.SELECTED_ROWS if value.is_selected_row_type()
                        else core.VarDesc.VarType.LOD_TENSOR)
            shape, dtype = tuple(int(d) for d in value.shape), value.dtype
        else:  # a vector of tensors (builtin.combine) or another non-tensor type: it cannot cross stages
            var_type, shape, dtype = None, (), None
        self.vars[name] = PirVar(name, shape, dtype, persistable, is_data, value, var_type, constant)
        self.names[value] = name
        return name

    # --- the legacy Program / Block interface the passes read ----------------------------------------
    def global_block(self) -> "PirView":
        return self

    def all_parameters(self) -> list[PirVar]:
        return list(self._params)

    def var(self, name: str) -> PirVar:
        found = self.vars.get(name)
        if found is None:
            raise ValueError(f"variable '{name}' is not in the program")
        return found

    _var_recursive = var

    def list_vars(self) -> list[PirVar]:
        """Every named value but the constants (a legacy program's variables)."""
        return [v for v in self.vars.values() if not v.constant]

    def name_of(self, value: Any) -> str:
        """The name of one of the program's values (``ValueError`` for a value of another program)."""
        if isinstance(value, str):
            return value
        if value in self.names:
            return self.names[value]
        raise ValueError("the value is not one of this program's values (a value of another program, or one "
                         "added after minimize)")


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


NAMES = "_staticpipe_value_names"  # main program attribute: the rewrite's value -> name (``PirView.name_of``)
VIEW = "_staticpipe_view"  # main program attribute: the ``PirView`` its plan was built from


def value_name(program: Any, value: Any, what: str) -> str:
    """The rewrite's name of ``value``, a value of the pipelined PIR ``program``; ``ValueError`` naming
    ``what`` for a value of another program or of a program that was not pipelined."""
    name_of = getattr(program, NAMES, None)
    if name_of is None:
        raise ValueError(f"{what} is a PIR value, but the program it is fetched from was not pipelined by "
                         "staticpipe.PipelineOptimizer.minimize; fetch it by name")
    try:
        return name_of(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
