"""The Plan: what the rewrite decided, in data the runtime and the user can read.

A plan names the stages (a device each), the sections of every stage (forward, backward, optimize and
init programs), the cut variables that travel between sections with their compiled shapes and dtypes
(``Route``s, once per micro-batch), the messages the optimize sections exchange once per step
(``Exchange``s), and the schedule's action lists. Nothing here executes anything; the runtime only
follows it.

Why frozen: a plan is built once, complete, by the rewrite (or read back by ``load_plan``) and then
shared by every worker, evaluation and saved copy; what changes while training (the micro-batch size a
first batch fixes, the step count) is runtime state, never a later assignment to the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from .memory_model import MemoryModel
from .plan_records import (BACKWARD, COLLECTIVE_OP_TYPES, COMM_OP_TYPES, FORWARD, FORWARD_ONLY, INIT, OPTIMIZE,
                           PER_MICROBATCH, SEND, SUM, WEIGHT, CutVar, Exchange, Route, SectionRef)

if TYPE_CHECKING:
    from ._paddle import paddle


@dataclass(frozen=True, eq=False)
class Run:
    """A compute-only program the runtime executes, and the values it must leave alive for what follows
    it in the step (later runs of the section, exchanges, later sections of the micro-batch).
    ``program`` is None for an empty run (two exchanges in a row)."""

    program: "paddle.static.Program | None"
    keep: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Section:
    """One program of one stage.

    ``program`` is the section as Paddle's own pipeline writes it: the recv ops first and the send ops
    last (per micro-batch), or the optimize ops with the send, recv and all-reduce ops of its exchanges
    where they happen. ``runs`` is what the runtime executes: the same ops without the communication,
    which the plan states as data (``recv_routes``/``send_routes``; ``exchanges``, where exchange k
    comes after ``runs[k]``).
    """

    stage: int
    kind: str
    program: "paddle.static.Program | None"  # None: not loaded in this process (load_plan(stages=...))
    feeds: tuple[str, ...] = ()  # data variables fed from the loader into this section
    keep: tuple[str, ...] = ()  # values this section must keep for later sections of the same micro-batch
    recv_routes: tuple[int, ...] = ()
    send_routes: tuple[int, ...] = ()
    exchanges: tuple[int, ...] = ()  # optimize: the plan's exchanges this section takes part in, in order
    source_ops: tuple[int, ...] = ()  # indices of the user program's ops this section runs
    recomputed_ops: tuple[int, ...] = ()  # forward ops run a second time here (recompute)
    comm_ops: tuple[int, ...] = ()  # indices of the program's send/recv/all-reduce ops the rewrite made
    runs: tuple[Run, ...] = ()  # compute-only programs: one, or len(exchanges) + 1 for optimize

    @property
    def run(self) -> Run:
        """The one compute program of a per-micro-batch or init section."""
        return self.runs[0]

    @property
    def programs(self) -> tuple:
        """Its program and its runs' programs, each once (a PIR optimize section's runs are programs of
        their own; a legacy section's are copies of its program)."""
        return tuple({id(p): p for p in (self.program, *(r.program for r in self.runs)) if p is not None}.values())

    @property
    def num_compute_ops(self) -> int:
        from .ir import num_compute_ops  # here: reading a plan's data needs no Paddle

        return num_compute_ops(self.program, COLLECTIVE_OP_TYPES)

    def __str__(self) -> str:
        return f"# stage {self.stage} {self.kind} section\n{self.program}"


