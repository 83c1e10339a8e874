"""staticpipe.io under misuse: each mistake a loader's user can make with readers, flags, samplers and
batches is an error whose message names the culprit (the method, the reader, the feed variable, the batch),
raised where the mistake shows, in a thread or a producer process alike."""
from __future__ import annotations

import re
import traceback

import pytest

from staticpipe._paddle import np, paddle
from staticpipe.io import DataLoader, FeedSpec, split_microbatches
from test_io import image_label, samples
from test_io_dataset import Samples

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def program():
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        yield


def gen():
    yield from samples(2)


def forgot_yield():
    samples(2)


def returns_a_dict():
    return {"image": 0, "label": 1}


def returns_an_int():
    return 7


def yields_a_dict():
    yield samples(2)
    yield {"image": 0}


def yields_an_int():
    yield 3


def no_fields(what):
    return (f"expected a tuple/list of 2 fields per {what} (feed variables ['image', 'label']) or a dict keyed by "
            "them, received None of type NoneType")


def where(msg):
    """``msg`` as a pattern, each ``{at}`` where a reader is defined: ``(test_io_misuse.py:<line>)``."""
    return re.escape(msg).replace(re.escape("{at}"), r"\(test_io_misuse\.py:\d+\)")


# -- at set_*_generator: the reader itself


@pytest.mark.parametrize("method", ["set_sample_generator", "set_sample_list_generator", "set_batch_generator"])
def test_a_generator_object_instead_of_its_function(method):
    args = (gen(), 2) if method == "set_sample_generator" else (gen(),)
    msg = (f"{method}: reader must be a callable returning an iterator, got the iterator <generator object gen at "
           "0x")
    with pytest.raises(TypeError, match=re.escape(msg) + r".*pass the generator function \(reader=gen, not gen\(\)\)"):
        getattr(DataLoader.from_generator(image_label()), method)(*args)


def test_an_iterator_instead_of_a_callable():
    with pytest.raises(TypeError, match=re.escape("set_batch_generator: reader must be a callable returning an "
                                                  "iterator, got the iterator <list_iterator")):
        DataLoader.from_generator(image_label()).set_batch_generator(iter([]))


@pytest.mark.parametrize("reader", [42, [(1, 2)], None])
def test_a_reader_that_is_not_callable(reader):
    msg = (f"set_sample_list_generator: reader must be a callable returning an iterator (e.g. a generator "
           f"function), got {reader!r}")
    with pytest.raises(TypeError, match=re.escape(msg)):
        DataLoader.from_generator(image_label()).set_sample_list_generator(reader)


# -- on the producer: what reader() returns and yields


@pytest.mark.parametrize("use_multiprocess", [False, True], ids=["thread", "process"])
@pytest.mark.parametrize(
    "method, reader, msg",
    [
        ("set_sample_generator", forgot_yield, "set_sample_generator's reader forgot_yield {at} returned None of type "
         "NoneType, not an iterable of samples: make it a generator function (yield samples one by one) or return an "
         "iterator"),
        ("set_batch_generator", returns_a_dict, "set_batch_generator's reader returns_a_dict {at} returned "
         "{'image': 0, 'label': 1} of type dict, not an iterable of batches"),
        ("set_sample_list_generator", returns_an_int, "set_sample_list_generator's reader returns_an_int {at} returned "
         "7 of type int, not an iterable of lists of samples"),
        ("set_sample_list_generator", yields_a_dict, "set_sample_list_generator's reader yields_a_dict {at} yielded "
         "{'image': 0} of type dict as batch 1, not a list of samples (a reader of whole batches is for "
         "set_batch_generator)"),
        ("set_sample_list_generator", yields_an_int, "set_sample_list_generator's reader yields_an_int {at} yielded 3 "
         "of type int as batch 0, not a list of samples"),
    ],
)
def test_what_the_reader_returns_or_yields(method, reader, msg, use_multiprocess):
    loader = DataLoader.from_generator(image_label(), use_multiprocess=use_multiprocess)
    getattr(loader, method)(*((reader, 2) if method == "set_sample_generator" else (reader,)))
    with pytest.raises(TypeError, match=where(msg)) as info:
        list(loader)
    producer = "producer process" if use_multiprocess else "generator, on its prefetch thread"
    assert producer in "".join(traceback.format_exception(info.value))
    assert loader.last_epoch.failed


# -- batches: the feed variable, the batch and its maker named


def two_feeds_loader(batch):
    return DataLoader.from_generator(image_label()).set_batch_generator(lambda: iter([batch]))


@pytest.mark.parametrize(
    "batch, msg",
    [
        (np.zeros((2, 3, 4, 4), np.float32), "expected a tuple/list of 2 fields per batch (feed variables ['image', "
         "'label']) or a dict keyed by them, received array([[[[0.,...dtype=float32) of type ndarray"),
        (None, no_fields("batch")),
        ((np.zeros((2, 3, 4, 4), np.float32), None), "feed variable 'label': received None, which is not an array of "
         "numbers (numpy reads it as objects: it holds a None or another value that is not a number)"),
        ((np.zeros((2, 3, 4, 4), np.float32), [[1], [2, 3]]), "feed variable 'label': received [[1], [2, 3]], which "
         "is not an array of numbers (setting an array element with a sequence."),
        ((np.zeros((2, 3, 4, 4), np.float32), "ab"), "feed variable 'label': expected shape [-1, 1] (batch, ...), "
         "received shape ()"),
    ],
)
def test_a_batch_of_the_wrong_kind_names_the_variable_and_the_batch(batch, msg):
    with pytest.raises(ValueError, match=re.escape(msg)) as info:
        list(two_feeds_loader(batch))
    assert info.value.__notes__[-1] == ("(checking batch 0 of the DataLoader's epoch, made by set_batch_generator's "
                                        "reader)")


