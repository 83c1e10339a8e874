"""``validate``: refuse a schedule that would train wrongly or hang, before any device runs it.

A schedule from a generator is valid by construction; a custom one (written by hand, loaded from text
or JSON) may not be, and the runtime would otherwise fail mid-step or wait forever. The checks go from
local to global, so the first error is the most specific one: each action on its own (its stage lives
on this rank, its micro-batch exists, SEND/RECV name a route and a peer), then each stage's set of
actions (exactly one F, B -- and W iff the backward is split -- per micro-batch, one OPT), then each
stage's order (F < B < W < OPT), then a dry run of all ranks together (deadlocks, lost messages). An FB
action is checked as its two halves (each on this rank, counted as the F and the B it holds, each in
order after what came before the pair), and errors name the FB as written.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import filterfalse

from ..gc_paused import gc_paused
from .actions import CHANNELS, Action, Kind, Schedule
from .execution import Columns, ScheduleError, columns_of, fail, timeline

Seen = defaultdict  # kind -> stage -> the micro-batches of that kind it ran (an OPT's: None)
PER_MICROBATCH = (Kind.F, Kind.B, Kind.W)  # in the order one stage must run them for a micro-batch
COUNTED = PER_MICROBATCH + (Kind.OPT,)  # exactly once per stage (and micro-batch)


@gc_paused()
def validate(schedule: Schedule, num_stages: int, num_microbatches: int, stage_ranks: list[int],
             split_backward: bool = False, collectives: bool = False) -> None:
    """Raise ``ScheduleError`` naming the first rank, step and action at fault, if any.

    ``stage_ranks[s]`` is the rank that holds stage ``s``. ``collectives``: the OPT actions hold
    collectives every rank must join, so they must be reachable as one barrier.

    One pass over every action (hundreds of thousands at scale): the common case -- an F, B, W or OPT
    of this rank's stage and an existing micro-batch, in order, seen once -- costs a few tests inline;
    anything else goes to the functions that say what is wrong. An FB is checked half by half, its B
    half against what came before the pair. What has been seen is kept per kind and stage, as a set of
    micro-batches: one set of (kind, stage, micro-batch) tuples, a tuple made and hashed per test and
    the lookups all over a set of them all, took a third of the time.
    """
    if len(stage_ranks) != num_stages:
        raise ValueError(f"stage_ranks has {len(stage_ranks)} entries for {num_stages} stages")
    kinds = PER_MICROBATCH if split_backward else PER_MICROBATCH[:2]
    seen: Seen = defaultdict(lambda: defaultdict(set))  # the F, B, W and OPT so far (FBs as their halves)
    f, b, fb, opt, w, send, recv = Kind.F, Kind.B, Kind.FB, Kind.OPT, Kind.W, Kind.SEND, Kind.RECV
    seen_f, seen_b = seen[f], seen[b]
    microbatches = range(num_microbatches)
    out_of_order: ScheduleError | None = None  # the first, raised after the completeness check
    columns: dict[int, Columns] = {}  # the dry run's, made while the rank's actions are in cache
    for r, acts in sorted(schedule.items()):
        mine = {s for s, q in enumerate(stage_ranks) if q == r}
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r}, step {i}: {a!r} is not an Action (parse_action reads text)", r, i)
            kind, s, mb, _, _, _, s2, mb2 = a
            if kind is fb:
                if not (type(s) is int and s in mine and type(mb) is int and mb in microbatches):
                    _check_action(r, i, a, a.halves()[0], num_stages, num_microbatches, stage_ranks, split_backward)
                if not (type(s2) is int and s2 in mine and type(mb2) is int and mb2 in microbatches):
                    _check_action(r, i, a, a.halves()[1], num_stages, num_microbatches, stage_ranks, split_backward)
                if out_of_order is None and mb2 not in seen_f[s2]:
                    out_of_order = _order_error(r, i, a, a.halves()[1], seen, num_microbatches, kinds)
                for k, stage, m in ((f, s, mb), (b, s2, mb2)):
                    if m in seen[k][stage]:
                        raise fail(r, i, a, f"stage {stage} runs {k.value} of micro-batch {m} twice")
                    seen[k][stage].add(m)
                continue
            # the stage's type first: ``mine`` would take 1.0 or True for 1
            if not (type(s) is int and s in mine and (kind is opt or (
                    type(mb) is int and mb in microbatches and kind is not send and kind is not recv
                    and (split_backward or kind is not w)))):
                _check_action(r, i, a, a, num_stages, num_microbatches, stage_ranks, split_backward)
            if out_of_order is None and (kind is b and mb not in seen_f[s] or kind is w and mb not in seen_b[s]
                                         or kind is opt):
                out_of_order = _order_error(r, i, a, a, seen, num_microbatches, kinds)
            if kind is not send and kind is not recv:
                ran = seen[kind][s]  # a stage's actions all come from its rank: what the stage ran so far
                if mb in ran:
                    what = "OPT" if kind is opt else f"{kind.value} of micro-batch {mb}"
                    raise fail(r, i, a, f"stage {s} runs {what} twice")
                ran.add(mb)
        columns[r] = columns_of(acts)
    if sum(len(ran) for stages in seen.values() for ran in stages.values()) != \
            num_stages * (len(kinds) * num_microbatches + 1):  # each is checked, and none twice
        _check_complete(schedule, seen, num_stages, num_microbatches, stage_ranks, kinds)
    if out_of_order is not None:
        raise out_of_order
    timeline(schedule, num_stages, None, collectives, columns)


def _order_error(r: int, i: int, a: Action, h: Action, seen: Seen, num_microbatches: int,
                 kinds: tuple[Kind, ...]) -> ScheduleError | None:
    """Per stage and micro-batch F < B (< W), and every B (and W) before the stage's OPT: the error if
    ``h`` (``a`` or a half of the FB ``a``) comes too early on its rank."""
    kind = h[0]
    if kind is Kind.B or kind is Kind.W:
        first = Kind.F if kind is Kind.B else Kind.B
        if h[2] not in seen[first][h[1]]:
            return fail(r, i, a, f"{kind.value} of micro-batch {h.microbatch} comes before its {first.value} on "
                                 f"stage {h.stage}")
    elif kind is Kind.OPT:
        late = list(filterfalse(seen[kinds[-1]][h.stage].__contains__, range(num_microbatches)))
        if late:
            return fail(r, i, a, f"OPT of stage {h.stage} comes before its {kinds[-1].value} of micro-batch {late[0]}")
    return None


def _check_complete(schedule: Schedule, seen: Seen, num_stages: int, num_microbatches: int, stage_ranks: list[int],
                    kinds: tuple[Kind, ...]) -> None:
    """Raise naming the first stage that lacks an action, and which: after the action at fault where one is
    (``_at_fault``)."""
    for s in range(num_stages):
        for k in kinds:
            missing = list(filterfalse(seen[k][s].__contains__, range(num_microbatches)))
            if missing:
                mbs = f"micro-batch{'es' * (len(missing) > 1)} {', '.join(map(str, missing))}"
                lacks = f"stage {s} lacks {k.value} of {mbs}"
                raise _at_fault(schedule, seen, s, k, missing, kinds, num_microbatches, lacks) or ScheduleError(
                    lacks, stage_ranks[s])
        if None not in seen[Kind.OPT][s]:
            raise ScheduleError(f"stage {s} lacks its OPT", stage_ranks[s])


def _at_fault(schedule: Schedule, seen: Seen, s: int, k: Kind, missing: list[int], kinds: tuple[Kind, ...],
              num_microbatches: int, lacks: str) -> ScheduleError | None:
    """The error naming the action that makes stage ``s`` lack ``k`` of ``missing``, if one does: a B (W) of
    such a micro-batch, which has no F (B) to follow; else, where W actions are few (no stage has all its W's),
    the first W, whose presence splits every backward."""
    later = kinds[kinds.index(k) + 1] if k is not kinds[-1] else None
    stray = k is Kind.W and not any(len(seen[Kind.W][t]) == num_microbatches for t in seen[Kind.W])
    for r, acts in sorted(schedule.items()):
        for i, a in enumerate(acts):
            for h in a.halves():
                if h.kind is later and h.stage == s and h.microbatch in missing:
                    return fail(r, i, a, f"{later.value} of micro-batch {h.microbatch} has no {k.value} on stage {s} "
                                         f"({lacks})")
                if stray and h.kind is Kind.W:
                    return fail(r, i, a, "a W action splits the backward (with none, a B runs the whole backward), "
                                         f"so every stage needs a W of each micro-batch after its B; {lacks}")
    return None


def _check_action(r: int, i: int, a: Action, h: Action, num_stages: int, num_microbatches: int,
                  stage_ranks: list[int], split_backward: bool) -> None:
    """Action ``a`` at rank ``r``, step ``i``; ``h`` is ``a`` or one half of an FB ``a``."""
    if not (isinstance(h.stage, int) and 0 <= h.stage < num_stages):
        raise fail(r, i, a, f"stage {h.stage} does not exist (stages 0..{num_stages - 1})")
    if stage_ranks[h.stage] != r:
        raise fail(r, i, a, f"stage {h.stage} is placed on rank {stage_ranks[h.stage]}, not rank {r}")
    if a.kind is Kind.OPT:
        return
    if not (isinstance(h.microbatch, int) and 0 <= h.microbatch < num_microbatches):
        raise fail(r, i, a, f"micro-batch {h.microbatch} does not exist "
                            f"(micro-batches 0..{num_microbatches - 1})")
    if a.kind is Kind.W and not split_backward:
        raise fail(r, i, a, "a W action, but this schedule does not split the backward "
                            "(split_backward=False)")
    if a.kind in (Kind.SEND, Kind.RECV) and not (
            isinstance(a.route, int) and a.route >= 0 and isinstance(a.peer, int)
            and 0 <= a.peer < num_stages and a.peer != a.stage and a.channel in CHANNELS):
        raise fail(r, i, a, f"{a.kind.value} needs a route index, a peer stage other than its own "
                            f"(0..{num_stages - 1}) and a channel F, B or FB")
