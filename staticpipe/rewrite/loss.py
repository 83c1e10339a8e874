"""How the loss reduces the batch: a mean (the pipeline averages its micro-batches) or a sum (it adds them).

Why it matters: a pipeline runs the loss once per micro-batch. For a batch mean, the mean of the M
micro-batch losses is the batch's loss, so each micro-batch's gradient seed is scaled by 1/M. For a batch
sum (``paddle.sum(ce)``, ``cross_entropy(..., reduction="sum")``), the sum of the micro-batch losses is
the batch's, so the seed stays 1 (and data-parallel replicas add theirs: the seed carries ``dp_degree``
against the replicas' mean). Averaging a sum trained at 1/M of the gradient.

Why a data flow and not the last op: ``paddle.sum(paddle.mean(ce, axis=0))`` ends in a sum but is a
batch mean, and ``paddle.mean(paddle.sum(ce))`` ends in a mean but is a batch sum. So one sweep over the
forward ops gives every value a *status*: ``Batched(axis)`` (per-sample values, the micro-batches
concatenated along ``axis``, ``None`` where a reshape lost track of it), ``MEAN`` / ``SUM`` / ``MAX`` /
``MIN`` (one value of the whole batch, put together from its micro-batches' values that way),
``CONSTANT`` (no batch in it), ``SIZE`` (computed from the shapes of per-sample values: a micro-batch's
size, not the batch's; fixed beside per-sample values, refused beside a whole-batch one, where
``sum(ce) / shape(ce)[0]`` would be a mean on one device and M times it in a pipeline), or ``Neither``
(the op that made it none of these, and why). A mean or sum
whose axes hold the batch's makes a ``MEAN`` or ``SUM``; one over other axes keeps the value per-sample
(the batch axis moved past the reduced ones); a mean or sum of a ``MEAN`` or ``SUM`` keeps its kind (both
are linear over the other axes). Scaling, casts, copies, layout changes, adding or subtracting terms of
one kind, multiplying or dividing by a value that does not depend on the batch keep the kind; a term that
does not depend on the batch (a regulariser of parameters) goes with a mean (each micro-batch adds it
once, the mean keeps it once) but not with a sum (it would be added M times); per-sample values mixed
with a whole-batch value, a product of two batch values, any other op of one (a max, a square of a
mean, ...) are neither, and refused with what to do. ``loss_reduction="mean"`` (Paddle's pipeline,
``staticpipe.fleet``) averages the micro-batches whatever the loss.

Fetched values read the same way (``value_reductions``): a metric without the batch as dim 0 is a mean,
a sum, or -- through casts, copies and further extremes of its kind -- a max or min over the batch, which
the runtime combines over micro-batches (and replicas) to the whole batch's value; anything else is
handed out per micro-batch, as Paddle's pipeline hands out every fetched value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from .stages import FWD, StageAssignment

MEAN, SUM, CONSTANT = "mean", "sum", "constant"
MAX, MIN, EACH = "max", "min", "each"  # fetched values only: a batch max/min, or none of these (per micro-batch)
SIZE = "size"  # computed from the shape of the batch's values: one micro-batch's, not the batch's
_WHOLE = {MEAN, SUM, MAX, MIN}
_SIZES = {"shape", "shape64", "numel", "size"}
_LAYOUT = {"cast", "assign", "share_data", "reshape", "reshape2", "squeeze", "squeeze2", "unsqueeze", "unsqueeze2",
           "flatten", "flatten2", "flatten_contiguous_range", "transpose", "transpose2"}  # values moved, not changed
_TRANSPOSES = {"transpose", "transpose2"}
_RESHAPES = {"reshape", "reshape2", "flatten", "flatten2", "flatten_contiguous_range"}
_ADD = {"elementwise_add", "elementwise_sub", "add", "subtract"}
_MUL = {"elementwise_mul", "multiply"}
_DIV = {"elementwise_div", "divide"}
_MEANS = {"mean", "reduce_mean", "mean_all"}  # mean_all: PIR's mean of every element
_SUMS = {"reduce_sum"}  # and PIR's "sum" (legacy "sum" is add_n: terms)
_EXTREMES = {"reduce_max": MAX, "max": MAX, "reduce_min": MIN, "min": MIN}  # legacy and PIR names
_ALL, _COMPUTED = None, "computed"  # the axes of a reduction: every one; not known before running


@dataclass(frozen=True, eq=False)  # compared with the kinds' strings by identity: a sweep makes thousands
class Batched:
    """Per-sample values: the micro-batches' values concatenated along ``axis`` (None: not known)."""

    axis: int | None


