"""staticpipe.io: what an epoch gave (``loader.last_epoch``: batches, samples, samples dropped as a partial
batch, complete or failed), so that a training loop can say why it got no batch; and a non-iterable epoch
read again before ``reset()`` is an error, after Paddle's one ``EOFException``."""
from __future__ import annotations

import re

import pytest

from staticpipe._paddle import core, np, paddle
from staticpipe.io import DataLoader, EpochStats
from test_io import image_label, infinite_reader, samples
from test_io_dataset import Samples, Stream

pytestmark = pytest.mark.timeout(60)

ENDED = "the DataLoader's epoch has ended: call loader.reset() and loader.start() before the next one"


@pytest.fixture(autouse=True)
def program():
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        yield


def sample_loader(n, batch_size, drop_last=True, use_multiprocess=False, **kwargs):
    loader = DataLoader.from_generator(image_label(), use_multiprocess=use_multiprocess, **kwargs)
    return loader.set_sample_generator(lambda: iter(samples(n)), batch_size, drop_last=drop_last)


# -- last_epoch


@pytest.mark.parametrize("use_multiprocess", [False, True], ids=["thread", "process"])
@pytest.mark.parametrize(
    "n, batch_size, drop_last, want",
    [
        (0, 4, True, EpochStats(0, 0, 0, complete=True)),  # a generator that yields nothing
        (3, 4, True, EpochStats(0, 3, 3, complete=True)),  # too few samples for one batch: all dropped
        (3, 4, False, EpochStats(1, 3, 0, complete=True)),
        (10, 4, True, EpochStats(2, 10, 2, complete=True)),
        (10, 4, False, EpochStats(3, 10, 0, complete=True)),
        (8, 4, True, EpochStats(2, 8, 0, complete=True)),
    ],
)
def test_sample_generator_epochs_are_counted(n, batch_size, drop_last, want, use_multiprocess):
    loader = sample_loader(n, batch_size, drop_last, use_multiprocess)
    assert loader.last_epoch is None and loader.batch_size == batch_size
    assert len(list(loader)) == want.batches
    assert loader.last_epoch == want


def test_the_counts_run_with_the_epoch_and_restart_with_the_next():
    loader = sample_loader(10, 4)
    it = loader.epoch()
    next(it)
    assert loader.last_epoch == EpochStats(1, 4, 0, complete=False)
    list(it)
    assert loader.last_epoch == EpochStats(2, 10, 2, complete=True)
    it = loader.epoch()
    assert loader.last_epoch.complete  # nothing starts before the first batch is asked for
    next(it)
    assert loader.last_epoch == EpochStats(1, 4, 0)
    it.close()


def test_an_epoch_stopped_early_is_neither_complete_nor_failed():
    loader = DataLoader.from_generator(image_label(), capacity=2).set_sample_generator(infinite_reader, 2)
    for _ in loader:
        break
    assert loader.last_epoch == EpochStats(1, 2, 0, complete=False, failed=False)


def test_an_old_iterator_does_not_count_into_the_new_epoch():
    loader = sample_loader(8, 2)
    old = loader.epoch()
    next(old)
    new = loader.epoch()
    next(new)
    assert list(old) == []  # ended by the new epoch
    assert loader.last_epoch == EpochStats(1, 2, 0, complete=False)
    assert len(list(new)) == 3 and loader.last_epoch == EpochStats(4, 8, 0, complete=True)


def test_a_failed_epoch_is_marked_failed():
    def reader():
        yield from samples(2)
        raise KeyError("corrupt")

    loader = DataLoader.from_generator(image_label(), iterable=False).set_sample_generator(reader, 1)
    loader.start()
    loader.next_batch(), loader.next_batch()
    with pytest.raises(KeyError):
        loader.next_batch()
    with pytest.raises(core.EOFException):
        loader.next_batch()
    assert loader.last_epoch == EpochStats(2, 2, 0, complete=False, failed=True)
    loader.reset()


def test_a_batch_that_fails_its_check_marks_the_epoch_failed_and_names_its_maker():
    bad = (np.zeros((2, 3, 4, 4), np.float32), np.zeros((2, 1), np.float32))
    good = (np.zeros((2, 3, 4, 4), np.float32), np.zeros((2, 1), np.int64))
    loader = DataLoader.from_generator(image_label()).set_batch_generator(lambda: iter([good, bad]))
    with pytest.raises(ValueError, match="expected dtype int64, received float32") as info:
        list(loader)
    assert info.value.__notes__ == ["(checking batch 1 of the DataLoader's epoch, made by set_batch_generator's "
                                    "reader)"]
    assert loader.last_epoch == EpochStats(1, 2, 0, complete=False, failed=True)


