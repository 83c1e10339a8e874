"""The action IR: what one rank (device) does, step by step, for one training step.

A schedule is plain data: ``{rank: [Action, ...]}``. Compute actions are F (forward of a micro-batch),
B (backward: activation gradients, or the whole backward when it is not split), W (weight gradients,
the deferrable second half of a split backward) and OPT (the once-per-step optimizer update of one
stage). Lowering adds SEND and RECV actions that move a route's cut variables between stages. Every
action names its *global* stage; the dict key is the rank that runs it. The runtime executes any valid
list; it knows no schedule.

FB is one F and one B paired on a rank, of different micro-batches (DualPipe's overlapped "F&B"). Why
one action and not two: the pair is the schedule's unit -- both halves' inputs are received before it
starts and both halves' outputs sent after it ends, so a device able to overlap the two computations
(and their messages) gets them as one decision, and the simulator can price the pair on its own
(``{"FB": 1.5}``). ``stage``/``microbatch`` are its F half's, ``b_stage``/``b_microbatch`` its B half's;
``halves()`` gives the two, and every check counts them as the F and the B they are. Neither half may
depend on the other. The runtime here runs them back to back.

Actions have a text form (``0F3``, ``1B0``, ``0W5``, ``0OPT``, ``0F3&7B1``, ``0SEND_F3>1``,
``1RECV_F3<0``) so schedules can be printed, written by hand and read back, and a JSON form that also
keeps the route.
"""
from __future__ import annotations

import json
import re
from collections import namedtuple
from enum import Enum


class Kind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    OPT = "OPT"
    SEND = "SEND"
    RECV = "RECV"
    FB = "FB"


COMPUTE_KINDS = (Kind.F, Kind.B)  # the kinds that run a per-micro-batch section with cut variables
COMM_KINDS = (Kind.SEND, Kind.RECV)
CHANNELS = ("F", "B", "FB")


_Fields = namedtuple("Action", "kind stage microbatch route peer channel b_stage b_microbatch",
                     defaults=(None, None, None, "", None, None))


class Action(_Fields):
    """One step of one rank.

    For SEND/RECV, ``route`` is the plan's route index, ``peer`` the other *stage* and ``channel`` what
    travels ("F" activations, "B" gradients, "FB" forward values to a backward section). For FB,
    ``b_stage`` and ``b_microbatch`` are the backward half's.

    Why a tuple: a schedule at the sizes users run (64 ranks, 1024 micro-batches) holds hundreds of
    thousands of actions, and the generators, the validator and the simulator make and look up each one
    several times; a tuple is made, hashed and compared in C, three to four times faster than a frozen
    dataclass (measured), and pickles without help.
    """

    __slots__ = ()

    def __new__(cls, kind: Kind | str, stage: int, microbatch: int | None = None, route: int | None = None,
                peer: int | None = None, channel: str = "", b_stage: int | None = None,
                b_microbatch: int | None = None) -> "Action":
        if type(kind) is not Kind:
            kind = Kind(kind)  # "F" -> Kind.F, so ``is`` tests hold
        return tuple.__new__(cls, (kind, stage, microbatch, route, peer, channel, b_stage, b_microbatch))

    def __str__(self) -> str:
        if self.kind is Kind.OPT:
            return f"{self.stage}OPT"
        if self.kind is Kind.SEND:
            return f"{self.stage}SEND_{self.channel}{self.microbatch}>{self.peer}"
        if self.kind is Kind.RECV:
            return f"{self.stage}RECV_{self.channel}{self.microbatch}<{self.peer}"
        if self.kind is Kind.FB:
            return f"{self.stage}F{self.microbatch}&{self.b_stage}B{self.b_microbatch}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def key(self) -> tuple:
        """(kind, stage, micro-batch): what names a compute action in the schedulers' and the dry run's
        tables, cheaper to build and hash than an Action where thousands are looked up."""
        return self[:3]

    def halves(self) -> tuple["Action", ...]:
        """What the action computes, as F/B/W/OPT actions: an FB's F and B halves, else the action itself."""
        if self.kind is Kind.FB:
            return F(self.stage, self.microbatch), B(self.b_stage, self.b_microbatch)
        return (self,)


_new = tuple.__new__  # the constructors below know their kind: no conversion to check


def F(stage: int, mb: int) -> Action:
    return _new(Action, (Kind.F, stage, mb, None, None, "", None, None))


def B(stage: int, mb: int) -> Action:
    return _new(Action, (Kind.B, stage, mb, None, None, "", None, None))


def W(stage: int, mb: int) -> Action:
    return _new(Action, (Kind.W, stage, mb, None, None, "", None, None))


