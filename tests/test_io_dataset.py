"""staticpipe.io's dataset loader: ``paddle.io.DataLoader``'s signature and meaning (its BatchSampler's
order, collate, worker processes in sampler order, IterableDataset), and its errors."""
from __future__ import annotations

import inspect
import multiprocessing
import os
import re
import time
import traceback

import pytest

from staticpipe._paddle import np, paddle
from staticpipe.io import DataLoader
from test_io import assert_batches_equal, image_label, samples, stacked

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def program():
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        yield


class Samples(paddle.io.Dataset):
    """n (image, label) samples whose values are their index; ``fail_at``: that index raises, ``exit_at``:
    that index ends the process (a worker dying)."""

    def __init__(self, n, fail_at=None, exit_at=None, as_dict=False):
        self.data, self.fail_at, self.exit_at, self.as_dict = samples(n), fail_at, exit_at, as_dict

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        if index == self.fail_at:
            raise KeyError(f"corrupt record {index}")
        if index == self.exit_at:
            os._exit(3)
        image, label = self.data[index]
        return {"label": label, "image": image} if self.as_dict else (image, label)


class Stream(paddle.io.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(samples(self.n))


def labels(batches):
    return [b["label"].ravel().tolist() for b in batches]


LATER = {"reader_buffer_size"}  # parameters a newer Paddle added (3.x); the newest signature is ours


def test_signature_is_paddles():
    ours = inspect.signature(DataLoader.__init__).parameters
    paddles = inspect.signature(paddle.io.DataLoader.__init__).parameters
    added_since = LATER - set(paddles)
    assert [(p.name, p.default) for p in ours.values() if p.name not in added_since] == [
        (p.name, p.default) for p in paddles.values()]


@pytest.mark.parametrize("as_dict", [False, True])
def test_batches_in_order_and_return_list(as_dict):
    data = samples(5)
    loader = DataLoader(Samples(5, as_dict=as_dict), feed_list=image_label(), batch_size=2)
    want = [stacked(data[:2]), stacked(data[2:4]), stacked(data[4:])]
    assert len(loader) == 3 and loader.iterable and not loader.started
    got = list(loader)  # return_list=True, Paddle's default for this constructor
    assert [type(b) for b in got] == [list] * 3
    assert_batches_equal([dict(zip(["image", "label"], b)) for b in got], want)
    assert_batches_equal(list(loader.epoch()), want)
    loader = DataLoader(Samples(5), feed_list=image_label(), batch_size=2, drop_last=True, return_list=False)
    assert_batches_equal(list(loader()), want[:2])


def test_shuffle_follows_paddles_batch_sampler_for_a_fixed_seed():
    dataset = Samples(10)
    np.random.seed(7)
    want = [list(paddle.io.BatchSampler(dataset, batch_size=3, shuffle=True)) for _ in range(2)]
    np.random.seed(7)
    loader = DataLoader(dataset, feed_list=image_label(), batch_size=3, shuffle=True)
    assert [labels(loader.epoch()) for _ in range(2)] == want
    assert want[0] != want[1]


def test_workers_give_the_batches_of_num_workers_0():
    got = {}
    for num_workers in (0, 2):
        np.random.seed(3)
        loader = DataLoader(Samples(11), feed_list=image_label(), batch_size=2, shuffle=True, drop_last=True,
                            num_workers=num_workers, prefetch_factor=1)
        got[num_workers] = [list(loader.epoch()) for _ in range(2)]
    assert_batches_equal(got[2][0] + got[2][1], got[0][0] + got[0][1])
    assert labels(got[0][0]) != labels(got[0][1])
    assert [p for p in multiprocessing.active_children() if p.name == "staticpipe.io.DataLoader"] == []


WORKER = {"id": None}


def remember_worker(worker_id):
    WORKER["id"] = worker_id


class WhichWorker(paddle.io.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, index):
        return np.array([index], np.int64), np.array([WORKER["id"]], np.int64)


def test_worker_init_fn_gets_each_workers_id_and_workers_take_batches_round_robin():
    x = paddle.static.data("x", [None, 1], "int64")
    worker = paddle.static.data("worker", [None, 1], "int64")
    loader = DataLoader(WhichWorker(), feed_list=[x, worker], batch_size=1, num_workers=2,
                        worker_init_fn=remember_worker, return_list=False)
    got = [(int(b["x"][0, 0]), int(b["worker"][0, 0])) for b in loader]
    assert got == [(i, i % 2) for i in range(6)]
    assert WORKER["id"] is None  # the parent never ran it


def test_collate_fn_and_batch_sampler():
    data = samples(6)

    def collate_fn(batch):
        assert isinstance(batch, list) and len(batch) in (1, 3)
        return {"image": np.stack([s[0] for s in batch]), "label": np.stack([s[1] for s in batch])}

    loader = DataLoader(Samples(6), feed_list=image_label(), batch_sampler=[[5, 0, 1], [3]],
                        collate_fn=collate_fn, num_workers=1)
    assert_batches_equal(list(loader.epoch()), [stacked([data[5], data[0], data[1]]), stacked([data[3]])])


@pytest.mark.parametrize("drop_last, sizes", [(False, [4, 4, 2]), (True, [4, 4])])
def test_iterable_dataset(drop_last, sizes):
    data = samples(10)
    loader = DataLoader(Stream(10), feed_list=image_label(), batch_size=4, drop_last=drop_last)
    assert_batches_equal(list(loader.epoch()), [stacked(data[i : i + 4]) for i in range(0, sum(sizes), 4)])
    with pytest.raises(TypeError, match="IterableDataset has no len"):
        len(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_error_names_the_sample_index(num_workers):
    loader = DataLoader(Samples(8, fail_at=5), feed_list=image_label(), batch_size=2, num_workers=num_workers)
    it = loader.epoch()
    next(it), next(it)
    with pytest.raises(KeyError, match="corrupt record 5") as info:
        next(it)
    text = "".join(traceback.format_exception(info.value))
    assert "(loading sample index 5 of the DataLoader's dataset)" in text
    thread = "raised in the staticpipe DataLoader's dataset, on its prefetch thread"
    assert ("raised in staticpipe DataLoader worker 0, pid" if num_workers else thread) in text  # batch 2: worker 0's


def test_default_collate_error_names_the_batch():
    loader = DataLoader(Samples(3), feed_list=image_label()[:1], batch_size=3)
    with pytest.raises(ValueError, match=re.escape("expected 1 fields per sample (feed variables ['image']), "
                                                   "received 2")) as info:
        list(loader)
    assert "(collating the DataLoader batch of sample indices [0, 1, 2] of its dataset)" in info.value.__notes__


def test_dead_worker_is_an_error_naming_it():
    loader = DataLoader(Samples(8, exit_at=3), feed_list=image_label(), batch_size=1, num_workers=2)
    with pytest.raises(RuntimeError, match=r"staticpipe DataLoader worker 1 \(pid \d+\) died with exit code 3 "):
        list(loader)


class Slow(Samples):
    def __getitem__(self, index):
        time.sleep(1.0)
        return super().__getitem__(index)


def test_timeout_bounds_the_wait_for_a_worker():
    loader = DataLoader(Slow(2), feed_list=image_label(), num_workers=1, timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker 0 \(pid \d+\) sent no batch within timeout=0.2 s"):
        list(loader)
    assert time.monotonic() - t0 < 1.0


def test_a_dataset_loader_is_iterable_and_has_no_generator():
    loader = DataLoader(Samples(2), feed_list=image_label())
    with pytest.raises(RuntimeError, match=re.escape("start() is for non-iterable loaders (iterable=False)")):
        loader.start()
    msg = ("set_batch_generator is for loaders made by DataLoader.from_generator; this loader reads its dataset "
           "(Samples)")
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        loader.set_batch_generator(lambda: iter(()))


@pytest.mark.parametrize(
    "kwargs, error, msg",
    [
        ({"feed_list": None}, ValueError, "feed_list is required in static mode"),
        ({"batch_sampler": [[0]], "batch_size": 2}, ValueError,
         "batch_sampler is given, so batch_size, shuffle and drop_last must keep their defaults (1, False, False), "
         "got batch_size=2, shuffle=False, drop_last=False: the batch sampler decides them"),
        ({"batch_size": None}, ValueError, "batch_size=None (the dataset yields whole batches) is not supported"),
        ({"batch_size": 0}, ValueError, "batch_size must be a positive integer, got 0"),
        ({"num_workers": -1}, ValueError, "num_workers must be an integer >= 0, got -1"),
        ({"prefetch_factor": 0}, ValueError, "prefetch_factor must be an integer >= 1, got 0"),
        ({"timeout": -1}, ValueError, "timeout must be a number of seconds >= 0"),
        ({"shuffle": 1}, ValueError, "shuffle must be True or False, got 1"),
        ({"dataset": [1, 2]}, None, None),  # a plain sequence serves, as with Paddle
        ({"dataset": 3}, TypeError, "dataset must be a paddle.io.Dataset (__getitem__ and __len__) or a "
                                    "paddle.io.IterableDataset, got int"),
        ({"dataset": Stream(4), "num_workers": 2}, ValueError,
         "num_workers=2 with a paddle.io.IterableDataset: every worker process would replay the whole dataset "
         "(staticpipe does not shard it by worker); use num_workers=0"),
        ({"dataset": Stream(4), "shuffle": True}, ValueError, "shuffle=True with a paddle.io.IterableDataset"),
    ],
)
def test_constructor_errors(kwargs, error, msg):
    args = {"dataset": Samples(4), "feed_list": image_label(), **kwargs}
    if error is None:
        DataLoader(**args)
        return
    with pytest.raises(error, match=re.escape(msg)):
        DataLoader(**args)