@dataclass(frozen=True, eq=False)
class Stage:
    index: int
    device: str
    rank: int  # the worker (device) that runs this stage
    sections: Mapping[str, Section] = field(default_factory=dict)
    parameters: tuple[str, ...] = ()
    persistables: tuple[str, ...] = ()  # every persistable variable this stage reads or writes
    grad_buffers: tuple[str, ...] = ()  # per-step gradient accumulators (not part of the state)
    recompute: bool = False  # forward activations are recomputed in the backward section
    step_values: tuple[str, ...] = ()  # held once per step for all micro-batches (AMP's parameter copies)
    # ZeRO-1 (Plan.sharding_degree > 1, rewrite/sharding.py): each shard's optimize section, the shard that
    # updates each parameter (tied copies: their owner's), and the shard that holds each optimizer state
    shard_optimize: tuple[Section, ...] = ()
    param_shards: Mapping[str, int] = field(default_factory=dict)
    state_shards: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", MappingProxyType(dict(self.sections)))
        object.__setattr__(self, "shard_optimize", tuple(self.shard_optimize))
        for name in ("param_shards", "state_shards"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def optimize_section(self, shard: int | None) -> Section:
        """The optimize section the member ``shard`` of a sharding group runs (None: not sharded)."""
        return self.sections[OPTIMIZE] if shard is None or not self.shard_optimize else self.shard_optimize[shard]

    def holds(self, name: str, shard: int | None) -> bool:
        """Whether the member ``shard`` of a sharding group (None: not sharded) holds ``name`` of this stage's
        state: everything but the other members' optimizer state."""
        return shard is None or self.state_shards.get(name, shard) == shard

    def unheld(self, shard: int | None) -> frozenset[str]:
        """The optimizer state of the other shards, which the member ``shard`` never holds (None: none)."""
        return frozenset(n for n in self.state_shards if not self.holds(n, shard))

    @property
    def loaded(self) -> bool:
        """False when this process loaded the plan without this stage's section programs
        (``staticpipe.load_plan`` on another rank): another process runs it."""
        return all(sec.program is not None for sec in self.sections.values())




@dataclass(frozen=True, eq=False)
class Plan:
    stages: tuple[Stage, ...]
    routes: tuple[Route, ...]
    num_microbatches: int
    schedule: str
    actions: Mapping[int, tuple]  # rank -> schedule Actions (with SEND/RECV)
    ranks: tuple[str, ...]  # rank -> device; a device may hold several stages
    data_vars: Mapping[str, tuple[int, ...]]  # data variable -> stages that read it
    data_specs: Mapping[str, tuple[tuple[int, ...], str]]  # data variable -> (shape, dtype)
    loss: str
    producers: Mapping[str, SectionRef] = field(default_factory=dict)  # per-micro-batch var -> its section
    shared: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # shared parameter -> stages reading it
    replicated: Mapping[int, str] = field(default_factory=dict)  # user op index -> why every stage runs it
    exchanges: tuple[Exchange, ...] = ()  # once-per-step messages of the optimize sections
    micro_batch_size: int | None = None  # compiled at rewrite time; None: fixed by the first batch
    notes: tuple[str, ...] = ()
    dp_degree: int = 1  # data-parallel replicas of the whole pipeline (one process per stage rank each)
    replica_batches: str = "split"  # "split": each feed is split among the replicas; "own": each is its replica's
    # values the program marks persistable that train as activations (rewrite/activations.py): after each step
    # each one's value for the step's batch is left in its stage's scope, where one device leaves it
    outliving: tuple[str, ...] = ()
    loss_reduction: str = "mean"  # "mean": micro-batches (and replicas) averaged; "sum": added (rewrite/loss.py)
    # per-micro-batch values without the batch as dim 0 (metrics) -> how a fetch puts the micro-batches (and
    # replicas) together: "mean", "sum", "max", "min", or "each" (handed out per micro-batch); rewrite/loss.py
    reductions: Mapping[str, str] = field(default_factory=dict)
    memory: MemoryModel | None = None  # predicted bytes per stage and device (training plans)
    sharding_degree: int = 1  # ZeRO-1: consecutive replicas that share one copy of the optimizer state

    def __post_init__(self) -> None:
        """Every container read-only: the plan is shared by every worker, evaluation and saved copy."""
        for name in ("stages", "routes", "ranks", "exchanges", "notes", "outliving"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "actions", _frozen({r: tuple(acts) for r, acts in self.actions.items()}))
        for name in ("data_vars", "data_specs", "producers", "shared", "replicated", "reductions"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def reduction(self, name: str) -> str:
        """How fetched value ``name`` (without the batch as dim 0) puts micro-batches, replicas and batches
        together: the loss by ``loss_reduction``, others by ``reductions`` ("mean", "sum", "max", "min" or
        "each"); a value found in neither does not depend on the batch, so their mean is it."""
        return self.loss_reduction if name == self.loss else self.reductions.get(name, "mean")

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    def stage_of_var(self, name: str) -> list[int]:
        """Stages whose state holds persistable ``name``."""
        return [s.index for s in self.stages if name in s.persistables]

    def rank_pairs(self) -> tuple[tuple[int, int], ...]:
        """(sender, receiver) pipeline ranks of every message the plan can send between two ranks: its routes,
        its optimize exchanges, and each rank's state to rank 0 (checkpoints). A job of several processes
        makes a point-to-point group for these pairs only, not for every pair of ranks."""
        stage_pairs = [(r.src.stage, r.dst.stage) for r in self.routes]
        stage_pairs += [(e.src, e.dst) for e in self.exchanges if e.kind == SEND]
        pairs = {(self.stages[a].rank, self.stages[b].rank) for a, b in stage_pairs}
        pairs |= {(r, 0) for r in range(1, len(self.ranks))}
        return tuple(sorted((a, b) for a, b in pairs if a != b))

    def stages_of_process(self, world: tuple[int, int] | None) -> list[Stage]:
        """The stages the process ``world`` = (rank, size) of a launched job runs; every stage for None
        (one process)."""
        pipeline = len(self.ranks)
        if world is None:
            if self.dp_degree > 1:
                raise ValueError(f"{self._replicas_named()} runs one process per device and replica: launch "
                                 f"{self.dp_degree * pipeline} processes (python -m staticpipe.launch --nprocs "
                                 f"{self.dp_degree * pipeline} script.py)")
            return list(self.stages)
        rank, size = world
        if size != self.dp_degree * pipeline:
            replicas = f" x {self._replicas_named()}" if self.dp_degree > 1 else ""
            raise ValueError(f"the job has {size} processes but the plan has {pipeline} devices {list(self.ranks)}"
                             f"{replicas}; launch {self.dp_degree * pipeline} processes (one per device{replicas})")
        return [s for s in self.stages if s.rank == self.place_of_process(rank)[1]]

    def _replicas_named(self) -> str:
        """The replicas as the user asked for them: fleet's sharding_degree is a factor of our dp_degree."""
        s = self.sharding_degree
        return f"dp_degree={self.dp_degree}" if s == 1 else (
            f"dp_degree={self.dp_degree // s} x sharding_degree={s}")

    def shard_of_process(self, world: tuple[int, int] | None) -> int | None:
        """Which member of its sharding group the process ``world`` = (rank, size) is (None: not sharded)."""
        if self.sharding_degree == 1 or world is None:
            return None
        return self.place_of_process(world[0])[0] % self.sharding_degree

    def process_of(self, replica: int, rank: int) -> int:
        """The launched process that runs pipeline rank ``rank`` of replica ``replica``."""
        return process_of(replica, rank, len(self.ranks), self.sharding_degree)

    def place_of_process(self, process: int) -> tuple[int, int]:
        """(replica, pipeline rank) of the launched ``process``."""
        return place_of_process(process, len(self.ranks), self.sharding_degree)

    def __str__(self) -> str:
        mbs = self.micro_batch_size
        lines = [f"Plan: {self.num_stages} stages, {self.num_microbatches} micro-batches"
                 f"{f' of {mbs}' if mbs else ''}, schedule {self.schedule}, loss {self.loss}"
                 f"{f', {self.dp_degree} data-parallel replicas' if self.dp_degree > 1 else ''}"
                 f"{f' (optimizer state sharded over groups of {self.sharding_degree})' if self.sharding_degree > 1 else ''}"]
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
        if self.exchanges:
            lines.append("  exchanges of the optimize sections (once per step):")
            lines += [f"    {ex}" for ex in self.exchanges]
        lines += [f"  note: {note}" for note in self.notes]
        if self.memory is not None:
            lines += self.memory.describe(mbs)
        lines.append(f"  actions ({self.schedule}):")
        for rank, acts in sorted(self.actions.items()):
            lines.append(f"    rank {rank} ({self.ranks[rank]}): {' '.join(str(a) for a in acts)}")
        return "\n".join(lines)


def process_of(replica: int, rank: int, pipeline: int, sharding: int = 1) -> int:
    """The launched process that runs pipeline rank ``rank`` (of ``pipeline``) of replica ``replica``.

    Why this order: it is Paddle's. A fleet script works out its own data-parallel and sharding ranks from
    its process rank (its data shard comes from them), in fleet's order, outermost first: data-parallel
    group, pipeline rank, sharding member (fleet's static ShardingOptimizer; without sharding, its
    pipeline's process ``k * p + r``). Replica ``k`` is member ``k % sharding`` of group ``k // sharding``:
    a process placed otherwise would be fed another replica's batches, and train wrong, silently."""
    return (replica // sharding * pipeline + rank) * sharding + replica % sharding


def place_of_process(process: int, pipeline: int, sharding: int = 1) -> tuple[int, int]:
    """(replica, pipeline rank) of the launched ``process``: the inverse of ``process_of``."""
    group, rank = divmod(process // sharding, pipeline)
    return group * sharding + process % sharding, rank


def _frozen(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(dict(mapping))


PLAN_ATTR = "_staticpipe_plan"  # the attribute PipelineOptimizer.minimize sets on main and startup programs
STARTUP_ATTR = "_staticpipe_is_startup"
STARTUP_LINK = "_staticpipe_startup"  # on a main program: its startup program (save_plan's default)


def plan_of(program: "paddle.static.Program") -> Plan | None:
    """The pipeline plan attached to ``program``, or None for a program that was not rewritten."""
    return getattr(program, PLAN_ATTR, None)


def require_plan(program: "paddle.static.Program", what: str) -> Plan:
    """The plan of ``program``; ``ValueError`` naming ``what`` needed it when the program has none."""
    plan = plan_of(program)
    if plan is None:
        raise ValueError(f"{what} needs a program rewritten by staticpipe.PipelineOptimizer.minimize; this "
                         "program has no pipeline plan")
    return plan


def is_startup(program: "paddle.static.Program") -> bool:
    """Whether ``program`` is the startup program of a plan (``Executor.run`` initialises the stages)."""
    return getattr(program, STARTUP_ATTR, False)


def attach_plan(plan: Plan, main: "paddle.static.Program", startup: "paddle.static.Program | None" = None) -> None:
    """Attach ``plan`` to its main program, and to its startup program, whose mark is how
    ``Executor.run`` knows to initialise the stages rather than train; the main program keeps a link to its
    startup program (``STARTUP_LINK``)."""
    setattr(main, PLAN_ATTR, plan)
    if startup is not None:
        setattr(startup, PLAN_ATTR, plan)
        setattr(startup, STARTUP_ATTR, True)
        setattr(main, STARTUP_LINK, startup)  # save_plan(main, path) finds it (it used to need it passed again)


__all__ = ["Plan", "Stage", "Section", "Run", "Route", "Exchange", "CutVar", "SectionRef", "plan_of", "require_plan",
           "attach_plan", "is_startup", "FORWARD", "BACKWARD", "WEIGHT", "OPTIMIZE", "INIT", "PER_MICROBATCH",
           "FORWARD_ONLY", "SEND", "SUM"]
