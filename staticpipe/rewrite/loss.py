"""How the loss reduces the batch: a mean (the pipeline averages its micro-batches) or a sum (it adds them).

Why it matters: a pipeline runs the loss once per micro-batch. For a batch mean, the mean of the M
micro-batch losses is the batch's loss, so each micro-batch's gradient seed is scaled by 1/M. For a batch
sum (``paddle.sum(ce)``, ``cross_entropy(..., reduction="sum")``), the sum of the micro-batch losses is
the batch's, so the seed stays 1 (and data-parallel replicas add theirs: the seed carries ``dp_degree``
against the replicas' mean). Averaging a sum trained at 1/M of the gradient.

The loss is read back from its op through the ops that keep the kind of reduction: scaling, casts,
copies, adding or subtracting terms of one kind, multiplying or dividing by a value that does not
depend on the batch; a term that does not depend on the batch at all (a regulariser of parameters)
goes with a mean (each micro-batch adds it once, the mean keeps it once) but not with a sum (it would
be added M times). The op that reduces the batch decides: ``mean`` / ``reduce_mean`` over the batch
dimension a mean, ``reduce_sum`` (PIR ``sum``) a sum. Anything else (a max, a square of a mean, ...)
is neither, and refused with what to do. ``loss_reduction="mean"`` (Paddle's pipeline, ``staticpipe.fleet``)
averages the micro-batches whatever the loss.

Fetched values read the same way (``value_reductions``): a metric without the batch as dim 0 is a mean,
a sum, or -- through casts and copies only -- a max or min over the batch, which the runtime combines
over micro-batches (and replicas) to the whole batch's value; anything else is handed out per
micro-batch, as Paddle's pipeline hands out every fetched value.
"""
from __future__ import annotations

from typing import Any, Callable

from .stages import FWD, StageAssignment

MEAN, SUM, CONSTANT = "mean", "sum", "constant"
MAX, MIN, EACH = "max", "min", "each"  # fetched values only: a batch max/min, or none of these (per micro-batch)
_KEEP = {"scale", "cast", "assign"}
_ADD = {"elementwise_add", "elementwise_sub", "add", "subtract"}
_MUL = {"elementwise_mul", "multiply"}
_DIV = {"elementwise_div", "divide"}
_MEANS = {"mean", "reduce_mean", "mean_all"}  # mean_all: PIR's mean of every element
_SUMS = {"reduce_sum"}  # and PIR's "sum" (legacy "sum" is add_n: terms)
_EXTREMES = {"reduce_max": MAX, "max": MAX, "reduce_min": MIN, "min": MIN}  # legacy and PIR names


class NotAReduction(ValueError):
    """The loss is neither a batch mean nor a batch sum."""


def loss_reduction(block: Any, assignment: StageAssignment, loss: str) -> str:
    """``MEAN`` or ``SUM`` for ``loss`` of ``block`` (legacy block or ``PirView``); ``NotAReduction``
    naming the op that makes it neither."""
    producer, depends = _forward_graph(block, assignment)
    return SUM if _kind(loss, producer, depends) == SUM else MEAN


def value_reductions(block: Any, assignment: StageAssignment, batched: Callable[[str], bool]) -> dict[str, str]:
    """How each forward value that depends on the batch without having it as its first dimension (a loss,
    a metric) is one value for the whole batch, from its micro-batches' values: ``MEAN``, ``SUM``, ``MAX``,
    ``MIN``, or ``EACH`` (none of these: handed out per micro-batch, as Paddle's pipeline hands out every
    fetched value). The same reading as the loss's, a max or min kept only through casts and copies."""
    producer, depends = _forward_graph(block, assignment)
    out = {}
    for name in sorted(depends):
        if name in producer and not batched(name):
            try:
                out[name] = _kind(name, producer, depends, extremes=True)
            except NotAReduction:
                out[name] = EACH
    return out


def _forward_graph(block: Any, assignment: StageAssignment) -> tuple[dict[str, Any], set[str]]:
    """(value -> the forward op that writes it, the values that depend on a data feed)."""
    producer: dict[str, Any] = {}
    depends: set[str] = set()
    written = {n for i, op in enumerate(block.ops) if assignment.role[i] == FWD for n in op.output_arg_names}
    for i, op in enumerate(block.ops):
        if assignment.role[i] != FWD:
            continue
        fed = [n for n in op.input_arg_names if n not in written and _is_feed(block, n)]
        if fed or depends.intersection(op.input_arg_names):
            depends.update(op.output_arg_names)
        for name in op.output_arg_names:
            producer[name] = op
    return producer, depends


