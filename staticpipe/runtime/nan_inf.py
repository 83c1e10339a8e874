"""Paddle's NaN/Inf check in a pipeline: one process-wide flag shared by every executor, and loss scaling.

``Executor(check_finite=True)`` stops at the first op that writes a NaN or Inf through Paddle's own
per-op check (``FLAGS_check_nan_inf``). Two things about it are this module's: the flag is read by every
op of every executor in the process (``NAN_INF_GATE``), and under dynamic loss scaling the backward's
overflows are the scaler's to handle (``scales_loss``: the step then checks its forwards' outputs itself,
``errors.check_finite_values``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from .._paddle import paddle
from ..plan import OPTIMIZE, Plan

NAN_INF_FLAG = "FLAGS_check_nan_inf"


class _NanInfGate:
    """Paddle's NaN/Inf check is one process-wide flag, read by every op of every executor: a step of an
    executor that checks and a step of one that does not must not overlap, or the second fails with
    Paddle's raw "There are NAN or INF" at a random op (once mid-optimize, where stages may then disagree).
    Steps that want the same setting run together; a step that wants the other waits for them to end.
    The flag is put back as it was once the last of them ends (plain Paddle runs see the user's own)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: dict[bool, int] = {False: 0, True: 0}
        self._before: Any = None

    @contextlib.contextmanager
    def held(self, check: bool) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._running[not check] == 0)
            if self._running[check] == 0:
                self._before = paddle.get_flags(NAN_INF_FLAG)
                if self._before[NAN_INF_FLAG] != check:  # unchanged: no call into Paddle (two per step)
                    paddle.set_flags({NAN_INF_FLAG: check})
            self._running[check] += 1
        try:
            yield
        finally:
            with self._cond:
                self._running[check] -= 1
                if self._running[check] == 0 and self._before[NAN_INF_FLAG] != check:
                    paddle.set_flags(self._before)
                self._cond.notify_all()


NAN_INF_GATE = _NanInfGate()


def scales_loss(plan: Plan) -> bool:
    """Whether ``plan`` trains with dynamic loss scaling (AMP's ``update_loss_scaling`` in an optimize
    section; PIR programs have no AMP here)."""
    return any(op.type == "update_loss_scaling" for st in plan.stages if OPTIMIZE in st.sections
               for program in st.sections[OPTIMIZE].programs if hasattr(program, "desc")
               for op in program.global_block().ops)