def OPT(stage: int) -> Action:
    return _new(Action, (Kind.OPT, stage, None, None, None, "", None, None))


def FB(stage: int, mb: int, b_stage: int, b_mb: int) -> Action:
    return Action(Kind.FB, stage, mb, b_stage=b_stage, b_microbatch=b_mb)


Schedule = dict[int, list[Action]]

_COMPUTE_RE = re.compile(r"(\d+)([FBW])(\d+)")
_PAIR_RE = re.compile(r"(\d+)F(\d+)&(\d+)B(\d+)")
_OPT_RE = re.compile(r"(\d+)OPT")
_COMM_RE = re.compile(r"(\d+)(SEND|RECV)_(FB|F|B)(\d+)([<>])(\d+)")


def parse_action(text: str) -> Action:
    """The action whose ``str`` is ``text``. The text of a SEND/RECV does not name its route, so the
    result has ``route=None``; JSON keeps routes."""
    if m := _COMPUTE_RE.fullmatch(text):
        return Action(Kind(m[2]), int(m[1]), int(m[3]))
    if m := _OPT_RE.fullmatch(text):
        return OPT(int(m[1]))
    if m := _PAIR_RE.fullmatch(text):
        return FB(*map(int, m.groups()))
    if (m := _COMM_RE.fullmatch(text)) and m[5] == (">" if m[2] == "SEND" else "<"):
        return Action(Kind(m[2]), int(m[1]), int(m[4]), peer=int(m[6]), channel=m[3])
    raise ValueError(f"not an action: {text!r} (expected e.g. 0F3, 1B0, 0W5, 0OPT, 0F3&7B1, 0SEND_F3>1, 1RECV_F3<0)")


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: ``rank 0: 0F0 0F1 0B0 ...``."""
    return "\n".join(f"rank {r}:" + "".join(f" {a}" for a in acts) for r, acts in sorted(schedule.items()))


_LINE_RE = re.compile(r"rank (\d+):(.*)")


def parse_schedule(text: str) -> Schedule:
    """The schedule ``format_schedule`` printed as ``text`` (blank lines are ignored)."""
    schedule: Schedule = {}
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        m = _LINE_RE.fullmatch(line.strip())
        if m is None:
            raise ValueError(f"not a schedule line: {line!r} (expected 'rank <n>: <actions>')")
        rank = int(m[1])
        if rank in schedule:
            raise ValueError(f"rank {rank} has two lines")
        schedule[rank] = [parse_action(t) for t in m[2].split()]
    return schedule


def check_unranked_text(text: str) -> None:
    """``ValueError`` if ``text``, no schedule's name, reads as a custom schedule whose ``rank <n>:`` lines are
    missing (two or more actions) or do not come first (``parse_schedule`` names the line at fault)."""
    if any(_LINE_RE.fullmatch(line.strip()) for line in text.splitlines()):
        parse_schedule(text)
        return
    if sum(1 for token in text.split() if _is_action(token)) >= 2:
        raise ValueError(f"the custom schedule {text!r} has no 'rank <n>:' lines: give each rank's actions on a line "
                         "of its own, 'rank <n>: <actions>' (e.g. 'rank 0: 0F0 0F1 0B0 0B1 0OPT')")


def _is_action(text: str) -> bool:
    try:
        parse_action(text)
    except ValueError:
        return False
    return True


_FIELDS = ("microbatch", "route", "peer", "b_stage", "b_microbatch")


def schedule_to_json(schedule: Schedule) -> str:
    """``{"<rank>": [{"kind": "F", "stage": 0, "microbatch": 3}, ...]}``; unset fields are left out."""
    def entry(a: Action) -> dict:
        d = {"kind": a.kind.value, "stage": a.stage}
        d.update((f, getattr(a, f)) for f in _FIELDS if getattr(a, f) is not None)
        return d | ({"channel": a.channel} if a.channel else {})
    return json.dumps({str(r): [entry(a) for a in acts] for r, acts in sorted(schedule.items())})


def schedule_from_json(text: str) -> Schedule:
    """The schedule ``schedule_to_json`` wrote."""
    def action(d: dict) -> Action:
        try:
            return Action(Kind(d["kind"]), d["stage"], channel=d.get("channel", ""), **{f: d.get(f) for f in _FIELDS})
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"not an action: {d!r}") from e
    data = json.loads(text)
    if not isinstance(data, dict) or not all(isinstance(acts, list) for acts in data.values()):
        raise ValueError("a JSON schedule is an object mapping each rank to a list of actions")
    return {int(r): [action(d) for d in acts] for r, acts in data.items()}