@dataclass(frozen=True, eq=False)
class Neither:
    """A value of the batch that is none of a mean, a sum, an extreme or per-sample values: ``op`` made it so,
    for ``reason``."""

    op: Any
    reason: str


Status = Union[str, Batched, Neither]


class NotAReduction(ValueError):
    """The loss is neither a batch mean nor a batch sum."""


def loss_reduction(block: Any, assignment: StageAssignment, loss: str) -> str:
    """``MEAN`` or ``SUM`` for ``loss`` of ``block`` (legacy block or ``PirView``); ``NotAReduction``
    naming the op that makes it neither."""
    status, producer, extreme_of = _statuses(block, assignment)
    kind = status.get(loss, CONSTANT)
    if isinstance(kind, Neither):  # named where it began, and where it reaches the loss if elsewhere
        raise NotAReduction(_why(kind.op, kind.reason, producer[loss]))
    if isinstance(kind, Batched):
        raise NotAReduction(_why(producer[loss], "the loss still holds one value per sample (reduce it over the "
                                                 "batch)"))  # (Paddle's backward refuses most such losses first)
    if kind in (MAX, MIN):
        raise NotAReduction(_why(extreme_of[loss], f"it takes the batch's {kind}imum"))
    return SUM if kind == SUM else MEAN


def value_reductions(block: Any, assignment: StageAssignment, batched: Callable[[str], bool]) -> dict[str, str]:
    """How each forward value that depends on the batch without having it as its first dimension (a loss,
    a metric) is one value for the whole batch, from its micro-batches' values: ``MEAN``, ``SUM``, ``MAX``,
    ``MIN``, or ``EACH`` (none of these, a size among them: handed out per micro-batch, as Paddle's pipeline
    hands out every fetched value)."""
    status, producer, _ = _statuses(block, assignment)
    return {name: kind if kind in _WHOLE else EACH for name, kind in sorted(status.items())
            if kind != CONSTANT and name in producer and not batched(name)}


def _statuses(block: Any, assignment: StageAssignment) -> tuple[dict[str, Status], dict[str, Any], dict[str, Any]]:
    """One sweep over the forward ops, in program order: (value -> its status, for every value that depends
    on a data feed; value -> the forward op that writes it; max/min value -> the op that took the extreme)."""
    ops = [op for i, op in enumerate(block.ops) if assignment.role[i] == FWD]
    written = {n for op in ops for n in op.output_arg_names}
    status: dict[str, Status] = {}
    producer: dict[str, Any] = {}
    extreme_of: dict[str, Any] = {}
    graph = _Graph(block)

    def of(name: str) -> Status:
        if name in status:
            return status[name]
        return Batched(0) if name not in written and graph.is_feed(name) else CONSTANT

    for op in ops:
        ins = {n: of(n) for n in op.input_arg_names}
        for name in op.output_arg_names:
            producer[name] = op
            status.pop(name, None)  # written again (in place): what this op makes
        if all(s == CONSTANT for s in ins.values()):
            continue
        for name, kind in _through(op, ins, graph).items():
            if graph.persistable(name):  # state the forward updates (batch norm's running mean): not a value
                continue
            status[name] = kind
            if kind in (MAX, MIN):
                extreme_of[name] = op if op.type in _EXTREMES else extreme_of[_operands(op)[0]]
    return status, producer, extreme_of


