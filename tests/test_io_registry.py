"""staticpipe.io's registry: ``loaders_of(program)`` finds the live loaders feeding a program, in creation
order, weakly; and what each loader tells the executor (``program``, ``feed_names``, ``started``)."""
from __future__ import annotations

import gc
import re

import pytest

from staticpipe._paddle import np, paddle
from staticpipe.io import DataLoader, loaders_of

pytestmark = pytest.mark.timeout(60)


def feeds(program):
    with paddle.static.program_guard(program, paddle.static.Program()):
        return [paddle.static.data("x", [None, 2], "float32"), paddle.static.data("y", [None, 1], "int64")]


def batches():
    return iter([(np.zeros((2, 2), np.float32), np.zeros((2, 1), np.int64))])


def test_loaders_of_a_program_in_creation_order_and_theirs_only():
    main, other = paddle.static.Program(), paddle.static.Program()
    first = DataLoader.from_generator(feeds(main), iterable=False)
    elsewhere = DataLoader.from_generator(feeds(other))
    second = DataLoader([(np.zeros(2, np.float32), np.zeros(1, np.int64))], feed_list=feeds(main)[::-1][:1])
    assert loaders_of(main) == [first, second]
    assert loaders_of(other) == [elsewhere]
    assert loaders_of(paddle.static.Program()) == []
    assert first.program is main and elsewhere.program is other
    assert first.feed_names == ["x", "y"] and second.feed_names == ["y"]


def test_a_dropped_loader_disappears_and_a_loader_does_not_keep_its_program():
    main = paddle.static.Program()
    kept = DataLoader.from_generator(feeds(main))
    dropped = DataLoader.from_generator(feeds(main))
    del dropped
    gc.collect()
    assert loaders_of(main) == [kept]
    del main
    gc.collect()
    assert kept.program is None


def test_a_started_loader_lives_until_reset_as_paddles():
    """Paddle's running reader thread keeps a started loader alive: a script may keep no name for it."""
    main = paddle.static.Program()
    DataLoader.from_generator(feeds(main), iterable=False).set_batch_generator(batches).start()
    gc.collect()
    (loader,) = loaders_of(main)
    assert loader.started and len(list(loader.epoch())) == 1
    loader.reset()
    del loader
    gc.collect()
    assert loaders_of(main) == []


def test_started_only_between_start_and_reset_of_a_non_iterable_loader():
    main = paddle.static.Program()
    loader = DataLoader.from_generator(feeds(main), iterable=False).set_batch_generator(batches)
    assert not loader.started
    loader.start()
    assert loader.started
    assert len(list(loader.epoch())) == 1
    assert loader.started  # at EOF, until reset, as Paddle's
    loader.reset()
    assert not loader.started
    iterable = DataLoader.from_generator(feeds(main)).set_batch_generator(batches)
    it = iterable.epoch()
    next(it)
    assert not iterable.started
    iterable.reset()


def test_feed_variables_of_two_programs_are_refused():
    a, b = paddle.static.Program(), paddle.static.Program()
    x, _ = feeds(a)
    _, y = feeds(b)
    msg = ("feed_list variables belong to 2 different programs (['x']; ['y']): a loader feeds one program; "
           "build all its paddle.static.data variables under one program_guard")
    with pytest.raises(ValueError, match=re.escape(msg)):
        DataLoader.from_generator([x, y])
