"""The records a plan is made of, below its sections: where a section sits in a micro-batch's path
(``SectionRef``), the variables that travel between stages (``CutVar``), the per-micro-batch messages
(``Route``) and the once-per-step ones (``Exchange``). Plain frozen data: they are saved with a plan and
read back by ``load_plan`` without Paddle.
"""
from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT, OPTIMIZE, INIT = "forward", "backward", "weight", "optimize", "init"
# Order of a micro-batch's sections through the pipeline: F0 < F1 < ... < B1 < B0, then the weight
# gradients W (only for schedules that split the backward).
PER_MICROBATCH = (FORWARD, BACKWARD, WEIGHT)
FORWARD_ONLY = "forward-only"  # the schedule name of evaluation plans
COMM_OP_TYPES = ("send_v2", "recv_v2")  # point-to-point ops at the ends of per-micro-batch sections
# comm ops the optimize section may hold: Paddle 2.x's all-reduce, and Paddle 3.x's (which has no other)
COLLECTIVE_OP_TYPES = COMM_OP_TYPES + ("c_allreduce_sum", "all_reduce")


@dataclass(frozen=True)
class SectionRef:
    """Names a per-micro-batch section: ``stage`` and ``kind`` (forward or backward)."""

    stage: int
    kind: str

    def order(self, num_stages: int) -> int:
        """Position of this section in one micro-batch's path through the pipeline."""
        if self.kind == FORWARD:
            return self.stage
        if self.kind == BACKWARD:
            return 2 * num_stages - 1 - self.stage
        return 3 * num_stages - 1 - self.stage

    def __str__(self) -> str:
        return f"stage {self.stage} {self.kind}"


@dataclass(frozen=True)
class CutVar:
    """A variable produced in one section and read in another stage's section.

    ``shape`` is the compiled shape with -1 standing for the micro-batch dimension (dim 0) until the
    micro-batch size is known; ``dtype`` is a numpy dtype name ("uint16" for bfloat16, as in Paddle, whose
    tensors take and give bfloat16 values as uint16 arrays).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    batched: bool  # dim 0 is the batch dimension

    def shape_for(self, micro_batch_size: int | None) -> tuple[int, ...]:
        if self.batched and micro_batch_size is not None:
            return (micro_batch_size,) + self.shape[1:]
        return self.shape

    def describe(self, micro_batch_size: int | None = None) -> str:
        dims = [("mb" if (i == 0 and self.batched and micro_batch_size is None) else str(d))
                for i, d in enumerate(self.shape_for(micro_batch_size))]
        return f"{self.name} [{', '.join(dims)}] {'bfloat16' if self.dtype == 'uint16' else self.dtype}"


@dataclass(frozen=True)
class Route:
    """All cut variables going from one section to another for each micro-batch: one message."""

    index: int
    src: SectionRef
    dst: SectionRef
    vars: tuple[CutVar, ...]

    @property
    def channel(self) -> str:
        """Short tag of what travels: "F" activations, "B" gradients, "FB" forward values to a backward."""
        if self.src.kind == self.dst.kind:
            return "F" if self.src.kind == FORWARD else "B"
        return "FB"


SEND, SUM = "send", "sum"


@dataclass(frozen=True)
class Exchange:
    """A once-per-step message of the optimize sections, stated as data as a ``Route`` is per micro-batch.

    ``SEND``: stage ``src`` sends ``vars`` (its names) to stage ``dst``, which stores them as ``recv_as``.
    ``SUM``: every stage gives its part ``vars[0]`` and stores the sum over all stages as ``recv_as[0]``
    (a rank adds its own stages' parts in stage order, then the ranks' sums are added in rank order, so
    every stage holds the same bits). ``why`` says what it is for.
    """

    index: int
    kind: str
    vars: tuple[CutVar, ...]
    recv_as: tuple[str, ...]
    why: str
    src: int = -1
    dst: int = -1

    def __str__(self) -> str:
        if self.kind == SUM:
            return f"every stage: {self.vars[0].describe()} summed into {self.recv_as[0]} ({self.why})"
        names = ", ".join(v.describe() + ("" if v.name == r else f" as {r}") for v, r in zip(self.vars, self.recv_as))
        return f"stage {self.src} -> stage {self.dst}: {names} ({self.why})"
