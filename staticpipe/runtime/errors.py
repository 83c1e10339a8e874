"""How a failure in one stage stops the whole pipeline: the error it raises, and what the others see."""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterable, Iterator

import numpy as np


class StageError(RuntimeError):
    """A stage failed; names the stage, its device and the action. ``__cause__`` is the original error."""

    def __init__(self, stage: int, device: str, action: object, error: BaseException, note: str = ""):
        self.stage, self.device, self.action = stage, device, action
        super().__init__(f"stage {stage} ({device}) failed in action {action}: "
                         f"{type(error).__name__}: {error}{f' ({note})' if note else ''}")


class PipelineAborted(RuntimeError):
    """Raised in a worker blocked on a channel when another stage failed."""


PASSING_THROUGH = (PipelineAborted, StageError, KeyboardInterrupt, SystemExit)  # what failing_as lets by


@contextlib.contextmanager
def failing_as(stage: int, device: str, action: object, note: str = "") -> Iterator[None]:
    """Raise what fails inside as this stage's ``StageError`` (the original as its cause). What already
    says where it came from (a ``StageError``, another stage's ``PipelineAborted``) and an interrupt or
    exit pass through as they are."""
    try:
        yield
    except PASSING_THROUGH:
        raise
    except BaseException as exc:
        raise StageError(stage, device, action, exc, note) from exc


class FoundNonFinite(RuntimeError):
    """A value staticpipe checked itself holds a NaN or Inf (``check_finite`` on a loss-scaled program)."""

    def __init__(self, op: str, variable: str, nans: int, infs: int):
        super().__init__(f"op '{op}' wrote {nans} NaN and {infs} Inf into '{variable}'")
        self.op, self.variable, self.nans, self.infs = op, variable, nans, infs


def check_finite_values(program: Any, scope: Any, names: Iterable[str]) -> None:
    """Raise ``FoundNonFinite`` for the first of ``names`` (values a section run left in ``scope``) that
    holds a NaN or Inf, naming the op of ``program`` that wrote it.

    Why staticpipe checks these itself: Paddle's per-op check (``FLAGS_check_nan_inf``) is one flag for
    the whole process, and under dynamic loss scaling the backward's overflows are expected -- the scaler
    finds them, skips the step and lowers the scale -- while stages run forwards and backwards at once. So
    on a loss-scaled program the forward's outputs (what it sends, keeps, and the loss) are checked after
    each forward, and the backward is left to the scaler."""
    for name in names:
        var = scope.find_var(name)
        if var is None or not var.get_tensor()._is_initialized():
            continue
        value = np.asarray(var.get_tensor())
        if value.dtype.kind != "f" or np.isfinite(value).all():
            continue
        writers = [op.type for op in program.global_block().ops if name in op.output_arg_names]
        raise FoundNonFinite(writers[-1] if writers else "?", name, int(np.isnan(value).sum()),
                             int(np.isinf(value).sum()))


class NonFiniteError(StageError):
    """``Executor(check_finite=True)`` found the first NaN or Inf: names the stage, its device, the action
    (and so the micro-batch), the op and the variable it wrote."""

    _PADDLE = re.compile(r"There are NAN or INF \(num_nan=(\d+), num_inf=(\d+)[^)]*\) in \[device=[^,]*, "
                         r"op=([^,]+), tensor=([^,\]]+)")

    def __init__(self, error: StageError, op: str, variable: str, nans: int, infs: int):
        RuntimeError.__init__(self, f"stage {error.stage} ({error.device}) failed in action {error.action}: the "
                                    f"first non-finite value: op '{op}' wrote {nans} NaN and {infs} Inf into "
                                    f"'{variable}'")
        self.stage, self.device, self.action = error.stage, error.device, error.action
        self.op, self.variable = op, variable

    @classmethod
    def of(cls, error: StageError) -> "NonFiniteError | None":
        """The ``NonFiniteError`` a stage error is, when Paddle's NaN/Inf check raised it; else None."""
        cause = error.__cause__
        if isinstance(cause, FoundNonFinite):
            return cls(error, cause.op, cause.variable, cause.nans, cause.infs)
        found = cls._PADDLE.search(str(cause or ""))
        if found is None:
            return None
        nans, infs, op, variable = found.groups()
        return cls(error, op, variable, int(nans), int(infs))


def non_finite_hint(labels: list[str], values: list) -> str | None:
    """What to say when a fetched float value holds a NaN or Inf (the first such, by its label), or None.
    Why a hint and not an error: with ``check_finite`` off (the default) a NaN that reached the loss trains
    on silently, and a fetched value is where a user sees it first."""
    for label, value in zip(labels, values):
        array = np.asarray(value) if value is not None and not isinstance(value, list) else None
        if array is not None and array.dtype.kind == "f" and not np.isfinite(array).all():
            return (f"{label} is not finite: a NaN or Inf reached it; staticpipe.Executor(check_finite=True) stops "
                    "at the first op that writes one, naming the stage, micro-batch, op and variable")
    return None
