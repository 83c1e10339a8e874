"""staticpipe.io's producer process (``use_multiprocess=True``): the thread path's batches, its errors
carried across (same type, the child's traceback), a dead child named by its exit code, prompt stops,
and Ctrl-C left to the parent."""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
import time
import traceback

import pytest

from staticpipe._paddle import core, np, paddle
from staticpipe.io import DataLoader
from test_io import assert_batches_equal, image_label, infinite_reader, samples, stacked

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def program():
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        yield


def producers():
    return [p for p in multiprocessing.active_children() if p.name == "staticpipe.io.DataLoader"]


def loader_of(reader, batch_size=1, use_multiprocess=True, **kwargs):
    loader = DataLoader.from_generator(image_label(), use_multiprocess=use_multiprocess, **kwargs)
    return loader.set_sample_generator(reader, batch_size)


def dead_message(pid, code):
    return f"the staticpipe DataLoader's producer process (pid {pid}) died with exit code {code}"


@pytest.mark.parametrize("setter", ["sample", "sample_list", "batch"])
def test_batches_equal_the_thread_path(setter):
    data = samples(7)
    want = [stacked(data[:3]), stacked(data[3:6]), stacked(data[6:])]
    got = {}
    for use_multiprocess in (False, True):
        loader = DataLoader.from_generator(image_label(), capacity=2, use_multiprocess=use_multiprocess)
        if setter == "sample":
            loader.set_sample_generator(lambda: iter(data), 3, drop_last=False)
        elif setter == "sample_list":
            loader.set_sample_list_generator(lambda: iter([data[:3], data[3:6], data[6:]]))
        else:
            loader.set_batch_generator(lambda: ((b["image"], b["label"]) for b in want))
        got[use_multiprocess] = [list(loader), list(loader)]  # two epochs
    assert_batches_equal(got[True][0] + got[True][1], want + want)
    assert_batches_equal(got[False][0] + got[False][1], got[True][0] + got[True][1])
    assert producers() == []


def test_non_iterable_start_next_eof_reset_cycles():
    data = samples(4)
    loader = loader_of(lambda: iter(data), 2, iterable=False)
    for _ in range(2):
        loader.start()
        assert_batches_equal([loader.next_batch(), loader.next_batch()], [stacked(data[:2]), stacked(data[2:])])
        with pytest.raises(core.EOFException):
            loader.next_batch()
        loader.reset()
    assert producers() == []


class TwoArgError(Exception):
    """Cannot be rebuilt from its pickle (its args are one value, its __init__ wants two)."""

    def __init__(self, what, where):
        super().__init__(f"{what} at {where}")


def test_exception_that_cannot_cross_becomes_a_runtime_error_with_its_text():
    def reader():
        raise TwoArgError("bad record", 3)
        yield

    with pytest.raises(RuntimeError, match=r"producer process \(pid \d+\) raised TwoArgError: bad record at 3") as info:
        list(loader_of(reader))
    assert "in reader" in str(info.value)  # the child's traceback


def test_item_that_cannot_be_pickled_fails_in_the_child():
    x = paddle.static.data("x", [None, 1], "float32")
    loader = DataLoader.from_generator([x], use_multiprocess=True)
    loader.set_batch_generator(lambda: iter([lambda: None]))
    with pytest.raises(Exception, match="pickle") as info:
        list(loader)
    assert "producer process" in "".join(traceback.format_exception(info.value))


def test_killed_producer_is_an_error_naming_its_exit_code():
    loader = loader_of(infinite_reader, 2, capacity=2)
    it = loader.epoch()
    next(it)
    (child,) = producers()
    os.kill(child.pid, signal.SIGKILL)
    msg = dead_message(child.pid, -9) + " (killed by signal SIGKILL) before the end of its epoch"
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        for _ in it:  # what reached the pipe before the kill, then the error: never a hang
            pass


def test_producer_that_exits_is_an_error_naming_its_exit_code():
    def reader():
        yield from samples(1)
        os._exit(3)

    loader = loader_of(reader, iterable=False)
    loader.start()
    (child,) = producers()
    with pytest.raises(RuntimeError, match=re.escape(dead_message(child.pid, 3))):
        while True:
            loader.next_batch()
    with pytest.raises(core.EOFException):  # and the epoch is over
        loader.next_batch()
    loader.reset()


@pytest.mark.parametrize("iterable", [True, False])
def test_early_reset_ends_the_child_promptly(iterable):
    loader = loader_of(infinite_reader, 2, capacity=2, iterable=iterable)
    if not iterable:
        loader.start()
    it = loader.epoch()
    np.testing.assert_array_equal(next(it)["label"], [[0], [1]])
    time.sleep(0.1)  # let the child fill its queue and block
    (child,) = producers()
    t0 = time.monotonic()
    loader.reset()
    assert time.monotonic() - t0 < 1.0
    assert not child.is_alive()
    assert not loader.started


def test_abandoned_iteration_ends_the_child():
    loader = loader_of(infinite_reader, 2, capacity=2)
    for _ in loader:
        (child,) = producers()
        break
    assert not child.is_alive()


def test_ctrl_c_reaches_the_consumer_and_the_child_ignores_it():
    def reader():
        yield from samples(1)
        time.sleep(30)
        yield from samples(1)

    loader = loader_of(reader)
    it = iter(loader)
    next(it)
    (child,) = producers()
    os.kill(child.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole process group
    time.sleep(0.2)
    assert child.is_alive()
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):  # also if this thread is slow to get to next(it): the
        timer.start()  # interrupt must not escape the test (pytest would end the whole session)
        next(it)
    timer.join()
    assert time.monotonic() - t0 < 2.0
    assert not child.is_alive()  # the interrupted epoch's cleanup ended it


_COLLECT_IN_CHILD = []  # set while the test below runs: a collection inside every fork, as Python may make one


def _collect_in_child():
    if _COLLECT_IN_CHILD:
        import gc
        gc.collect()


os.register_at_fork(after_in_child=_collect_in_child)


def test_what_the_parent_left_unreachable_is_never_finalized_in_the_child(tmp_path):
    """The first collection in a forked child may run inside the fork (threading's after-fork hook
    allocates), before any code of the producer: it must not finalize the parent's garbage there, on a copy
    of the parent's state without its threads (a paddle.io loader's BufferedReader left by an earlier test
    waited for its reader thread for ever, and the child hung). Simulated by a collection at every fork."""
    import gc

    class Witness:
        def __del__(self):
            (tmp_path / str(os.getpid())).touch()

    gc.disable()
    _COLLECT_IN_CHILD.append(True)
    try:
        witness = Witness()
        witness.cycle = witness  # only a collection frees it
        del witness
        loader = loader_of(lambda: iter(samples(2)), 2)
        for _ in loader:
            (child,) = producers()
            child_pid = child.pid
        gc.enable()
        gc.collect()  # the parent finalizes it
    finally:
        _COLLECT_IN_CHILD.clear()
        gc.enable()
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(os.getpid())], f"the child was pid {child_pid}"