@pytest.mark.parametrize("setter", ["sample_list", "batch"])
def test_batch_readers_count_their_rows_and_drop_nothing(setter):
    data = samples(5)
    loader = DataLoader.from_generator(image_label())
    if setter == "sample_list":
        loader.set_sample_list_generator(lambda: iter([data[:3], data[3:]]))
    else:
        loader.set_batch_generator(lambda: iter([[np.stack(c) for c in zip(*data[:3])]]))
    list(loader)
    assert loader.last_epoch == (EpochStats(2, 5, 0, True) if setter == "sample_list" else EpochStats(1, 3, 0, True))
    assert loader.batch_size is None


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_map_dataset_counts_what_drop_last_drops(num_workers, shuffle):
    loader = DataLoader(Samples(11), feed_list=image_label(), batch_size=4, shuffle=shuffle, drop_last=True,
                        num_workers=num_workers)
    assert len(list(loader)) == 2 and loader.batch_size == 4
    assert loader.last_epoch == EpochStats(2, 11, 3, complete=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_smaller_than_one_batch_gives_an_empty_epoch_that_says_so(num_workers):
    loader = DataLoader(Samples(3), feed_list=image_label(), batch_size=4, drop_last=True, num_workers=num_workers)
    assert list(loader) == []
    assert loader.last_epoch == EpochStats(0, 3, 3, complete=True)


def test_a_given_batch_sampler_drops_nothing_the_loader_sees():
    loader = DataLoader(Samples(6), feed_list=image_label(), batch_sampler=[[0, 1], [2]])
    list(loader)
    assert loader.last_epoch == EpochStats(2, 3, 0, complete=True) and loader.batch_size is None


@pytest.mark.parametrize("drop_last, want", [(True, EpochStats(2, 10, 2, True)), (False, EpochStats(3, 10, 0, True))])
def test_iterable_dataset_counts(drop_last, want):
    loader = DataLoader(Stream(10), feed_list=image_label(), batch_size=4, drop_last=drop_last)
    list(loader)
    assert loader.last_epoch == want


# -- a non-iterable epoch read again before reset()


def started(n=4, batch_size=2, **kwargs):
    loader = sample_loader(n, batch_size, iterable=False, **kwargs)
    loader.start()
    return loader


@pytest.mark.parametrize("use_multiprocess", [False, True], ids=["thread", "process"])
def test_next_batch_raises_eof_once_then_a_clear_error(use_multiprocess):
    loader = started(use_multiprocess=use_multiprocess)
    loader.next_batch(), loader.next_batch()
    with pytest.raises(core.EOFException):
        loader.next_batch()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=re.escape(ENDED)):
            loader.next_batch()
        with pytest.raises(RuntimeError, match=re.escape(ENDED)):
            loader.epoch()
    loader.reset()
    loader.start()
    assert len(list(loader.epoch())) == 2
    loader.reset()


def test_an_epoch_read_to_its_end_is_refused_not_read_again_as_empty():
    """``train_from_dataset`` twice without ``reset()`` reads ``epoch()`` twice."""
    loader = started()
    assert len(list(loader.epoch())) == 2
    with pytest.raises(RuntimeError, match=re.escape(ENDED)):
        loader.epoch()
    with pytest.raises(RuntimeError, match=re.escape(ENDED)):
        list(loader)
    with pytest.raises(core.EOFException):  # the drain swallowed its EOF: Paddle's loop still gets one
        loader.next_batch()
    with pytest.raises(RuntimeError, match=re.escape(ENDED)):
        loader.next_batch()
    loader.reset()


def test_a_partly_read_epoch_can_be_read_on():
    loader = started(n=6)
    loader.next_batch()
    assert len(list(loader.epoch())) == 2  # the rest
    assert loader.last_epoch == EpochStats(3, 6, 0, complete=True)
    loader.reset()


def test_a_generator_that_yields_nothing_gives_eof_at_once_and_counts_nothing():
    loader = started(n=0)
    with pytest.raises(core.EOFException):
        loader.next_batch()
    assert loader.last_epoch == EpochStats(0, 0, 0, complete=True)
    loader.reset()
    assert loader.last_epoch == EpochStats(0, 0, 0, complete=True)  # kept after reset, for the caller to read
