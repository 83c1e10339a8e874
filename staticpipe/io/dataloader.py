"""A feed loader for static programs, shaped like ``paddle.io.DataLoader.from_generator``.

Why not Paddle's own: its static-mode loader feeds the executor through C++ reader ops that a pipeline
rewrite cannot split into microbatches. This loader hands out plain ``dict[str, np.ndarray]`` batches that
the pipeline executor feeds itself, while keeping Paddle's user-facing API (generators, ``start``/``reset``,
``EOFException``) so existing training loops carry over.
"""
from __future__ import annotations

import numbers
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from .._paddle import core, np, paddle

Batch = dict[str, np.ndarray]
# a queue item: ("samples", list of samples) to stack, or ("batch", one whole batch)
_Item = tuple[str, Any]

_NOT_STARTED = "DataLoader is not started: call loader.start() before training (non-iterable mode)"
_NO_SOURCE = (
    "DataLoader has no data source: call set_sample_generator, set_sample_list_generator "
    "or set_batch_generator first"
)
# numpy dtype kinds a feed variable's kind accepts without losing meaning (ints widen to floats, never back)
_ACCEPTED_KINDS = {"f": "fiu", "i": "iu", "u": "iu", "c": "cfiu", "b": "b"}


@dataclass(frozen=True)
class FeedSpec:
    """What one feed variable expects: ``-1`` in ``shape`` marks a dim that may be anything (the batch)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def from_variable(cls, var: Any) -> FeedSpec:
        dtype = np.dtype(paddle.base.data_feeder.convert_dtype(var.dtype))
        return cls(var.name, tuple(-1 if d is None else int(d) for d in var.shape), dtype)

    def convert(self, value: Any) -> np.ndarray:
        """Check ``value`` against the spec and return it as an array of the spec's dtype.

        Checked here rather than left to Paddle so that the error names the variable and both shapes.
        """
        array = np.asarray(value)
        if array.ndim != len(self.shape) or any(
            want != -1 and want != got for want, got in zip(self.shape, array.shape)
        ):
            raise ValueError(
                f"feed variable {self.name!r}: expected shape {list(self.shape)} (batch, ...), "
                f"received shape {array.shape}"
            )
        if array.dtype.kind not in _ACCEPTED_KINDS.get(self.dtype.kind, self.dtype.kind):
            raise ValueError(f"feed variable {self.name!r}: expected dtype {self.dtype}, received {array.dtype}")
        return np.asarray(array, dtype=self.dtype)


class _Failure:
    """Carries an exception from the producer thread to the consumer."""

    def __init__(self, error: Exception) -> None:
        self.error = error


_END = object()


class _Prefetcher:
    """Runs a source of items on a daemon thread, up to ``capacity`` items ahead of the consumer.

    Every blocking call polls a stop event, so ``close`` ends the producer promptly whatever the
    consumer was doing, and a consumer never waits on a producer that has died.
    """

    _POLL_S = 0.05

    def __init__(self, source: Callable[[], Iterable[_Item]], capacity: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._produce, args=(source,), name="staticpipe.io.DataLoader", daemon=True
        )
        self._thread.start()

    def _put(self, item: object) -> bool:
        """Queue ``item`` unless stopped first; return whether it was queued."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self, source: Callable[[], Iterable[_Item]]) -> None:
        items: Iterable[_Item] = ()
        try:
            items = source()
            for item in items:
                if not self._put(item):
                    return
            self._put(_END)
        except Exception as e:  # handed to the consumer, which re-raises it with this traceback
            e.add_note("(raised in the staticpipe DataLoader's generator, on its prefetch thread)")
            self._put(_Failure(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:  # run the user's generator cleanup when stopped early
                close()

    def get(self) -> _Item | None:
        """Next item, ``None`` at the end (or once closed); re-raises the generator's exception."""
        while not self._done and not self._stop.is_set():
            try:
                item = self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                if self._thread.is_alive() or not self._queue.empty():
                    continue
                break  # the producer died without a word
            if item is _END:
                break
            if isinstance(item, _Failure):
                self._done = True
                raise item.error
            return item
        self._done = True
        return None

    def close(self, timeout: float) -> None:
        """Stop the producer; a generator blocked inside ``next`` past ``timeout`` is left to exit alone."""
        self._stop.set()
        self._thread.join(timeout)


class DataLoader:
    """Prefetching feed loader for static programs; build one with :meth:`from_generator`.

    ``iterable=True``: ``for batch in loader`` runs one epoch. ``iterable=False`` (Paddle's default
    training style): ``loader.start()``, then the executor pulls :meth:`next_batch` until
    ``core.EOFException``, then ``loader.reset()``. :meth:`epoch` iterates one epoch in either mode.
    """

    JOIN_TIMEOUT_S = 1.0

    def __init__(
        self,
        feed_list: Sequence[Any],
        capacity: int = 64,
        use_double_buffer: bool = True,
        iterable: bool = False,
        drop_last: bool = True,
    ) -> None:
        if not isinstance(feed_list, (list, tuple)) or not feed_list:
            raise ValueError(f"feed_list must be a non-empty list of paddle.static.data variables, got {feed_list!r}")
        for var in feed_list:
            if not isinstance(var, paddle.static.Variable):
                raise ValueError(
                    f"feed_list entries must be paddle.static.data variables, got {type(var).__name__}: {var!r}"
                )
        names = [var.name for var in feed_list]
        if len(set(names)) != len(names):
            raise ValueError(f"feed_list names a variable twice: {names}")
        if not isinstance(capacity, numbers.Integral) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer (batches prefetched), got {capacity!r}")
        self._specs = [FeedSpec.from_variable(var) for var in feed_list]
        self.capacity = int(capacity)
        # on CPU the prefetch queue is the only buffer; there is no device copy for a second one to overlap
        self.use_double_buffer = use_double_buffer
        self.iterable = iterable
        # Paddle drops batches that cannot be spread over its devices; kept for parity, the loader never
        # drops whole batches itself (partial batches: see set_sample_generator's drop_last)
        self.drop_last = drop_last
        self._source: Callable[[], Iterable[_Item]] | None = None
        self._prefetcher: _Prefetcher | None = None

    @classmethod
    def from_generator(
        cls,
        feed_list: Sequence[Any],
        capacity: int = 64,
        use_double_buffer: bool = True,
        iterable: bool = False,
        drop_last: bool = True,
    ) -> DataLoader:
        """Same arguments as ``paddle.io.DataLoader.from_generator`` in static mode."""
        return cls(feed_list, capacity, use_double_buffer, iterable, drop_last)

    @property
    def feed_specs(self) -> list[FeedSpec]:
        return list(self._specs)

    # -- data sources: each returns the loader so that calls chain like Paddle's

    def set_sample_generator(
        self, reader: Callable[[], Iterable[Any]], batch_size: int, drop_last: bool = True
    ) -> DataLoader:
        """``reader()`` yields samples, a tuple/list with one value per feed variable (or, for a single
        feed variable, the bare value); they are stacked ``batch_size`` at a time."""
        _check_reader(reader)
        if not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")

        def source() -> Iterator[_Item]:
            samples: list[Any] = []
            for sample in reader():
                samples.append(sample)
                if len(samples) == batch_size:
                    yield "samples", samples
                    samples = []
            if samples and not drop_last:
                yield "samples", samples

        self._source = source
        return self

    def set_sample_list_generator(self, reader: Callable[[], Iterable[Sequence[Any]]]) -> DataLoader:
        """``reader()`` yields lists of samples, each list one batch."""
        _check_reader(reader)
        self._source = lambda: (("samples", list(samples)) for samples in reader())
        return self

    def set_batch_generator(self, reader: Callable[[], Iterable[Any]]) -> DataLoader:
        """``reader()`` yields whole batches: a tuple/list with one array per feed variable, or a dict
        keyed by feed variable name."""
        _check_reader(reader)
        self._source = lambda: (("batch", batch) for batch in reader())
        return self

    # -- iterable mode

    def __iter__(self) -> Iterator[Batch]:
        return self.epoch()

    def __call__(self) -> Iterator[Batch]:
        return self.epoch()

    def epoch(self) -> Iterator[Batch]:
        """One epoch of batches, in either mode.

        Iterable mode: starts a fresh epoch (ending any earlier one still running). Non-iterable mode:
        drains the epoch begun by ``start()``, stopping at EOF; ``reset()`` stays the caller's job.
        """
        if self._source is None:
            raise RuntimeError(_NO_SOURCE)
        if self.iterable:
            return self._iterable_epoch()
        if self._prefetcher is None:
            raise RuntimeError(_NOT_STARTED)
        return self._drain()

    def _iterable_epoch(self) -> Iterator[Batch]:
        self.reset()  # started lazily, so an iterator never advanced holds no thread
        prefetcher = self._prefetcher = _Prefetcher(self._source, self.capacity)
        try:
            while (item := prefetcher.get()) is not None:
                yield self._to_batch(item)
        finally:  # also runs when the consumer breaks out or drops the iterator
            prefetcher.close(self.JOIN_TIMEOUT_S)
            if self._prefetcher is prefetcher:
                self._prefetcher = None

    def _drain(self) -> Iterator[Batch]:
        while True:
            try:
                batch = self.next_batch()
            except core.EOFException:
                return
            yield batch

    # -- non-iterable mode

    def start(self) -> None:
        """Begin an epoch (non-iterable mode); prefetching starts now."""
        if self.iterable:
            raise RuntimeError("start() is for non-iterable loaders (iterable=False); iterate this loader instead")
        if self._source is None:
            raise RuntimeError(_NO_SOURCE)
        if self._prefetcher is not None:
            raise RuntimeError("DataLoader is already started: call loader.reset() before loader.start() again")
        self._prefetcher = _Prefetcher(self._source, self.capacity)

    def next_batch(self) -> Batch:
        """Next batch of the started epoch; raises ``core.EOFException`` at its end, as ``exe.run`` does."""
        if self.iterable:
            raise RuntimeError("next_batch() is for non-iterable loaders (iterable=False); iterate this loader instead")
        if self._prefetcher is None:
            raise RuntimeError(_NOT_STARTED)
        item = self._prefetcher.get()
        if item is None:
            raise core.EOFException("DataLoader epoch ended: call loader.reset() before the next loader.start()")
        return self._to_batch(item)

    def reset(self) -> None:
        """End the current epoch, stopping the prefetch thread; safe to call at any time, in both modes."""
        if self._prefetcher is not None:
            self._prefetcher.close(self.JOIN_TIMEOUT_S)
            self._prefetcher = None

    # -- batch assembly, on the consumer's thread so that errors reach the caller with their context

    def _to_batch(self, item: _Item) -> Batch:
        kind, payload = item
        if kind == "batch":
            fields = self._fields(payload, "batch")
        else:
            if not payload:
                raise ValueError("sample list generator yielded an empty list of samples")
            rows = [self._fields(sample, "sample") for sample in payload]
            fields = [_stack(spec.name, [row[i] for row in rows]) for i, spec in enumerate(self._specs)]
        return {spec.name: spec.convert(value) for spec, value in zip(self._specs, fields)}

    def _fields(self, item: Any, what: str) -> Sequence[Any]:
        """``item``'s values in feed_list order."""
        names = [spec.name for spec in self._specs]
        if isinstance(item, dict):
            missing = [n for n in names if n not in item]
            unknown = [k for k in item if k not in names]
            if missing or unknown:
                raise ValueError(
                    f"{what} dict keys must be the feed variables {names}: "
                    f"missing {missing}, not feed variables {unknown}"
                )
            return [item[n] for n in names]
        if not isinstance(item, (tuple, list)):
            if len(names) == 1:
                return (item,)
            item = (item,)
        if len(item) != len(names):
            raise ValueError(f"expected {len(names)} fields per {what} (feed variables {names}), received {len(item)}")
        return item


def _check_reader(reader: Any) -> None:
    if not callable(reader):
        raise TypeError(f"reader must be a callable returning an iterator (e.g. a generator function), got {reader!r}")


def _stack(name: str, values: list[Any]) -> np.ndarray:
    arrays = [np.asarray(v) for v in values]
    shapes = sorted({a.shape for a in arrays})
    if len(shapes) > 1:
        raise ValueError(f"feed variable {name!r}: samples of one batch have different shapes {shapes}")
    return np.stack(arrays)


def split_microbatches(batch: Batch, num_microbatches: int) -> list[Batch]:
    """Split every array of ``batch`` along axis 0 into ``num_microbatches`` equal contiguous views.

    Equal sizes because every microbatch runs the same compiled program, and the pipeline averages
    their gradients with equal weights.
    """
    if not isinstance(num_microbatches, numbers.Integral) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if not batch:
        raise ValueError("cannot split an empty batch (no feed variables)")
    arrays = {name: np.asarray(value) for name, value in batch.items()}
    first, size = None, 0
    for name, array in arrays.items():
        if array.ndim == 0:
            raise ValueError(f"feed variable {name!r} is a scalar; it has no batch dim to split")
        if first is None:
            first, size = name, array.shape[0]
        elif array.shape[0] != size:
            raise ValueError(
                f"feed variables {first!r} and {name!r} have different batch sizes ({size} and {array.shape[0]})"
            )
    if size % num_microbatches:
        lower, upper = size // num_microbatches * num_microbatches, (size // num_microbatches + 1) * num_microbatches
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"batch size {size} of feed variable {first!r} is not divisible by num_microbatches={num_microbatches}; "
            f"use a batch size that is a multiple of {num_microbatches} (e.g. {hint})"
        )
    step = size // num_microbatches
    return [
        {name: array[i * step : (i + 1) * step] for name, array in arrays.items()} for i in range(num_microbatches)
    ]
