"""What a user asks of the rewrite, checked once where it enters: ``PlanOptions``.

Why one object: ``PipelineOptimizer`` takes the options when it is constructed (so a bad one fails
there, as Paddle's optimizers fail), and ``build_plan`` takes them when it is called directly; both go
through ``PlanOptions``, so every option is checked by one piece of code, once per entry. What can
only be checked against the program (stage counts) is checked when the plan is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..schedule import Action, Kind, Schedule, canonical_name, check_microbatches, get_kind, parse_action, parse_schedule
from ..schedule.latency import Comm, Latency
from ..schedule.registry import KINDS, check_comm, check_costs
from ..schedule.simulate import StageCosts


# how data-parallel replicas take their data: "split" (staticpipe's): every process is fed the same batch and
# replica k trains on its k-th slice; "own" (Paddle's fleet): every process is fed its own replica's batch
REPLICA_BATCHES = ("split", "own")
# how micro-batches add up: "auto" by the loss's reduction (a batch mean averaged, a batch sum added:
# rewrite/loss.py), "mean" averaged whatever the loss (Paddle's pipeline)
LOSS_REDUCTIONS = ("auto", "mean")


@dataclass(frozen=True)
class PlanOptions:
    """``schedule`` is a name (kept as its canonical spelling) or a custom schedule (a dict, or text
    in ``format_schedule``'s form; ``custom`` holds it parsed)."""

    num_microbatches: int = 1
    schedule: str | Schedule = "1F1B"
    micro_batch_size: int | None = None
    recompute: bool | Iterable[int] = False
    schedule_costs: StageCosts | None = None
    dp_degree: int = 1
    replica_batches: str = "split"
    loss_reduction: str = "auto"
    sharding_degree: int = 1
    schedule_comm: Comm = None

    def __post_init__(self) -> None:
        check_microbatches(self.num_microbatches)
        if self.custom is None:
            object.__setattr__(self, "schedule", canonical_name(self.schedule))
        if self.micro_batch_size is not None and (not isinstance(self.micro_batch_size, int)
                                                  or isinstance(self.micro_batch_size, bool)
                                                  or self.micro_batch_size < 1):
            raise ValueError(f"micro_batch_size must be a positive integer or None, got {self.micro_batch_size!r}")
        if not isinstance(self.dp_degree, int) or isinstance(self.dp_degree, bool) or self.dp_degree < 1:
            raise ValueError(f"dp_degree must be an integer >= 1, got {self.dp_degree!r}")
        if not isinstance(self.sharding_degree, int) or isinstance(self.sharding_degree, bool) or \
                self.sharding_degree < 1 or self.dp_degree % self.sharding_degree:
            raise ValueError(f"sharding_degree must be an integer >= 1 that divides dp_degree ({self.dp_degree}): "
                             f"groups of that many replicas share one copy of the optimizer state; got "
                             f"{self.sharding_degree!r}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {list(LOSS_REDUCTIONS)}, got {self.loss_reduction!r}")
        if self.replica_batches not in REPLICA_BATCHES:
            raise ValueError(f"replica_batches must be one of {list(REPLICA_BATCHES)}, got {self.replica_batches!r}")
        for name in ("schedule_costs", "schedule_comm"):
            if getattr(self, name) is not None and self.custom is not None:
                aware = ", ".join(k.name for k in KINDS.values() if k.cost_aware)
                raise ValueError(f"{name} plans the order of a named schedule ({aware}); a custom schedule "
                                 "gives its own order")
        self.costs()
        self.latency()

    @property
    def custom(self) -> Schedule | None:
        """The user-written schedule, or None for a named one. A dict may hold actions or their text
        (``{0: ["0F0", "0B0", "0OPT"]}``)."""
        if isinstance(self.schedule, dict):
            return {_rank(r): [_action(r, a) for a in _listed(r, acts)] for r, acts in self.schedule.items()}
        if isinstance(self.schedule, str) and self.schedule.lstrip().startswith("rank "):
            return parse_schedule(self.schedule)
        return None

    def costs(self, num_stages: int | None = None) -> Callable[[Action], float] | None:
        """The durations a cost-aware schedule plans with (None: unit costs); the per-stage lists'
        lengths are checked once ``num_stages`` is known."""
        if self.schedule_costs is None:
            return None
        return check_costs(get_kind(self.schedule), self.schedule_costs, num_stages, "schedule_costs")

    def latency(self) -> Latency | None:
        """The message latency a cost-aware schedule plans with (None: messages are free)."""
        if self.custom is not None:
            return None
        return check_comm(get_kind(self.schedule), self.schedule_comm, "schedule_comm")

    def layout_needs(self) -> tuple[bool, bool]:
        """(several stages per device, the backward split into B and W)."""
        custom = self.custom
        if custom is None:
            kind = get_kind(self.schedule)
            return kind.chunks != 1, kind.split_backward
        stage_ranks = {a.stage: rank for rank, acts in custom.items() for a in acts}
        return len(stage_ranks) > len(custom), any(a.kind is Kind.W for acts in custom.values() for a in acts)

    def recompute_stages(self, num_stages: int) -> frozenset[int]:
        if self.recompute is True or self.recompute is False:
            return frozenset(range(num_stages)) if self.recompute else frozenset()
        stages = frozenset(self.recompute)
        bad = sorted(s for s in stages if not (isinstance(s, int) and 0 <= s < num_stages))
        if bad:
            raise ValueError(f"recompute names stages {bad}, but the program has stages 0..{num_stages - 1}")
        return stages


def _rank(rank: object) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"a custom schedule's keys are ranks (integers >= 0), got {rank!r}")
    return rank


def _listed(rank: int, actions: object) -> list:
    if not isinstance(actions, (list, tuple)):
        raise ValueError(f"rank {rank} of the custom schedule must map to a list of actions, got "
                         f"{type(actions).__name__}: {actions!r}")
    return list(actions)


def _action(rank: int, action: object) -> Action:
    """An ``Action``, or its text (``"0F3"``), of rank ``rank``'s list."""
    if isinstance(action, Action):
        return action
    if isinstance(action, str):
        return parse_action(action)
    raise ValueError(f"rank {rank} of the custom schedule holds {action!r}: actions are Action objects or their "
                     "text (e.g. '0F3', '1B0', '0OPT')")
