"""The action IR: what one stage does, step by step, for one training step.

A schedule is plain data: ``{stage: [Action, ...]}``. Compute actions are F (forward of a micro-batch),
B (backward) and OPT (the once-per-step optimizer update). Lowering adds SEND and RECV actions that move
a route's cut variables between stages. The runtime executes any valid list; it knows no schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    F = "F"
    B = "B"
    OPT = "OPT"
    SEND = "SEND"
    RECV = "RECV"


COMPUTE_KINDS = (Kind.F, Kind.B)


@dataclass(frozen=True)
class Action:
    """One step of one stage.

    For SEND/RECV, ``route`` is the plan's route index, ``peer`` the other stage and ``channel`` what
    travels ("F" activations, "B" gradients, "FB" forward values to a backward section).
    """

    kind: Kind
    stage: int
    microbatch: int | None = None
    route: int | None = None
    peer: int | None = None
    channel: str = ""

    def __str__(self) -> str:
        if self.kind is Kind.OPT:
            return f"{self.stage}OPT"
        if self.kind is Kind.SEND:
            return f"{self.stage}SEND_{self.channel}{self.microbatch}>{self.peer}"
        if self.kind is Kind.RECV:
            return f"{self.stage}RECV_{self.channel}{self.microbatch}<{self.peer}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"


def F(stage: int, mb: int) -> Action:
    return Action(Kind.F, stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action(Kind.B, stage, mb)


def OPT(stage: int) -> Action:
    return Action(Kind.OPT, stage)


Schedule = dict[int, list[Action]]


def format_schedule(schedule: Schedule) -> str:
    """One line per stage: ``stage 0: 0F0 0F1 0B0 ...``."""
    return "\n".join(f"stage {s}: {' '.join(map(str, acts))}" for s, acts in sorted(schedule.items()))
