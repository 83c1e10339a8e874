"""Text and JSON forms of actions and schedules: printing, parsing, round trips, and their errors."""
from __future__ import annotations

import re

import pytest

from schedule_util import CASES, chain_routes
from staticpipe.schedule import (Action, Kind, canonical_name, format_schedule, get_kind, lower, make_schedule,
                                 one_f_one_b, parse_action, parse_schedule, schedule_from_json, schedule_to_json)

pytestmark = pytest.mark.timeout(120)


def test_action_objects_and_format():
    sched = one_f_one_b(2, 2)
    assert sched[0] == [Action(Kind.F, 0, 0), Action(Kind.F, 0, 1), Action(Kind.B, 0, 0), Action(Kind.B, 0, 1),
                        Action(Kind.OPT, 0)]
    assert sched[0][-1].microbatch is None
    assert format_schedule(sched) == "rank 0: 0F0 0F1 0B0 0B1 0OPT\nrank 1: 1F0 1B0 1F1 1B1 1OPT"
    assert str(Action(Kind.SEND, 2, 5, route=3, peer=1, channel="B")) == "2SEND_B5>1"
    assert str(Action(Kind.RECV, 1, 0, route=0, peer=0, channel="FB")) == "1RECV_FB0<0"


@pytest.mark.parametrize("name, p, m, v", [c for c in CASES if c[2] <= 2 * c[1]])
def test_round_trips(name, p, m, v):
    sched = make_schedule(name, p, m, v)
    assert parse_schedule(format_schedule(sched)) == sched
    assert schedule_from_json(schedule_to_json(sched)) == sched
    lowered = lower(sched, chain_routes(p * v))
    assert schedule_from_json(schedule_to_json(lowered)) == lowered  # JSON keeps the routes
    # the text names a message by its stages and channel only, not its route index
    assert parse_schedule(format_schedule(lowered)) == {
        r: [a._replace(route=None) for a in acts] for r, acts in lowered.items()}


def test_action_kind_from_text():
    assert Action("F", 0, 1) == Action(Kind.F, 0, 1) and Action("OPT", 2).kind is Kind.OPT
    with pytest.raises(ValueError, match="'X' is not a valid Kind"):
        Action("X", 0, 1)


def test_action_text():
    for text, action in [("0F3", Action(Kind.F, 0, 3)), ("12B0", Action(Kind.B, 12, 0)),
                         ("0W5", Action(Kind.W, 0, 5)), ("3OPT", Action(Kind.OPT, 3)),
                         ("0SEND_F3>1", Action(Kind.SEND, 0, 3, peer=1, channel="F")),
                         ("1RECV_FB3<0", Action(Kind.RECV, 1, 3, peer=0, channel="FB")),
                         ("2SEND_B10>1", Action(Kind.SEND, 2, 10, peer=1, channel="B"))]:
        assert parse_action(text) == action and str(action) == text
    assert schedule_to_json({0: [Action(Kind.SEND, 0, 3, 2, 1, "F"), Action(Kind.OPT, 0)]}) == (
        '{"0": [{"kind": "SEND", "stage": 0, "microbatch": 3, "route": 2, "peer": 1, "channel": "F"}, '
        '{"kind": "OPT", "stage": 0}]}')


@pytest.mark.parametrize("text", ["0X3", "F3", "0F", "0OPT1", "0SEND_F3<1", "1RECV_F3>0", "0SEND_X3>1", "", " 0F3"])
def test_bad_action_text(text):
    message = f"not an action: {text!r} (expected e.g. 0F3, 1B0, 0W5, 0OPT, 0F3&7B1, 0SEND_F3>1, 1RECV_F3<0)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_action(text)


def test_bad_schedule_text():
    assert parse_schedule("\nrank 1: 1F0 1B0\n\nrank 0:\n") == {1: [Action(Kind.F, 1, 0), Action(Kind.B, 1, 0)], 0: []}
    with pytest.raises(ValueError, match=re.escape("not a schedule line: 'stage 0: 0F0' (expected 'rank <n>: <actions>')")):
        parse_schedule("stage 0: 0F0")
    with pytest.raises(ValueError, match=re.escape("rank 0 has two lines")):
        parse_schedule("rank 0: 0F0\nrank 0: 0B0")
    with pytest.raises(ValueError, match=re.escape("not an action: '0Q0'")):
        parse_schedule("rank 0: 0F0 0Q0")
    with pytest.raises(ValueError, match=re.escape("not an action: {'kind': 'Z', 'stage': 0}")):
        schedule_from_json('{"0": [{"kind": "Z", "stage": 0}]}')
    with pytest.raises(ValueError, match=re.escape("a JSON schedule is an object mapping each rank to a list")):
        schedule_from_json('[1, 2]')


UNRANKED = ("the custom schedule {!r} has no 'rank <n>:' lines: give each rank's actions on a line of its own, "
            "'rank <n>: <actions>' (e.g. 'rank 0: 0F0 0F1 0B0 0B1 0OPT')")


@pytest.mark.parametrize("text", ["0F0 0F1 0B0 0B1 0OPT", "0F0 0B0 0OPT\n1F0 1B0 1OPT", " 0F0 0B0 0OPT ",
                                  "rank0: 0F0 0B0 0OPT", "Rank 0: 0F0 0B0 0OPT", "0F0&1B0 0OPT"])
def test_schedule_text_without_rank_lines_is_refused_as_such_not_as_an_unknown_name(text):
    """A schedule name that reads as two or more actions is a custom schedule whose ``rank <n>:`` lines are
    missing."""
    for call in (canonical_name, get_kind, lambda t: make_schedule(t, 2, 4)):
        with pytest.raises(ValueError, match=f"^{re.escape(UNRANKED.format(text))}$"):
            call(text)


def test_schedule_text_whose_rank_lines_do_not_come_first_names_the_first_line():
    message = "not a schedule line: '# by hand' (expected 'rank <n>: <actions>')"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        canonical_name("# by hand\nrank 0: 0F0 0B0 0OPT")