def _through(op: Any, by_name: dict[str, Status], graph: _Graph) -> dict[str, Status]:
    """The status of each output of ``op`` whose inputs have statuses ``by_name``, not all constant."""
    outs = op.output_arg_names
    t = op.type
    first, *_ = operands = _operands(op)
    ins = [by_name[n] for n in operands] + [s for n, s in by_name.items() if n not in operands]
    whole = [s for s in ins if s in _WHOLE]
    if any(isinstance(s, Neither) for s in ins):
        return dict.fromkeys(outs, next(s for s in ins if isinstance(s, Neither)))
    if t in _SIZES:  # the shape of per-sample values is a micro-batch's; of a whole-batch value, fixed
        return dict.fromkeys(outs, SIZE if any(isinstance(s, Batched) or s == SIZE for s in ins) else CONSTANT)
    if SIZE in ins:
        if all(s in (SIZE, CONSTANT) for s in ins):
            return dict.fromkeys(outs, SIZE)
        if whole and (by_name[first] == SIZE or (t not in _LAYOUT and not _reduces(op))):
            return dict.fromkeys(outs, Neither(op, "it combines a value of the whole batch with one computed "
                                                        "from the shape of the batch's values, which is a micro-"
                                                        "batch's in a pipeline: use a constant"))
        by_name = {n: CONSTANT if s == SIZE else s for n, s in by_name.items()}  # a size beside values: fixed
        ins = [CONSTANT if s == SIZE else s for s in ins]
    if t == "accuracy" and not whole:  # the fraction right (a mean), and the counts right and in all (sums)
        fraction = set(op.output("Accuracy") or op.output("accuracy"))  # the legacy slot's name, PIR's
        return {n: MEAN if n in fraction else SUM for n in outs}
    if _reduces(op):
        return dict.fromkeys(outs, _reduced(op, by_name[first], graph))
    if t in _LAYOUT:
        x = by_name[first]  # the values moved; other inputs (a shape) change none
        return {n: Batched(_moved(op, x.axis, first, n, graph)) for n in outs} if isinstance(x, Batched) else \
            dict.fromkeys(outs, x)
    if t == "scale":
        return dict.fromkeys(outs, _scaled(op, operands, ins, graph))
    if t in _ADD or _adds_terms(op):
        return dict.fromkeys(outs, _added(op, by_name, graph))
    if t in _MUL | _DIV:
        return dict.fromkeys(outs, _multiplied(op, operands[:2], ins[:2], t in _DIV, graph))
    if whole:
        return dict.fromkeys(outs, Neither(op, "it is not a mean or a sum over the batch"))
    source = next(n for n, s in by_name.items() if isinstance(s, Batched))
    return {n: _per_sample(op, by_name[source].axis, source, n, graph) for n in outs}


def _reduced(op: Any, x: Status, graph: _Graph) -> Status:
    """A mean, sum, max or min of ``x`` over the axes ``op`` reduces."""
    kind = MEAN if op.type in _MEANS else _EXTREMES.get(op.type, SUM)
    if not isinstance(x, Batched):  # already one value of the whole batch
        if x == kind or (x in (MEAN, SUM) and kind in (MEAN, SUM)):
            return x  # linear over the other axes: a sum of means is a mean
        return Neither(op, f"it takes the {kind} of a batch {x}")
    axes, rank = _axes(op, graph), len(graph.shape(_operands(op)[0]) or ())
    if axes is _COMPUTED:
        return Neither(op, "its axes are computed when the program runs, so whether it reduces the batch "
                                "is not known")
    reduced = set(range(rank)) if axes is _ALL else {a % rank if rank else a for a in axes}
    if reduced >= set(range(rank)) or (x.axis is not None and x.axis in reduced):
        return kind
    if x.axis is None:
        return Neither(op, "it reduces some dimensions of a value whose batch dimension is not known (a "
                                "reshape moved it)")
    keep = any(op.has_attr(k) and op.attr(k) for k in ("keep_dim", "keepdim"))
    return Batched(x.axis if keep else x.axis - sum(a < x.axis for a in reduced))


