"""The Plan: what the rewrite decided, in data the runtime and the user can read.

A plan names the stages (a device each), the sections of every stage (forward, backward, optimize and
init programs with explicit send/recv ops), the cut variables that travel between sections with their
compiled shapes and dtypes, and the schedule's action lists. Nothing here executes anything; the
runtime only follows it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._paddle import paddle

FORWARD, BACKWARD, WEIGHT, OPTIMIZE, INIT = "forward", "backward", "weight", "optimize", "init"
# Order of a micro-batch's sections through the pipeline: F0 < F1 < ... < B1 < B0, then the weight
# gradients W (only for schedules that split the backward).
PER_MICROBATCH = (FORWARD, BACKWARD, WEIGHT)


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
    micro-batch size is known; ``dtype`` is a numpy dtype name.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    batched: bool  # dim 0 is the batch dimension

    def shape_for(self, micro_batch_size: int | None) -> tuple[int, ...]:
        if self.batched and micro_batch_size is not None:
            return (micro_batch_size,) + self.shape[1:]
        return self.shape

    def describe(self, micro_batch_size: int | None) -> str:
        dims = [("mb" if (i == 0 and self.batched and micro_batch_size is None) else str(d))
                for i, d in enumerate(self.shape_for(micro_batch_size))]
        return f"{self.name} [{', '.join(dims)}] {self.dtype}"


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


@dataclass
class Section:
    """One program of one stage. ``program`` holds the recv ops first and the send ops last."""

    stage: int
    kind: str
    program: "paddle.static.Program | None"  # None: not loaded in this process (load_plan(stages=...))
    feeds: tuple[str, ...] = ()  # data variables fed from the loader into this section
    keep: tuple[str, ...] = ()  # values this section must keep for later sections of the same micro-batch
    recv_routes: tuple[int, ...] = ()
    send_routes: tuple[int, ...] = ()
    source_ops: tuple[int, ...] = ()  # indices of the user program's ops this section runs
    recomputed_ops: tuple[int, ...] = ()  # forward ops run a second time here (recompute)

    @property
    def num_compute_ops(self) -> int:
        return sum(1 for op in self.program.global_block().ops if op.type not in COLLECTIVE_OP_TYPES)

    def __str__(self) -> str:
        return f"# stage {self.stage} {self.kind} section\n{self.program}"


COMM_OP_TYPES = ("send_v2", "recv_v2")  # point-to-point ops at the ends of per-micro-batch sections
COLLECTIVE_OP_TYPES = COMM_OP_TYPES + ("c_allreduce_sum",)  # comm ops the optimize section may hold


@dataclass
class Stage:
    index: int
    device: str
    sections: dict[str, Section] = field(default_factory=dict)
    parameters: tuple[str, ...] = ()
    persistables: tuple[str, ...] = ()  # every persistable variable this stage reads or writes
    grad_buffers: tuple[str, ...] = ()  # per-step gradient accumulators (not part of the state)
    recompute: bool = False  # forward activations are recomputed in the backward section
    rank: int = 0  # the worker (device) that runs this stage

    @property
    def loaded(self) -> bool:
        """False when this process loaded the plan without this stage's section programs
        (``staticpipe.load_plan`` on another rank): another process runs it."""
        return all(sec.program is not None for sec in self.sections.values())


@dataclass
class Plan:
    stages: list[Stage]
    routes: list[Route]
    num_microbatches: int
    schedule: str
    actions: dict[int, list]  # rank -> list of schedule Actions (with SEND/RECV)
    ranks: list[str]  # rank -> device; a device may hold several stages
    data_vars: dict[str, tuple[int, ...]]  # data variable -> stages that read it
    data_specs: dict[str, tuple[tuple[int, ...], str]]  # data variable -> (shape, dtype)
    loss: str
    producers: dict[str, SectionRef] = field(default_factory=dict)  # per-micro-batch var -> its section
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # shared parameter -> stages reading it
    replicated: dict[int, str] = field(default_factory=dict)  # user op index -> why every stage runs it
    micro_batch_size: int | None = None
    notes: list[str] = field(default_factory=list)
    dp_degree: int = 1  # data-parallel replicas of the whole pipeline (one process per stage rank each)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    def stage_of_var(self, name: str) -> list[int]:
        """Stages whose state holds persistable ``name``."""
        return [s.index for s in self.stages if name in s.persistables]

    def bind_micro_batch_size(self, micro_batch_size: int) -> None:
        """Fix the micro-batch dimension of every cut variable (once; later batches must match)."""
        if self.micro_batch_size is None:
            self.micro_batch_size = micro_batch_size
        elif self.micro_batch_size != micro_batch_size:
            raise ValueError(
                f"micro-batch size {micro_batch_size} differs from the plan's compiled micro-batch size "
                f"{self.micro_batch_size} (global batch {self.micro_batch_size * self.num_microbatches} "
                f"with num_microbatches={self.num_microbatches}); every batch must have the same size")

    def __str__(self) -> str:
        mbs = self.micro_batch_size
        lines = [f"Plan: {self.num_stages} stages, {self.num_microbatches} micro-batches"
                 f"{f' of {mbs}' if mbs else ''}, schedule {self.schedule}, loss {self.loss}"
                 f"{f', {self.dp_degree} data-parallel replicas' if self.dp_degree > 1 else ''}"]
        for st in self.stages:
            counts = ", ".join(f"{k} {sec.num_compute_ops} ops" for k, sec in st.sections.items()
                               if k != INIT) if st.loaded else "sections not loaded in this process"
            lines.append(f"  stage {st.index} on {st.device}: {counts}{' (recompute)' if st.recompute else ''}")
            lines.append(f"    parameters: {', '.join(st.parameters) or '-'}")
            data = [n for n, stages in self.data_vars.items() if st.index in stages]
            lines.append(f"    data fed here: {', '.join(data) or '-'}")
        lines.append("  cut variables:")
        for r in self.routes:
            for v in r.vars:
                lines.append(f"    {v.describe(mbs):<44} {r.src} -> {r.dst}")
        if not self.routes:
            lines.append("    -")
        if self.shared:
            lines.append("  shared parameters (updated once on the owner, the first stage that reads them):")
        for name, stages in sorted(self.shared.items()):
            others = ", ".join(str(s) for s in stages[1:])
            lines.append(f"    {name}: owner stage {stages[0]}; stage(s) {others} accumulate their partial "
                         f"gradients, send the sum once per step, and receive the new value after the update")
        for note in self.notes:
            lines.append(f"  note: {note}")
        lines.append(f"  actions ({self.schedule}):")
        for rank, acts in sorted(self.actions.items()):
            lines.append(f"    rank {rank} ({self.ranks[rank]}): {' '.join(str(a) for a in acts)}")
        return "\n".join(lines)


PLAN_ATTR = "_staticpipe_plan"  # the attribute PipelineOptimizer.minimize sets on main and startup programs


def plan_of(program: "paddle.static.Program") -> Plan | None:
    """The pipeline plan attached to ``program``, or None for a program that was not rewritten."""
    return getattr(program, PLAN_ATTR, None)


def attach_plan(plan: Plan, main: "paddle.static.Program", startup: "paddle.static.Program") -> None:
    """Attach ``plan`` to its main and startup programs; the mark on the startup program is how
    ``Executor.run`` knows to initialise the stages rather than train."""
    setattr(main, PLAN_ATTR, plan)
    setattr(startup, PLAN_ATTR, plan)
    startup._staticpipe_is_startup = True
