"""The data sources of ``DataLoader.from_generator`` loaders: each ``set_*_generator`` reader as the items a
producer (thread or process) sends, with the reader's misuse named where it shows.

Why a reader is checked twice: that it is callable at ``set_*_generator`` (the usual slip, passing
``gen()`` for ``gen``, is caught before any thread starts), and what ``reader()`` returns on the producer,
each epoch, since only calling it tells (a function that forgot its ``yield`` returns ``None``).
"""
from __future__ import annotations

import inspect
import os
import reprlib
from typing import Any, Callable, Iterable, Iterator

from .prefetch import Item

Source = Callable[[], Iterator[Item]]


def check_reader(reader: Any, method: str) -> None:
    """Refuse, at ``method``, a ``reader`` that is not a callable (a generator function, say)."""
    if inspect.isgenerator(reader) or (not callable(reader) and hasattr(reader, "__next__")):
        raise TypeError(f"{method}: reader must be a callable returning an iterator, got the iterator {reader!r} "
                        "itself: pass the generator function (reader=gen, not gen()), which is called every epoch")
    if not callable(reader):
        raise TypeError(f"{method}: reader must be a callable returning an iterator (e.g. a generator function), "
                        f"got {reader!r}")


def sample_source(reader: Callable[[], Iterable[Any]], batch_size: int, drop_last: bool) -> Source:
    """``reader()``'s samples, ``batch_size`` at a time; a last, smaller batch is kept unless ``drop_last``,
    and is then reported as dropped."""

    def source() -> Iterator[Item]:
        samples: list[Any] = []
        for sample in _iterate(reader, "set_sample_generator", "samples"):
            samples.append(sample)
            if len(samples) == batch_size:
                yield "samples", samples
                samples = []
        if samples:
            yield ("dropped", len(samples)) if drop_last else ("samples", samples)

    return source


def sample_list_source(reader: Callable[[], Iterable[Iterable[Any]]]) -> Source:
    """``reader()``'s lists of samples, each list one batch."""

    def source() -> Iterator[Item]:
        for index, samples in enumerate(_iterate(reader, "set_sample_list_generator", "lists of samples")):
            if isinstance(samples, (dict, str, bytes)) or not isinstance(samples, Iterable):
                raise TypeError(f"set_sample_list_generator's reader {_name(reader)} yielded {_value(samples)} as "
                                f"batch {index}, not a list of samples (a reader of whole batches is for "
                                "set_batch_generator)")
            yield "samples", list(samples)

    return source


def batch_source(reader: Callable[[], Iterable[Any]]) -> Source:
    """``reader()``'s whole batches."""

    def source() -> Iterator[Item]:
        for batch in _iterate(reader, "set_batch_generator", "batches"):
            yield "batch", batch

    return source


def _iterate(reader: Callable[[], Iterable[Any]], method: str, what: str) -> Iterator[Any]:
    """``iter(reader())``, or an error naming the reader and what it returned instead of an iterable of ``what``
    (a dict or a string iterates too, but as keys or characters: never what a reader means)."""
    values = reader()
    if not isinstance(values, (dict, str, bytes)):
        try:
            return iter(values)
        except TypeError:
            pass
    raise TypeError(f"{method}'s reader {_name(reader)} returned {_value(values)}, not an iterable of {what}: "
                    f"make it a generator function (yield {what} one by one) or return an iterator")


def _name(reader: Any) -> str:
    """A function's name and where it is defined (a lambda has no other name), else the reader's repr."""
    code = getattr(reader, "__code__", None)
    if code is None:
        return repr(reader)
    return f"{reader.__qualname__} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def _value(value: Any) -> str:
    return f"{reprlib.repr(value)} of type {type(value).__name__}"
