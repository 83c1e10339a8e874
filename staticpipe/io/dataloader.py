"""A feed loader for static programs, shaped like ``paddle.io.DataLoader.from_generator``.

Why not Paddle's own: its static-mode loader feeds the executor through C++ reader ops that a pipeline
rewrite cannot split into microbatches. This loader hands out plain ``dict[str, np.ndarray]`` batches that
the pipeline executor feeds itself, while keeping Paddle's user-facing API (generators, ``start``/``reset``,
``EOFException``) so existing training loops carry over.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable, Iterator, Sequence

from .._paddle import core, paddle
from .feed import Batch, FeedSpec, stack_samples
from .prefetch import Item as _Item, Prefetcher

_NOT_STARTED = "DataLoader is not started: call loader.start() before training (non-iterable mode)"
_NO_SOURCE = (
    "DataLoader has no data source: call set_sample_generator, set_sample_list_generator "
    "or set_batch_generator first"
)


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
        self._prefetcher: Prefetcher | None = None

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
        prefetcher = self._prefetcher = Prefetcher(self._source, self.capacity)
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
        self._prefetcher = Prefetcher(self._source, self.capacity)

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
            fields = [stack_samples(spec.name, [row[i] for row in rows]) for i, spec in enumerate(self._specs)]
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
