"""staticpipe.io: batching, both loader modes, error messages, prefetch-thread lifetime, microbatch splits."""
from __future__ import annotations

import inspect
import re
import threading
import time
import traceback

import pytest

from staticpipe._paddle import core, np, paddle
from staticpipe.io import DataLoader, FeedSpec, split_microbatches

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def program():
    paddle.enable_static()
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        yield


def image_label():
    return [paddle.static.data("image", [None, 3, 4, 4], "float32"), paddle.static.data("label", [None, 1], "int64")]


def samples(n):
    """n (image, label) samples whose values identify them."""
    return [(np.full((3, 4, 4), i, np.float32), np.array([i], np.int64)) for i in range(n)]


def stacked(sample_list):
    return {
        "image": np.stack([s[0] for s in sample_list]),
        "label": np.stack([s[1] for s in sample_list]),
    }


def assert_batches_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for name in w:
            assert g[name].dtype == w[name].dtype
            np.testing.assert_array_equal(g[name], w[name])


ENDED = "the DataLoader's epoch has ended: call loader.reset() and loader.start() before the next one"


def producer_threads():
    return [t for t in threading.enumerate() if t.name == "staticpipe.io.DataLoader"]


# -- construction


def test_feed_specs():
    loader = DataLoader.from_generator(image_label())
    assert loader.feed_specs == [
        FeedSpec("image", (-1, 3, 4, 4), np.dtype("float32")),
        FeedSpec("label", (-1, 1), np.dtype("int64")),
    ]
    # Paddle's defaults: iterable=True (it was False before Paddle 2), return_list=False, a thread producer
    assert loader.capacity == 64 and loader.use_double_buffer and loader.iterable and loader.drop_last
    assert not loader.return_list and not loader.use_multiprocess


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"feed_list": []}, "feed_list"),
        ({"feed_list": ["image"]}, "feed_list"),
        ({"capacity": 0}, "capacity"),
    ],
)
def test_constructor_errors(kwargs, word):
    args = {"feed_list": image_label(), **kwargs}
    with pytest.raises(ValueError, match=word):
        DataLoader.from_generator(**args)


def test_batch_size_error():
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader.from_generator(image_label()).set_sample_generator(lambda: iter(()), 0)


# -- generators (iterable mode)


@pytest.mark.parametrize("drop_last, sizes", [(True, [4, 4]), (False, [4, 4, 2])])
def test_sample_generator(drop_last, sizes):
    data = samples(10)
    loader = DataLoader.from_generator(image_label(), iterable=True)
    assert loader.set_sample_generator(lambda: iter(data), 4, drop_last=drop_last) is loader
    got = list(loader)
    assert [b["image"].shape[0] for b in got] == sizes
    assert_batches_equal(got, [stacked(data[i : i + 4]) for i in range(0, sum(sizes), 4)])


def test_sample_generator_single_var_bare_values_and_python_lists():
    x = paddle.static.data("x", [None, 2], "float32")
    loader = DataLoader.from_generator([x], iterable=True)
    loader.set_sample_generator(lambda: iter([np.array([0, 1]), (np.array([2.0, 3.0]),), ([4.5, 5.5],)]), 3)
    (batch,) = list(loader)
    np.testing.assert_array_equal(batch["x"], np.array([[0, 1], [2, 3], [4.5, 5.5]], np.float32))
    assert batch["x"].dtype == np.float32


def test_sample_list_generator():
    data = samples(6)
    loader = DataLoader.from_generator(image_label(), iterable=True)
    loader.set_sample_list_generator(lambda: iter([data[:2], data[2:6]]))
    assert_batches_equal(list(loader), [stacked(data[:2]), stacked(data[2:6])])


def test_empty_sample_list_error():
    loader = DataLoader.from_generator(image_label()).set_sample_list_generator(lambda: iter([[]]))
    with pytest.raises(ValueError, match=re.escape("cannot make a batch of an empty list of samples")):
        list(loader)