def _scaled(op: Any, names: list[str], ins: list[Status], graph: _Graph) -> Status:
    """``scale``: a product with a factor (PIR: an operand) plus a bias."""
    if any(s != CONSTANT for s in ins[1:]):  # a factor that depends on the batch: a product
        return _multiplied(op, names[:2], ins[:2], False, graph)
    x = ins[0]
    if x in (MAX, MIN):  # a negative factor turns a max into a min: neither, here
        return Neither(op, "it scales a batch max or min")
    if x == SUM and op.has_attr("bias") and op.attr("bias"):
        return Neither(op, "it adds a constant to a batch sum, which the micro-batches' sums would add once "
                                "each")
    return x


def _added(op: Any, by_name: dict[str, Status], graph: _Graph) -> Status:
    """A sum or difference of terms."""
    per_sample = [n for n, s in by_name.items() if isinstance(s, Batched)]
    if per_sample and any(s in _WHOLE for s in by_name.values()):
        return Neither(op, "it adds per-sample values to a value of the whole batch")
    if per_sample:  # the widest term's batch axis (the others broadcast against it)
        widest = max(per_sample, key=lambda n: len(graph.shape(n) or ()))
        return _per_sample(op, by_name[widest].axis, widest, op.output_arg_names[0], graph)
    kinds = set(by_name.values())
    terms = kinds - {CONSTANT}
    if len(terms) == 1 and not (terms == {SUM} and CONSTANT in kinds) and not terms & {MAX, MIN}:
        return terms.pop()
    return Neither(op, f"it adds terms of kinds {sorted(kinds)} (a batch mean, a batch sum, a value that does "
                            "not depend on the batch)")


def _multiplied(op: Any, names: list[str], pair: list[Status], divides: bool, graph: _Graph) -> Status:
    """A product or quotient of two operands."""
    a, b = pair
    if isinstance(a, Batched) or isinstance(b, Batched):
        if a in _WHOLE or b in _WHOLE:
            return Neither(op, "it multiplies per-sample values by a value of the whole batch")
        k = 0 if isinstance(a, Batched) else 1
        return _per_sample(op, pair[k].axis, names[k], op.output_arg_names[0], graph)
    if CONSTANT in pair and (not divides or b == CONSTANT) and not {a, b} & {MAX, MIN}:
        return a if b == CONSTANT else b
    if CONSTANT in pair:
        return Neither(op, "it divides by a value of the batch" if divides else "it scales a batch max or min")
    return Neither(op, "both of its operands depend on the batch")


def _per_sample(op: Any, axis: int | None, source: str, out: str, graph: _Graph) -> Status:
    """An op's output computed per sample from ``source`` (batch ``axis``): where its batch axis went, or
    ``Neither`` where the batch's dimension is gone with no mean or sum (``shape``, ``numel``, ...)."""
    before, after = graph.shape(source), graph.shape(out)
    if axis is not None and before is not None and after is not None and len(before) > axis and before[axis] == -1 \
            and -1 not in after:
        return Neither(op, "it takes the batch's dimension away without a mean or a sum")
    return Batched(_moved(op, axis, source, out, graph))


def _moved(op: Any, axis: int | None, source: str, out: str, graph: _Graph) -> int | None:
    """Where batch ``axis`` of ``source`` stands in ``out``, or None (not known). A transpose permutes it; a
    reshape keeps it only as the leading dimension (merged with the next ones or split, a leading batch is
    still the micro-batches' concatenation); another op keeps it where it keeps the rank and the batch's
    dimension, or finds it as the one dynamic dimension of ``out`` (a squeeze, an embedding, an argmax); a
    vector of tensors has its tensors' batch axis."""
    if axis is None:
        return None
    before, after = graph.shape(source), graph.shape(out)
    if op.type in _TRANSPOSES:
        perm = [int(a) for a in op.attr("axis" if op.has_attr("axis") else "perm")]
        return perm.index(axis) if axis in perm else None
    if before is None or after is None:  # a vector of tensors (PIR's combine, split): its tensors' batch axis
        return axis
    if len(before) <= axis:
        return None
    dynamic = [k for k, d in enumerate(after) if d == -1]
    if op.type in _RESHAPES:
        return 0 if axis == 0 and before[0] == -1 and after[:1] == (-1,) else None
    if len(before) == len(after) and (before[axis] != -1 or after[axis] == -1):
        return axis
    return dynamic[0] if before[axis] == -1 and len(dynamic) == 1 else None