def _is_feed(block: Any, name: str) -> bool:
    var = block._find_var_recursive(name) if hasattr(block, "_find_var_recursive") else block._var_recursive(name)
    return var is not None and not var.persistable and not getattr(var, "constant", False)


def _kind(name: str, producer: dict[str, Any], depends: set[str], extremes: bool = False) -> str:
    """The reduction ``name`` is; ``extremes``: a max or min over the batch counts too (fetched values)."""
    if name not in depends:
        return CONSTANT
    op = producer[name]
    t = op.type
    if extremes and t in _EXTREMES and _over_batch(op):
        return _EXTREMES[t]
    if extremes and t == "accuracy":  # the fraction right (a mean), and the counts right and in all (sums)
        fraction = op.output("Accuracy") or op.output("accuracy")  # the legacy slot's name, PIR's
        return MEAN if name in fraction else SUM
    if t in _KEEP:
        kind = _kind(op.input_arg_names[0], producer, depends, extremes)
        if kind in (MAX, MIN) and t == "scale":  # a negative factor turns a max into a min: neither, here
            raise NotAReduction(_why(op, "it scales a batch max or min"))
        return kind
    if t in _ADD or _adds_terms(op):
        kinds = {_kind(n, producer, depends, extremes) for n in op.input_arg_names}
        terms = kinds - {CONSTANT}
        if len(terms) == 1 and not (terms == {SUM} and CONSTANT in kinds) and not terms & {MAX, MIN}:
            return terms.pop()
        raise NotAReduction(_why(op, f"it adds terms of kinds {sorted(kinds)} (a batch mean, a batch sum, a "
                                     "value that does not depend on the batch)"))
    if t in _MUL | _DIV:
        kinds = [_kind(n, producer, depends, extremes) for n in op.input_arg_names[:2]]
        if kinds.count(CONSTANT) == 1 and (t in _MUL or kinds[1] == CONSTANT) and not set(kinds) & {MAX, MIN}:
            return next(k for k in kinds if k != CONSTANT)
        raise NotAReduction(_why(op, "both of its operands depend on the batch"))
    if t in _MEANS or t in _SUMS or t == "sum":  # "sum" here: PIR's reduce sum (add_n went above)
        if not _over_batch(op):
            raise NotAReduction(_why(op, "it reduces other dimensions than the batch's"))
        return MEAN if t in _MEANS else SUM
    raise NotAReduction(_why(op, "it is not a mean or a sum over the batch"))


def _adds_terms(op: Any) -> bool:
    """Whether a "sum" op adds its inputs (legacy ``sum`` is add_n; on PIR, a ``PirOp`` with an op of its
    own, only the fused combine + add_n does, ``sum`` being the reduction)."""
    return op.type == "sum" and (not hasattr(op, "op") or bool(getattr(op, "_sum_inputs", 0)))


def _over_batch(op: Any) -> bool:
    """Whether a reduce op reduces dimension 0 (all of them, or a list holding 0)."""
    if op.type == "mean" and not hasattr(op, "op"):
        return True  # the legacy "mean" op reduces everything
    if op.has_attr("reduce_all") and op.attr("reduce_all"):
        return True
    for name in ("dim", "axis"):
        if op.has_attr(name):
            axes = op.attr(name)
            axes = list(axes) if isinstance(axes, (list, tuple)) else [axes]
            return not axes or 0 in axes
    return True  # an axis given as an operand (PIR's sum): taken as all


def _why(op: Any, reason: str) -> str:
    return (f"the loss is neither a batch mean nor a batch sum: op '{op.type}' ({', '.join(op.input_arg_names)} -> "
            f"{', '.join(op.output_arg_names)}) makes it so, {reason}. A pipeline runs the loss per micro-batch and "
            "must know how to put the micro-batches together: make the loss a mean (paddle.mean) or a sum "
            "(paddle.sum) over the batch of per-sample terms, or pass loss_reduction='mean' to average the "
            "micro-batches' gradients whatever the loss (Paddle's pipeline does)")