def test_batch_generator_tuple_and_dict():
    want = [stacked(samples(3)), stacked(samples(5))]
    feeds = [(want[0]["image"], want[0]["label"]), {"label": want[1]["label"], "image": want[1]["image"]}]
    loader = DataLoader.from_generator(image_label(), iterable=True).set_batch_generator(lambda: iter(feeds))
    assert_batches_equal(list(loader), want)


def test_python_lists_converted_to_feed_dtypes():
    x = paddle.static.data("x", [None, 2], "float32")
    y = paddle.static.data("y", [None], "int64")
    loader = DataLoader.from_generator([x, y], iterable=True)
    loader.set_batch_generator(lambda: iter([([[1, 2], [3.5, 4]], [7, 8])]))
    (batch,) = list(loader)
    assert batch["x"].dtype == np.float32 and batch["y"].dtype == np.int64
    np.testing.assert_array_equal(batch["y"], [7, 8])


def test_iterable_epochs_restart_and_call_is_iter():
    data = samples(4)
    loader = DataLoader.from_generator(image_label(), iterable=True).set_sample_generator(lambda: iter(data), 2)
    for _ in range(2):
        assert_batches_equal(list(loader), [stacked(data[:2]), stacked(data[2:])])
    assert_batches_equal(list(loader()), [stacked(data[:2]), stacked(data[2:])])
    assert_batches_equal(list(loader.epoch()), [stacked(data[:2]), stacked(data[2:])])


def test_no_generator_set():
    loader = DataLoader.from_generator(image_label(), iterable=True)
    msg = "call set_sample_generator, set_sample_list_generator or set_batch_generator"
    with pytest.raises(RuntimeError, match=msg):
        iter(loader)
    with pytest.raises(RuntimeError, match=msg):
        DataLoader.from_generator(image_label(), iterable=False).start()


# -- non-iterable mode


def test_non_iterable_start_next_eof_reset_cycles():
    data = samples(6)
    loader = DataLoader.from_generator(image_label(), iterable=False).set_sample_generator(lambda: iter(data), 3)
    for _ in range(3):
        loader.start()
        got = [loader.next_batch(), loader.next_batch()]
        assert_batches_equal(got, [stacked(data[:3]), stacked(data[3:])])
        with pytest.raises(core.EOFException):  # once, as Paddle's
            loader.next_batch()
        with pytest.raises(RuntimeError, match=re.escape(ENDED)):  # a loop that missed the EOF
            loader.next_batch()
        loader.reset()


def test_non_iterable_iter_and_epoch_stop_at_eof():
    data = samples(4)
    loader = DataLoader.from_generator(image_label(), iterable=False).set_sample_generator(lambda: iter(data), 2)
    loader.start()
    assert_batches_equal(list(loader), [stacked(data[:2]), stacked(data[2:])])
    loader.reset()
    loader.start()
    assert_batches_equal(list(loader.epoch()), [stacked(data[:2]), stacked(data[2:])])
    loader.reset()


def test_non_iterable_runtime_errors():
    loader = DataLoader.from_generator(image_label(), iterable=False)
    loader.set_sample_generator(lambda: iter(samples(2)), 1)
    not_started = "DataLoader is not started: call loader.start() before training (non-iterable mode)"
    with pytest.raises(RuntimeError, match=re.escape(not_started)):
        loader.next_batch()
    with pytest.raises(RuntimeError, match=re.escape(not_started)):
        loader.epoch()
    loader.start()
    with pytest.raises(RuntimeError, match="already started"):
        loader.start()
    loader.reset()
    loader.reset()  # idempotent
    with pytest.raises(RuntimeError, match=re.escape(not_started)):
        loader.next_batch()


# -- validation errors (raised on the consumer's thread)


def one_batch_loader(batch, iterable=True):
    return DataLoader.from_generator(image_label(), iterable=iterable).set_batch_generator(lambda: iter([batch]))


def test_shape_error_message():
    batch = (np.zeros((64, 3, 28, 28), np.float32), np.zeros((64, 1), np.int64))
    loader = DataLoader.from_generator(
        [paddle.static.data("image", [None, 3, 32, 32], "float32"), paddle.static.data("label", [None, 1], "int64")],
        iterable=True,
    ).set_batch_generator(lambda: iter([batch]))
    msg = "feed variable 'image': expected shape [-1, 3, 32, 32] (batch, ...), received shape (64, 3, 28, 28)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        list(loader)