def test_a_ragged_sample_names_the_variable_and_the_sample():
    x = paddle.static.data("x", [None, 2], "float32")
    loader = DataLoader.from_generator([x]).set_sample_generator(lambda: iter([([0.0, 1.0],), ([[1.0], 2.0],)]), 2)
    msg = "feed variable 'x': sample 1 of the batch is [[1.0], 2.0], which is not an array of numbers"
    with pytest.raises(ValueError, match=re.escape(msg)) as info:
        list(loader)
    assert info.value.__notes__ == ["(checking batch 0 of the DataLoader's epoch, made by set_sample_generator's "
                                    "reader)"]


def test_the_executor_feed_check_names_a_none_value():
    spec = FeedSpec("x", (-1, 2), np.dtype("float32"))
    with pytest.raises(ValueError, match=re.escape("feed variable 'x': received None, which is not an array of "
                                                   "numbers")):
        spec.convert(None)


# -- flags and counts that are not what they look like


@pytest.mark.parametrize("name", ["iterable", "return_list", "use_multiprocess", "drop_last"])
def test_from_generator_flags_must_be_bools(name):
    with pytest.raises(ValueError, match=re.escape(f"{name} must be True or False, got 'False'")):
        DataLoader.from_generator(image_label(), **{name: "False"})


def test_sample_generator_drop_last_and_batch_size():
    loader = DataLoader.from_generator(image_label())
    with pytest.raises(ValueError, match=re.escape("drop_last must be True or False, got 0")):
        loader.set_sample_generator(gen, 2, drop_last=0)
    with pytest.raises(ValueError, match=re.escape("batch_size must be a positive integer, got True")):
        loader.set_sample_generator(gen, True)
    with pytest.raises(ValueError, match=re.escape("capacity must be a positive integer (batches prefetched), got "
                                                   "True")):
        DataLoader.from_generator(image_label(), capacity=True)
    with pytest.raises(ValueError, match=re.escape("num_microbatches must be a positive integer, got True")):
        split_microbatches({"x": np.zeros((2, 1))}, True)


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"return_list": "yes"}, "return_list must be True or False, got 'yes'"),
        ({"batch_size": True}, "batch_size must be a positive integer, got True"),
        ({"num_workers": True}, "num_workers must be an integer >= 0, got True"),
        ({"timeout": True}, "timeout must be a number of seconds >= 0 (0: wait for ever), got True"),
    ],
)
def test_dataset_loader_flags_and_counts(kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        DataLoader(Samples(4), feed_list=image_label(), **kwargs)


# -- dataset loaders: the sampler, collate_fn and samples named


@pytest.mark.parametrize("batch_sampler, shown", [([0, 1], "0"), ([[0], "ab"], "'ab'")])
def test_a_batch_sampler_that_yields_no_index_lists(batch_sampler, shown):
    loader = DataLoader(Samples(4), feed_list=image_label(), batch_sampler=batch_sampler)
    number = 0 if shown == "0" else 1
    msg = f"the DataLoader's batch_sampler yielded {shown} as batch {number}, not a list of sample indices"
    with pytest.raises(TypeError, match=re.escape(msg)):
        list(loader)
    assert loader.last_epoch is None  # refused before the epoch began


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_collate_fn_returning_nothing_is_named(num_workers):
    loader = DataLoader(Samples(4), feed_list=image_label(), batch_size=2, collate_fn=lambda batch: None,
                        num_workers=num_workers)
    with pytest.raises(ValueError, match=re.escape(no_fields("batch"))) as info:
        list(loader)
    assert info.value.__notes__ == ["(checking batch 0 of the DataLoader's epoch, made by the dataset's collate_fn)"]


class NoneSamples(Samples):
    def __getitem__(self, index):
        return None if index == 2 else super().__getitem__(index)


def test_a_sample_of_none_names_the_indices():
    loader = DataLoader(NoneSamples(4), feed_list=image_label(), batch_size=2)
    with pytest.raises(ValueError, match=re.escape(no_fields("sample"))) as info:
        list(loader)
    assert "(collating the DataLoader batch of sample indices [2, 3] of its dataset)" in info.value.__notes__


class FloatLabels(Samples):
    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image, label.astype(np.float32)


def test_a_dataset_sample_of_the_wrong_dtype_names_the_default_collate():
    loader = DataLoader(FloatLabels(2), feed_list=image_label(), batch_size=2)
    with pytest.raises(ValueError, match=re.escape("feed variable 'label': expected dtype int64, received float32")) \
            as info:
        list(loader)
    assert info.value.__notes__ == ["(checking batch 0 of the DataLoader's epoch, made of the dataset's samples by "
                                    "the default collate)"]
