"""staticpipe.io: a ``KeyboardInterrupt`` or ``SystemExit`` raised by the user's data code (a generator, a
Dataset's ``__getitem__``, a ``collate_fn``) reaches the consumer as that same exception, from the prefetch
thread and from producer processes alike, and the loader ends cleanly: ``reset()`` works and the next epoch
runs. The producer process itself still ignores the terminal's Ctrl-C (tests/test_io_process.py)."""
from __future__ import annotations

import multiprocessing
import re
import threading

import pytest

from staticpipe._paddle import core, paddle
from staticpipe.io import DataLoader
from test_io import assert_batches_equal, image_label, samples, stacked
from test_io_dataset import Samples

pytestmark = pytest.mark.timeout(60)

ENDED = "the DataLoader's epoch has ended: call loader.reset() and loader.start() before the next one"


@pytest.fixture(autouse=True)
def program():
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        yield


def no_producers_left():
    threads = [t for t in threading.enumerate() if t.name == "staticpipe.io.DataLoader" and t.is_alive()]
    processes = [p for p in multiprocessing.active_children() if p.name == "staticpipe.io.DataLoader"]
    return threads == [] and processes == []


class Raising:
    """A reader that yields two samples, then raises ``make()`` while ``armed`` (set in the parent, so that a
    producer process forked later sees it)."""

    def __init__(self, make):
        self.make, self.armed = make, True

    def __call__(self):
        yield from samples(2)
        if self.armed:
            raise self.make()


ERRORS = [lambda: KeyboardInterrupt("stop"), lambda: SystemExit(3)]


@pytest.mark.parametrize("use_multiprocess", [False, True], ids=["thread", "process"])
@pytest.mark.parametrize("error", ERRORS, ids=["KeyboardInterrupt", "SystemExit"])
def test_iterable_loader_raises_it_and_runs_the_next_epoch(error, use_multiprocess, capsys):
    loader = DataLoader.from_generator(image_label(), use_multiprocess=use_multiprocess)
    reader = Raising(error)
    loader.set_sample_generator(reader, 1)
    got = []
    with pytest.raises(type(error())) as info:
        for batch in loader:
            got.append(batch)
    assert len(got) == 2 and info.value.args == error().args
    where = "producer process, pid" if use_multiprocess else "generator, on its prefetch thread"
    assert any(where in note for note in info.value.__notes__)
    assert loader.last_epoch.failed and not loader.last_epoch.complete and loader.last_epoch.batches == 2
    assert no_producers_left()
    assert "Traceback" not in capsys.readouterr().err  # handed over, not printed by a dying thread
    reader.armed = False
    assert_batches_equal(list(loader.epoch()), [stacked(samples(2)[:1]), stacked(samples(2)[1:])])
    assert loader.last_epoch.complete


@pytest.mark.parametrize("use_multiprocess", [False, True], ids=["thread", "process"])
@pytest.mark.parametrize("error", ERRORS, ids=["KeyboardInterrupt", "SystemExit"])
def test_non_iterable_loader_raises_it_then_eof_then_resets(error, use_multiprocess):
    loader = DataLoader.from_generator(image_label(), iterable=False, use_multiprocess=use_multiprocess)
    reader = Raising(error)
    loader.set_sample_generator(reader, 2)
    loader.start()
    loader.next_batch()
    with pytest.raises(type(error())):
        loader.next_batch()
    with pytest.raises(core.EOFException):  # the epoch is over, as after any error of the source
        loader.next_batch()
    with pytest.raises(RuntimeError, match=re.escape(ENDED)):
        loader.next_batch()
    loader.reset()
    assert no_producers_left()
    reader.armed = False
    loader.start()
    assert_batches_equal(list(loader.epoch()), [stacked(samples(2))])
    loader.reset()


class Interrupting(Samples):
    """Sample 3 raises KeyboardInterrupt while ``armed``."""

    armed = True

    def __getitem__(self, index):
        if index == 3 and self.armed:
            raise KeyboardInterrupt("in __getitem__")
        return super().__getitem__(index)


def exiting_collate(batch):
    raise SystemExit("in collate_fn")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_getitem_keyboard_interrupt_names_the_sample(num_workers):
    dataset = Interrupting(6)
    loader = DataLoader(dataset, feed_list=image_label(), batch_size=2, num_workers=num_workers)
    with pytest.raises(KeyboardInterrupt, match="in __getitem__") as info:
        list(loader)
    assert "(loading sample index 3 of the DataLoader's dataset)" in info.value.__notes__
    assert no_producers_left()
    dataset.armed = False  # the workers of the next epoch are forked from now
    assert len(list(loader)) == 3 and loader.last_epoch.complete


@pytest.mark.parametrize("num_workers", [0, 1])
def test_dataset_collate_fn_system_exit_names_the_batch(num_workers):
    loader = DataLoader(Samples(4), feed_list=image_label(), batch_size=2, collate_fn=exiting_collate,
                        num_workers=num_workers)
    with pytest.raises(SystemExit, match="in collate_fn") as info:
        list(loader)
    assert "(collating the DataLoader batch of sample indices [0, 1] of its dataset)" in info.value.__notes__
    assert no_producers_left()


def test_a_worker_init_fn_error_names_it():
    def init(worker_id):
        raise KeyboardInterrupt(f"init {worker_id}")

    loader = DataLoader(Samples(4), feed_list=image_label(), batch_size=1, num_workers=2, worker_init_fn=init)
    with pytest.raises(KeyboardInterrupt, match="init 0") as info:
        list(loader)
    assert "(in the DataLoader's worker_init_fn(0))" in info.value.__notes__
