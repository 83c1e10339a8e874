"""staticpipe's generator loaders feed as Paddle's own do, side by side on the same program and samples.

Paddle's ``DataLoader.from_generator`` makes a sample (or sample-list) generator's batches through its
``DataFeeder``: stacked, cast to the variable's dtype, reshaped to the variable's shape when the dims
differ in number (``paddle.dataset.mnist`` yields flat 784-float images for a [-1, 1, 28, 28] variable
and int labels for a [-1, 1] one). A batch generator's batches are fed as given. Each case runs Paddle's
loader and staticpipe's and compares every array (values, shape, dtype), or checks both refuse.
"""
from __future__ import annotations

import pytest

from staticpipe._paddle import core, np, paddle
from staticpipe.io import DataLoader

pytestmark = pytest.mark.timeout(60)

CASES = {  # name -> a sample i as (pixel, label), for pixel [-1, 1, 2, 2] float32 and label [-1, 1] int64
    "flat image, int label": lambda i: (np.arange(4, dtype=np.float32) + i, i),
    "lists of float64, float label (truncated)": lambda i: ((np.arange(4, dtype=np.float64) / 3).tolist(), i + 0.7),
    "int image": lambda i: (np.arange(4, dtype=np.int64) * i, np.int32(i)),
    "shaped as the variables": lambda i: (np.full((1, 2, 2), i, np.float32), np.array([i])),
    "label with an extra dim": lambda i: (np.full((1, 2, 2), i, np.float32), np.array([[i]])),
    "bool image": lambda i: (np.array([True, False, i % 2 == 0, True]), i),
}


def variables():
    return [paddle.static.data("pixel", [-1, 1, 2, 2], "float32"), paddle.static.data("label", [-1, 1], "int64")]


def feed(method: str, reader_of, loader_kind: str):
    """The batches a ``loader_kind`` ("paddle" or "staticpipe") loader feeds for ``method``."""
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        if loader_kind == "paddle":
            loader = paddle.base.io.DataLoader.from_generator(feed_list=variables(), capacity=4, iterable=True)
        else:
            loader = DataLoader.from_generator(feed_list=variables(), capacity=4, iterable=True)
        place = paddle.CPUPlace()
        if method == "set_sample_generator":
            loader.set_sample_generator(lambda: (reader_of(i) for i in range(4)), batch_size=2, places=place)
        else:
            loader.set_sample_list_generator(lambda: ([reader_of(i), reader_of(i + 1)] for i in (0, 2)), places=place)
        out = []
        for batch in loader():
            batch = batch[0] if isinstance(batch, list) else batch
            out.append({name: np.array(value) for name, value in batch.items()})
        return out


@pytest.mark.parametrize("method", ["set_sample_generator", "set_sample_list_generator"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_generator_batches_equal_paddles(method, case):
    want = feed(method, CASES[case], "paddle")
    got = feed(method, CASES[case], "staticpipe")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w) == ["label", "pixel"]
        for name in w:
            assert (g[name].shape, g[name].dtype) == (w[name].shape, w[name].dtype), (name, g[name], w[name])
            np.testing.assert_array_equal(g[name], w[name])


def test_a_sample_that_cannot_take_the_variables_shape_is_refused_with_paddles_reason():
    with pytest.raises(ValueError) as err:
        feed("set_sample_generator", lambda i: (np.ones(5, np.float32), i), "staticpipe")
    assert str(err.value) == ("feed variable 'pixel': Reshape error. What is defined in data layer is (-1, 1, 2, 2), "
                              "but receive (2, 5) (a batch of 2 samples; Paddle's DataFeeder reshapes a batch whose "
                              "dims differ in number from the variable's, and fails alike)")
    with pytest.raises(Exception, match=r"Reshape error|killed"):  # Paddle's: raised on its reader thread
        feed("set_sample_generator", lambda i: (np.ones(5, np.float32), i), "paddle")


def test_samples_with_as_many_dims_but_other_sizes_are_refused_as_paddles_executor_refuses_them():
    with pytest.raises(ValueError) as err:
        feed("set_sample_generator", lambda i: (np.ones((1, 2, 3), np.float32), i), "staticpipe")
    assert str(err.value) == "feed variable 'pixel': expected shape [-1, 1, 2, 2] (batch, ...), received shape (2, 1, 2, 3)"


def test_a_batch_generator_is_fed_as_given():
    """Paddle feeds a batch generator's arrays as they are: a flat batch is refused, not reshaped."""
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        loader = DataLoader.from_generator(feed_list=variables(), capacity=4, iterable=True)
        loader.set_batch_generator(lambda: iter([(np.ones((2, 4), np.float32), np.zeros((2, 1), np.int64))]),
                                   places=core.CPUPlace())
        with pytest.raises(ValueError, match=r"^feed variable 'pixel': expected shape \[-1, 1, 2, 2\] \(batch, \.\.\.\), "
                                             r"received shape \(2, 4\)"):
            list(loader())
