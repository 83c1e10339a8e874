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

from ..gc_paused import gc_paused
from .actions import CHANNELS, Action, Kind, Schedule
from .execution import ScheduleError, execute, fail

PER_MICROBATCH = (Kind.F, Kind.B, Kind.W)  # in the order one stage must run them for a micro-batch
COUNTED = PER_MICROBATCH + (Kind.OPT,)  # exactly once per stage (and micro-batch)


@gc_paused()
def validate(schedule: Schedule, num_stages: int, num_microbatches: int, stage_ranks: list[int],
             split_backward: bool = False, collectives: bool = False) -> None:
    """Raise ``ScheduleError`` naming the first rank, step and action at fault, if any.

    ``stage_ranks[s]`` is the rank that holds stage ``s``. ``collectives``: the OPT actions hold
    collectives every rank must join, so they must be reachable as one barrier.
    """
    if len(stage_ranks) != num_stages:
        raise ValueError(f"stage_ranks has {len(stage_ranks)} entries for {num_stages} stages")
    kinds = PER_MICROBATCH if split_backward else PER_MICROBATCH[:2]
    seen: dict[tuple, tuple[int, int, Action]] = {}  # (kind, stage, micro-batch) -> rank, step, action
    fb, opt, w, send, recv = Kind.FB, Kind.OPT, Kind.W, Kind.SEND, Kind.RECV
    out_of_order: ScheduleError | None = None  # the first, raised after the completeness check
    for r, acts in sorted(schedule.items()):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r}, step {i}: {a!r} is not an Action (parse_action reads text)", r, i)
            halves = a.halves() if a[0] is fb else (a,)
            for h in halves:
                kind, stage, mb = h[:3]
                # the common case in one test; anything else gets the checks that say what is wrong
                if not (type(stage) is int and 0 <= stage < num_stages and stage_ranks[stage] == r
                        and (kind is opt or (type(mb) is int and 0 <= mb < num_microbatches
                                             and (kind is not w or split_backward)
                                             and kind is not send and kind is not recv))):
                    _check_action(r, i, a, h, num_stages, num_microbatches, stage_ranks, split_backward)
                if out_of_order is None:  # a stage's actions all come from its rank: ``seen`` is what it ran
                    out_of_order = _order_error(r, i, a, h, seen, num_microbatches, kinds)
            for h in halves:  # both halves of an FB are checked against what came before the pair
                key = h[:3]
                if key[0] is not send and key[0] is not recv:
                    if key in seen:
                        what = "OPT" if key[0] is opt else f"{key[0].value} of micro-batch {key[2]}"
                        raise fail(r, i, a, f"stage {key[1]} runs {what} twice")
                    seen[key] = (r, i, a)
    if len(seen) != num_stages * (len(kinds) * num_microbatches + 1):  # each is checked, and none twice
        _check_complete(seen, num_stages, num_microbatches, stage_ranks, kinds)
    if out_of_order is not None:
        raise out_of_order
    execute(schedule, num_stages, lambda a: 0.0, collectives)


def _order_error(r: int, i: int, a: Action, h: Action, seen: dict[tuple, tuple], num_microbatches: int,
                 kinds: tuple[Kind, ...]) -> ScheduleError | None:
    """Per stage and micro-batch F < B (< W), and every B (and W) before the stage's OPT: the error if
    ``h`` (``a`` or a half of the FB ``a``) comes too early on its rank."""
    kind = h[0]
    if kind is Kind.B or kind is Kind.W:
        first = Kind.F if kind is Kind.B else Kind.B
        if (first, h[1], h[2]) not in seen:
            return fail(r, i, a, f"{kind.value} of micro-batch {h.microbatch} comes before its {first.value} on "
                                 f"stage {h.stage}")
    elif kind is Kind.OPT:
        late = [mb for mb in range(num_microbatches) if (kinds[-1], h.stage, mb) not in seen]
        if late:
            return fail(r, i, a, f"OPT of stage {h.stage} comes before its {kinds[-1].value} of micro-batch {late[0]}")
    return None


def _check_complete(seen: dict[tuple, tuple], num_stages: int, num_microbatches: int, stage_ranks: list[int],
                    kinds: tuple[Kind, ...]) -> None:
    """Raise naming the first stage that lacks an action, and which."""
    for s in range(num_stages):
        for k in kinds:
            missing = [mb for mb in range(num_microbatches) if (k, s, mb) not in seen]
            if missing:
                mbs = f"micro-batch{'es' * (len(missing) > 1)} {', '.join(map(str, missing))}"
                raise ScheduleError(f"stage {s} lacks {k.value} of {mbs}", stage_ranks[s])
        if (Kind.OPT, s, None) not in seen:
            raise ScheduleError(f"stage {s} lacks its OPT", stage_ranks[s])


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
