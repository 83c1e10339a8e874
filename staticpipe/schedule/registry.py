"""The named schedules: how each generates its action lists and where it needs each stage to live.

A kind pairs a generator with a layout (the rank of every stage) because the two are one decision:
interleaved 1F1B only works with stage s on rank s % p, ZB-V (and V-Min, V-Half, DualPipeV) only with
the V. The rewrite builds a plan's stages from the program's device guards and checks them against the
layout; the generator then fills in the order. A kind that only works from some number of
micro-batches on says so (``min_microbatches``), and ``make_schedule`` refuses fewer by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..gc_paused import gc_paused
from .actions import Action, Schedule, check_unranked_text
from .dualpipe import dualpipe_v
from .gpipe import f_then_b
from .interleaved import interleaved
from .latency import Comm, Latency, link_latency
from .one_f_one_b import eager_one_f_one_b, one_f_one_b
from .simulate import StageCosts, stage_cost_function
from .v_shape import v_half, v_min
from .zero_bubble import zb_2p, zb_h1, zb_v, zb_v_layout


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    generate: Callable[[int, int, int], Schedule]  # (ranks, micro-batches, chunks) -> rank -> compute actions
    layout: Callable[[int, int], list[int]]  # (ranks, chunks) -> rank of each stage
    split_backward: bool = False  # emits W actions
    chunks: int | None = 1  # stages per rank it needs; None: any number >= 1
    # generate takes two more arguments: the F/B/W durations and the message latency to plan with
    cost_aware: bool = False
    # (ranks -> the fewest micro-batches it runs, that rule in words), None: any number
    min_microbatches: tuple[Callable[[int], int], str] | None = None


def _one_chunk(generate: Callable[[int, int], Schedule]) -> Callable[[int, int, int], Schedule]:
    """For kinds with one stage per rank (``make_schedule`` has checked ``num_chunks == 1``)."""
    return lambda num_ranks, num_microbatches, num_chunks: generate(num_ranks, num_microbatches)


def _one_chunk_costed(generate: Callable[..., Schedule]) -> Callable[..., Schedule]:
    """``_one_chunk`` for cost-aware kinds: costs and latency, when given, go through to the generator."""
    return lambda num_ranks, num_microbatches, num_chunks, costs=None, latency=None: generate(
        num_ranks, num_microbatches, costs, latency)


def _round_robin(num_ranks: int, num_chunks: int) -> list[int]:
    return [s % num_ranks for s in range(num_ranks * num_chunks)]


def _v(num_ranks: int, num_chunks: int) -> list[int]:
    return zb_v_layout(num_ranks)


KINDS = {k.name: k for k in (
    ScheduleKind("F-then-B", _one_chunk(f_then_b), _round_robin),
    ScheduleKind("1F1B", _one_chunk(one_f_one_b), _round_robin),
    ScheduleKind("interleaved", interleaved, _round_robin, chunks=None),
    ScheduleKind("ZB-H1", _one_chunk_costed(zb_h1), _round_robin, split_backward=True, cost_aware=True),
    ScheduleKind("ZB-V", _one_chunk_costed(zb_v), _v, split_backward=True, chunks=2, cost_aware=True),
    ScheduleKind("V-Min", _one_chunk_costed(v_min), _v, split_backward=True, chunks=2, cost_aware=True),
    ScheduleKind("V-Half", _one_chunk_costed(v_half), _v, split_backward=True, chunks=2, cost_aware=True),
    ScheduleKind("ZB-2P", _one_chunk_costed(zb_2p), _round_robin, split_backward=True, cost_aware=True),
    ScheduleKind("Eager1F1B", _one_chunk(eager_one_f_one_b), _round_robin,
                 min_microbatches=(lambda num_ranks: 2 * num_ranks - 1, "2 x devices - 1: stage 0's warm-up forwards, "
                                   "as Paddle's Eager1F1B pass requires")),
    ScheduleKind("DualPipeV", _one_chunk(dualpipe_v), _v, split_backward=True, chunks=2,
                 min_microbatches=(lambda num_ranks: 2 * num_ranks, "2 x devices: every rank fills both of its "
                                   "chunks before its first paired F&B")),
)}
ALIASES = {"FThenB": "F-then-B", "GPipe": "F-then-B",
           "Interleaved1F1B": "interleaved", "interleaved-1F1B": "interleaved"}


def _known() -> str:
    aliases = {name: [a for a, c in ALIASES.items() if c == name] for name in KINDS}
    return ", ".join(f"{n} (aliases {', '.join(aliases[n])})" if aliases[n] else n for n in KINDS)


def canonical_name(name: str) -> str:
    """The registered spelling of ``name``; ``ValueError`` listing the known schedules otherwise."""
    if isinstance(name, str) and name in KINDS:
        return name
    if isinstance(name, str) and name in ALIASES:
        return ALIASES[name]
    if isinstance(name, str):
        check_unranked_text(name)  # a custom schedule's text, its rank lines missing
    raise ValueError(f"unknown schedule {name!r}; known schedules: {_known()}")


def get_kind(name: str) -> ScheduleKind:
    return KINDS[canonical_name(name)]


def check_microbatches(num_microbatches: object) -> int:
    return _check_count("num_microbatches", num_microbatches)


def _check_count(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def check_chunks(kind: ScheduleKind, num_ranks: int, num_chunks: int) -> None:
    """``ValueError`` unless ``kind`` runs ``num_chunks`` stages on each of ``num_ranks`` ranks."""
    if kind.chunks is None or kind.chunks == num_chunks:
        return
    need = "1 chunk per device (stages = devices)" if kind.chunks == 1 else (
        f"{kind.chunks} chunks per device (stages = {kind.chunks} x devices)")
    raise ValueError(f"schedule {kind.name} needs {need}; the program has {num_ranks * num_chunks} stages "
                     f"on {num_ranks} devices")


def check_costs(kind: ScheduleKind, costs: StageCosts | None, num_stages: int | None = None,
                name: str = "costs") -> Callable[[Action], float] | None:
    """``costs`` (argument ``name``) as the duration function ``kind`` plans with, None for unit costs;
    ``ValueError`` naming the schedule if it does not plan by costs, or the kind or value at fault."""
    if costs is None:
        return None
    _check_cost_aware(kind, name)
    return stage_cost_function(costs, num_stages, name)


def check_comm(kind: ScheduleKind, comm: Comm, name: str = "comm") -> Latency | None:
    """``comm`` (argument ``name``) as the latency ``kind`` plans with (``latency.link_latency``), None
    where messages are free; ``ValueError`` naming the schedule if its order does not depend on it."""
    latency = link_latency(comm, name)
    if latency is not None:
        _check_cost_aware(kind, name)
    return latency


def _check_cost_aware(kind: ScheduleKind, name: str) -> None:
    if not kind.cost_aware:
        aware = ", ".join(k.name for k in KINDS.values() if k.cost_aware)
        raise ValueError(f"{name} is for the schedules that plan by measured costs ({aware}); schedule "
                         f"{kind.name} does not use it")


@gc_paused()
def make_schedule(name: str, num_ranks: int, num_microbatches: int, num_chunks: int = 1,
                  costs: StageCosts | None = None, comm: Comm = None) -> Schedule:
    """The compute action lists (F, B, W, OPT) of schedule ``name``, keyed by rank. ``costs``: the
    durations a cost-aware schedule plans with (see ``simulate.stage_cost_function``); None: unit.
    ``comm``: the message latency it plans with (``latency.link_latency``); None: messages are free."""
    kind = get_kind(name)
    check_microbatches(num_microbatches)
    _check_count("num_ranks", num_ranks)
    _check_count("num_chunks", num_chunks)
    check_chunks(kind, num_ranks, num_chunks)
    duration = check_costs(kind, costs, num_ranks * num_chunks)
    latency = check_comm(kind, comm)
    if kind.name == "interleaved" and num_microbatches % num_ranks:
        below = num_microbatches - num_microbatches % num_ranks
        use = " or ".join(str(n) for n in (below, below + num_ranks) if n > 0)
        raise ValueError(f"interleaved 1F1B needs num_microbatches to be a multiple of the number of devices "
                         f"({num_ranks}); got {num_microbatches}: use {use}")
    if kind.min_microbatches is not None and num_microbatches < kind.min_microbatches[0](num_ranks):
        least, rule = kind.min_microbatches[0](num_ranks), kind.min_microbatches[1]
        raise ValueError(f"schedule {kind.name} needs num_microbatches >= {least} on {num_ranks} "
                         f"device{'s' * (num_ranks != 1)} ({rule}); got {num_microbatches}")
    if latency is not None:
        return kind.generate(num_ranks, num_microbatches, num_chunks, duration, latency)
    if duration is not None:
        return kind.generate(num_ranks, num_microbatches, num_chunks, duration)
    return kind.generate(num_ranks, num_microbatches, num_chunks)