def test_rank_error_message():
    loader = one_batch_loader((np.zeros((2, 3, 4, 4), np.float32), np.zeros((2,), np.int64)))
    msg = "feed variable 'label': expected shape [-1, 1] (batch, ...), received shape (2,)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        list(loader)


def test_dtype_error_message():
    loader = one_batch_loader((np.zeros((2, 3, 4, 4), np.float32), np.zeros((2, 1), np.float32)), iterable=False)
    loader.start()
    with pytest.raises(ValueError, match=re.escape("feed variable 'label': expected dtype int64, received float32")):
        loader.next_batch()
    loader.reset()


def test_field_count_errors():
    loader = one_batch_loader((np.zeros((2, 3, 4, 4), np.float32),))
    msg = "expected 2 fields per batch (feed variables ['image', 'label']), received 1"
    with pytest.raises(ValueError, match=re.escape(msg)):
        list(loader)
    loader = DataLoader.from_generator(image_label(), iterable=True)
    loader.set_sample_generator(lambda: iter([(1, 2, 3)]), 1)
    msg = "expected 2 fields per sample (feed variables ['image', 'label']), received 3"
    with pytest.raises(ValueError, match=re.escape(msg)):
        list(loader)


def test_dict_key_errors():
    loader = one_batch_loader({"image": np.zeros((2, 3, 4, 4), np.float32), "lbl": np.zeros((2, 1), np.int64)})
    msg = "batch dict keys must be the feed variables ['image', 'label']: missing ['label'], not feed variables ['lbl']"
    with pytest.raises(ValueError, match=re.escape(msg)):
        list(loader)


def test_ragged_samples_error():
    x = paddle.static.data("x", [None, -1], "float32")
    loader = DataLoader.from_generator([x], iterable=True)
    loader.set_sample_generator(lambda: iter([np.zeros(2), np.zeros(3)]), 2)
    with pytest.raises(ValueError, match=re.escape("feed variable 'x': samples of one batch have different shapes")):
        list(loader)


# -- the producer thread


def failing_reader():
    yield from samples(2)
    raise KeyError("corrupt record 7")


@pytest.mark.parametrize("iterable", [True, False])
@pytest.mark.parametrize("use_multiprocess", [False, True])
def test_generator_exception_keeps_type_and_traceback(iterable, use_multiprocess):
    loader = DataLoader.from_generator(image_label(), iterable=iterable, use_multiprocess=use_multiprocess)
    loader.set_sample_generator(failing_reader, 1)
    if not iterable:
        loader.start()
    it = loader.epoch()
    next(it), next(it)
    with pytest.raises(KeyError, match="corrupt record 7") as info:
        next(it)
    text = "".join(traceback.format_exception(info.value))
    assert "failing_reader" in text  # with a producer process: the child's frame, from its traceback
    assert ("raised in the staticpipe DataLoader's producer process, pid" if use_multiprocess
            else "DataLoader's generator") in text
    loader.reset()


def infinite_reader():
    i = 0
    while True:
        yield np.full((3, 4, 4), i, np.float32), np.array([i], np.int64)
        i += 1


@pytest.mark.parametrize("iterable", [True, False])
def test_early_reset_stops_producer_promptly(iterable):
    loader = DataLoader.from_generator(image_label(), capacity=2, iterable=iterable)
    loader.set_sample_generator(infinite_reader, 2)
    if not iterable:
        loader.start()
    it = loader.epoch()
    first = next(it)
    np.testing.assert_array_equal(first["label"], [[0], [1]])
    time.sleep(0.1)  # let the producer fill the queue and block on put
    (thread,) = producer_threads()
    t0 = time.monotonic()
    loader.reset()
    assert time.monotonic() - t0 < 1.0
    assert not thread.is_alive()