def _axes(op: Any, graph: _Graph) -> Any:
    """The axes a reduce op reduces: ``_ALL``, a list, or ``_COMPUTED`` (a PIR axis operand made at run time)."""
    if op.type == "mean_all" or (op.type == "mean" and not hasattr(op, "op")):
        return _ALL  # the legacy "mean" op reduces everything
    if op.has_attr("reduce_all") and op.attr("reduce_all"):
        return _ALL
    for name in ("dim", "axis"):
        if op.has_attr(name):
            axes = op.attr(name)
            axes = list(axes) if isinstance(axes, (list, tuple)) else [axes]
            return [int(a) for a in axes] or _ALL
    if len(op.input_arg_names) > 1:  # PIR: the axes are an operand, made by a constant op or at run time
        made = graph.free_ops.get(op.input_arg_names[1])
        if made is None or made.name() != "pd_op.full_int_array":
            return _COMPUTED
        return [int(a) for a in made.attrs()["value"]] or _ALL
    return _ALL


def _operands(op: Any) -> list[str]:
    """The op's inputs, its data operands first (legacy slots X, Y; PIR's x, y), as the analysis reads them."""
    slots = op.input_names
    named = [n for slot in ("X", "Y", "x", "y") if slot in slots for n in op.input(slot)]
    return named + [n for n in op.input_arg_names if n not in named]


class _Graph:
    """The block the sweep reads, each variable looked up and each shape read once (a legacy variable's
    lookup and shape are calls into Paddle: the sweep spent most of its time there on thousands of ops)."""

    def __init__(self, block: Any):
        self.block, self._vars, self._shapes = block, {}, {}
        self.free_ops = getattr(block, "free_ops", {})  # PIR: a constant's name -> the op that makes it
        self._find = getattr(block, "_find_var_recursive", None) or block.vars.get

    def var(self, name: str) -> Any:
        if name not in self._vars:
            self._vars[name] = self._find(name)
        return self._vars[name]

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self._shapes:
            var = self.var(name)
            shape = None if var is None or getattr(var, "type", True) is None else var.shape  # None: PIR's vectors
            self._shapes[name] = None if shape is None else tuple(int(d) for d in shape)
        return self._shapes[name]

    def persistable(self, name: str) -> bool:
        var = self.var(name)
        return var is not None and var.persistable

    def is_feed(self, name: str) -> bool:
        var = self.var(name)
        return var is not None and not var.persistable and not getattr(var, "constant", False)


def _reduces(op: Any) -> bool:
    t = op.type
    return t in _MEANS or t in _SUMS or t in _EXTREMES or (t == "sum" and not _adds_terms(op))


def _adds_terms(op: Any) -> bool:
    """Whether a "sum" op adds its inputs (legacy ``sum`` is add_n; on PIR, a ``PirOp`` with an op of its
    own, only the fused combine + add_n does, ``sum`` being the reduction)."""
    return op.type == "sum" and (not hasattr(op, "op") or bool(getattr(op, "_sum_inputs", 0)))


def _why(op: Any, reason: str, last: Any = None) -> str:
    via = "" if last is None or last is op else (f" (the loss, made by op '{last.type}' -> "
                                                 f"{', '.join(last.output_arg_names)}, depends on it)")
    return (f"the loss is neither a batch mean nor a batch sum: op '{op.type}' ({', '.join(op.input_arg_names)} -> "
            f"{', '.join(op.output_arg_names)}) makes it so, {reason}{via}. A pipeline runs the loss per micro-batch "
            "and must know how to put the micro-batches together: make the loss a mean (paddle.mean) or a sum "
            "(paddle.sum) over the batch of per-sample terms, or pass loss_reduction='mean' to average the "
            "micro-batches' gradients whatever the loss (Paddle's pipeline does; that is how it trains a ratio such "
            "as cross_entropy's mean with weight or ignore_index)")
