"""gc_paused: the collector is off inside, back as it was after the last holder leaves (nested, threads, errors)."""
import gc
import threading

import pytest

from staticpipe.gc_paused import gc_paused
from staticpipe.schedule import make_schedule


@pytest.fixture(autouse=True)
def collector_on():
    gc.enable()
    yield
    gc.enable()


def test_off_inside_and_back_after_nested_holds_and_an_error():
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer hold is still there
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with gc_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off():
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_two_threads_overlapping_share_one_hold():
    inside, leave, seen = threading.Event(), threading.Event(), []

    def hold():
        with gc_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    with gc_paused():
        pass
    seen.append(gc.isenabled())  # the other thread still holds it
    leave.set()
    t.join(10)
    assert seen == [False] and gc.isenabled()


def test_schedule_generation_holds_it_and_gives_it_back():
    states = []
    real = gc.disable

    def spy():
        states.append("off")
        real()
    gc.disable = spy
    try:
        make_schedule("1F1B", 2, 4)
    finally:
        gc.disable = real
    assert states == ["off"] and gc.isenabled()