def test_abandoned_iteration_stops_producer():
    loader = DataLoader.from_generator(image_label(), capacity=2, iterable=True)
    loader.set_sample_generator(infinite_reader, 2)
    for _ in loader:
        (thread,) = producer_threads()
        break
    assert not thread.is_alive()  # the for loop dropped the generator, whose cleanup stopped the thread


def test_new_epoch_ends_previous_one():
    loader = DataLoader.from_generator(image_label(), capacity=2, iterable=True)
    loader.set_sample_generator(infinite_reader, 2)
    old = iter(loader)
    next(old)
    (old_thread,) = producer_threads()
    new = iter(loader)
    np.testing.assert_array_equal(next(new)["label"], [[0], [1]])
    assert not old_thread.is_alive()
    assert list(old) == []
    loader.reset()
    assert producer_threads() == []


# -- split_microbatches


def test_split_microbatches_exact_views():
    batch = {"image": np.arange(24.0).reshape(8, 3), "label": np.arange(8)}
    parts = split_microbatches(batch, 4)
    assert len(parts) == 4
    for i, part in enumerate(parts):
        np.testing.assert_array_equal(part["image"], batch["image"][2 * i : 2 * i + 2])
        np.testing.assert_array_equal(part["label"], [2 * i, 2 * i + 1])
        assert np.shares_memory(part["image"], batch["image"])
    assert split_microbatches(batch, 1)[0]["label"].shape == (8,)


@pytest.mark.parametrize(
    "size, n, hint",
    [(30, 8, "e.g. 24 or 32"), (5, 8, "e.g. 8")],
)
def test_split_microbatches_not_divisible(size, n, hint):
    batch = {"image": np.zeros((size, 3)), "label": np.zeros(size)}
    msg = (
        f"batch size {size} of feed variable 'image' is not divisible by num_microbatches={n}; "
        f"use a batch size that is a multiple of {n} ({hint})"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        split_microbatches(batch, n)


def test_split_microbatches_errors():
    msg = "feed variables 'image' and 'label' have different batch sizes (8 and 4)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        split_microbatches({"image": np.zeros((8, 3)), "label": np.zeros(4)}, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        split_microbatches({"image": np.zeros((8, 3))}, 0)


# -- Paddle's from_generator signature and defaults


def test_from_generator_signature_is_paddles():
    from paddle.base.reader import DataLoader as PaddleDataLoader

    ours = inspect.signature(DataLoader.from_generator).parameters
    paddles = inspect.signature(PaddleDataLoader.from_generator).parameters
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in paddles.values()]


def test_feed_list_is_required():
    msg = ("feed_list is required in static mode: pass the paddle.static.data variables the loader feeds, "
           "e.g. feed_list=[image, label]")
    with pytest.raises(ValueError, match=re.escape(msg)):
        DataLoader.from_generator()


def test_capacity_none_is_the_default_capacity():
    assert DataLoader.from_generator(image_label(), capacity=None).capacity == DataLoader.DEFAULT_CAPACITY == 64


@pytest.mark.parametrize("use_multiprocess", [False, True])
def test_return_list_yields_lists_in_feed_order_and_epoch_yields_dicts(use_multiprocess):
    data = samples(4)
    loader = DataLoader.from_generator(image_label(), return_list=True, use_multiprocess=use_multiprocess)
    loader.set_sample_generator(lambda: iter(data), 2, places=paddle.CPUPlace())  # places: accepted, ignored
    want = [stacked(data[:2]), stacked(data[2:])]
    for got in (list(loader), list(loader())):
        assert [type(b) for b in got] == [list, list]
        assert_batches_equal([dict(zip(["image", "label"], b)) for b in got], want)
    assert_batches_equal(list(loader.epoch()), want)


def test_places_accepted_by_every_generator_setter():
    want = [stacked(samples(2))]
    loader = DataLoader.from_generator(image_label())
    loader.set_sample_list_generator(lambda: iter([samples(2)]), places=[paddle.CPUPlace()])
    assert_batches_equal(list(loader), want)
    loader.set_batch_generator(lambda: iter([(want[0]["image"], want[0]["label"])]), places=None)
    assert_batches_equal(list(loader), want)
