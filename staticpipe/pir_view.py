"""A differentiated PIR program in the terms staticpipe's analysis passes read (see ``pir_ir.py``).

``PirView`` is the legacy Program/Block/Operator interface those passes use, over a PIR program: ``ops``
(``PirOp``: a type, named inputs and outputs, role and device attributes, argument slots), named
variables (``PirVar``: shape, dtype, persistence), ``all_parameters()``. Values are named as
``pir_ir.py``'s docstring says; ops that make parameters, data or constants are left out of ``ops`` and
listed in ``free_ops``; a sum of values (``add_n`` or ``sum(stack(...))`` over a ``builtin.combine``) is
one "sum" op, as the legacy IR's, so that a cross-stage sum or a shared parameter's gradient is found by
the same rule on both IRs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._paddle import OP_DEVICE, OP_ROLE, ROLE_BACKWARD, ROLE_OPTIMIZE, core
from .pir_ir import FREE_OPS, SPLIT_POINTS, VIEW, Gradients


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

    def __init__(self, op: Any, index: int, inputs: list[str | None], outputs: list[str],
                 fused: tuple[Any, ...] = (), sum_inputs: int = 0):
        self.op, self.index = op, index
        self.ops = fused or (op,)  # the program's ops this op stands for
        self._sum_inputs = sum_inputs  # fused sum: its first inputs are the summed values (slot "X")
        self.type = "sum" if fused else op.name().split(".", 1)[-1]
        self._inputs, self._outputs = inputs, outputs
        self.forward: Any = None  # a backward op: the forward op it differentiates (the PIR program's)
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
        return ["X"] if self._sum_inputs else _slots(self.op, "get_input_names")

    def input(self, slot: str) -> list[str]:
        if self._sum_inputs:
            return self.input_arg_names[:self._sum_inputs] if slot == "X" else []
        return [n for s, n in zip(_slots(self.op, "get_input_names"), self._inputs) if s == slot and n is not None]

    def output(self, slot: str) -> list[str]:
        if self._sum_inputs:
            return self.output_arg_names if slot == "Out" else []
        return [n for s, n in zip(_slots(self.op, "get_output_names"), self._outputs) if s == slot and n is not None]

    def __repr__(self) -> str:
        return f"{self.op.name()}({', '.join(self.input_arg_names)}) -> {', '.join(self.output_arg_names)}"


def _slots(op: Any, which: str) -> list[str]:
    """Paddle's argument names of ``op`` (none for builtin ops such as ``builtin.combine``)."""
    try:
        return list(getattr(op, which)())
    except ValueError:
        return []


def _summed(op: Any) -> tuple[Any, ...] | None:
    """The ops before ``op`` that make it a sum of values, or None: ``add_n(combine(values))`` (how PIR's
    backward adds the gradients of a value read twice) gives (combine,); a ``pd_op.sum`` over all axes of
    ``stack(combine(values))`` (how PIR's ``ClipGradByGlobalNorm`` adds its squared norms) (combine, stack)."""
    if op.name() == "pd_op.add_n":
        combine = op.operand_source(0).get_defining_op()
        ok = combine is not None and combine.name() == "builtin.combine" and combine.result(0).has_one_use()
        return (combine,) if ok else None
    if op.name() != "pd_op.sum" or op.attrs().get("keepdim"):
        return None
    stack = op.operand_source(0).get_defining_op()
    if stack is None or stack.name() != "pd_op.stack" or not stack.result(0).has_one_use():
        return None
    combine = stack.operand_source(0).get_defining_op()
    if combine is None or combine.name() != "builtin.combine" or not combine.result(0).has_one_use():
        return None
    axis = op.operand_source(1).get_defining_op()
    if axis is None or axis.name() != "pd_op.full_int_array" or list(axis.attrs()["value"]):
        return None
    return combine, stack


class PirView:
    """A differentiated PIR program as the analysis passes read it: ``global_block()`` is the view itself,
    with ``ops`` (``PirOp``), ``all_parameters()``, ``var(name)``; ``free_ops``: name -> the op that makes a
    stage-free value; ``names``: value -> name (for the user's values: the loss, a fetch list)."""

    def __init__(self, program: Any, grads: Gradients, loss: Any):
        from paddle.autograd.backward_utils import ValueDict

        self.program = program
        self.gradients = grads  # what it was built from, for a saved plan to build it again (saved_pir.py)
        self.names = ValueDict()
        self.vars: dict[str, PirVar] = {}
        self.free_ops: dict[str, Any] = {}
        self.ops: list[PirOp] = []
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
            chain = _summed(op)
            if chain is not None and [o.op for o in self.ops[-len(chain):]] == list(chain):
                # one "sum" to the passes, as the legacy IR's sum op (placed, split and exchanged as that one)
                del self.ops[-len(chain):]  # the ops of the chain, just appended
                summed = [self.names[v] for v in chain[0].operands_source()]
                self.ops.append(PirOp(op, len(self.ops), summed + inputs[1:], outputs, (*chain, op), len(summed)))
                counted[op] = len(self.ops)
                continue
            self.ops.append(PirOp(op, len(self.ops), inputs, outputs))
            self.ops[-1].forward = grads.forward_of.get(op)
        self._params = [self.vars[p.name] for p in program.global_block().all_parameters()]
        self.loss = self.name_of(loss) if loss is not None else ""  # none: a forward-only (evaluation) program
        # placement.split_point's anchors (the op before each point) as the legacy IR's op indices
        setattr(self, SPLIT_POINTS, {0 if a is None else counted[a] for a in getattr(program, SPLIT_POINTS, [])})

    def _name(self, value: Any, op: Any, index: int, k: int, grads: Gradients) -> str:
        kind = op.name()
        if kind in ("builtin.parameter", "pd_op.data"):
            name = value.name
        elif grads.of is not None and value in grads.of and grads.of[value] in self.names:
            name = self.names[grads.of[value]] + "@GRAD"
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

    def keeps_whole(self, i: int) -> bool:
        """Whether backward op ``i`` stays whole in a split backward (its weight and activation gradients in
        one op in B): ``rewrite/pir_programs.py`` rebuilds a half by Paddle's vjp of the forward op, which
        needs the forward op (known for Paddle's own backward ops) with tensor operands and every result's
        gradient at hand."""
        fwd = self.ops[i].forward
        if fwd is None or self.ops[i].type.startswith("builtin"):
            return True
        tensors = all(v.initialized() and v.is_dense_tensor_type() for v in fwd.operands_source())
        return not tensors or any(f"{self.names[r]}@GRAD" not in self.vars for r in fwd.results())

    def attach(self) -> "PirView":
        """Keep this view on its program (``pir_ir.VIEW``), where fetch lists and the user-facing layers read
        the program through it (``ir.program_view``, ``pir_ir.value_name``)."""
        setattr(self.program, VIEW, self)
        return self

    def name_of(self, value: Any) -> str:
        """The name of one of the program's values (``ValueError`` for a value of another program)."""
        if isinstance(value, str):
            return value
        if value in self.names:
            return self.names[value]
        raise ValueError("the value is not one of this program's values (a value of another program, or one "
                         "added after minimize)")
