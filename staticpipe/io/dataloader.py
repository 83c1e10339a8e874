"""A feed loader for static programs with ``paddle.io.DataLoader``'s two constructors: over a
``paddle.io.Dataset`` (``DataLoader(dataset, feed_list=...)``) and over generators (``from_generator``).

Why not Paddle's own: its static-mode loader feeds the executor through C++ reader ops that a pipeline
rewrite cannot split into microbatches. This loader hands out plain ``dict[str, np.ndarray]`` batches that
the pipeline executor feeds itself, while keeping Paddle's user-facing API (generators, datasets,
``start``/``reset``, ``EOFException``) so existing training loops carry over.
"""
from __future__ import annotations

import numbers
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

from .._paddle import core, framework
from .dataset import DatasetSource
from .epoch import EpochStats
from .feed import Batch, FeedSpec, feed_specs, to_batch
from .generators import Source, batch_source, check_reader, sample_list_source, sample_source
from .position import Position, random_state, set_random_state
from .prefetch import Item, Prefetcher, Producer, after_batches
from .process import ProcessPrefetcher
from .registry import hold, program_of, register

_NOT_STARTED = "DataLoader is not started: call loader.start() before training (non-iterable mode)"
_ENDED = "the DataLoader's epoch has ended: call loader.reset() and loader.start() before the next one"
_NO_SOURCE = (
    "DataLoader has no data source: call set_sample_generator, set_sample_list_generator "
    "or set_batch_generator first"
)


class DataLoader:
    """Prefetching feed loader for static programs.

    ``DataLoader(dataset, feed_list=[...], batch_size=...)`` reads a ``paddle.io.Dataset`` and is always
    iterable, as Paddle's. ``DataLoader.from_generator(feed_list=[...])`` reads the generator given to a
    ``set_*_generator`` method; ``iterable=True``: ``for data in loader`` runs one epoch; ``iterable=False``
    (Paddle's pipeline scripts): ``loader.start()``, then the executor pulls :meth:`next_batch` until
    ``core.EOFException``, then ``loader.reset()``.

    Iterating (``for data in loader``, ``loader()``) yields a list of arrays in feed_list order
    (``return_list=True``) or a dict ``{name: array}`` (``False``). Paddle wraps either in a list with one
    entry per place, because its executor feeds each device itself; here one batch feeds the whole pipeline
    (the pipeline executor places each variable on its stage), so there is no per-place wrapper.
    :meth:`epoch`, what the training loop reads, yields dicts whatever ``return_list`` is.

    :attr:`last_epoch` counts what the current or last epoch gave (batches, samples, samples dropped as a
    partial batch); the loader never complains about an empty epoch itself: its caller knows whether that is
    an error. ``batch_size``: samples per batch where the loader batches them (``set_sample_generator``, a
    dataset without ``batch_sampler``), else ``None``.
    """

    JOIN_TIMEOUT_S = 1.0
    DEFAULT_CAPACITY = 64

    def __init__(
        self,
        dataset: Any,
        feed_list: Sequence[Any] | None = None,
        places: Any = None,
        return_list: bool = True,
        batch_sampler: Any = None,
        batch_size: int | None = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        collate_fn: Callable[[list], Any] | None = None,
        num_workers: int = 0,
        use_buffer_reader: bool = True,
        reader_buffer_size: int = 2,
        prefetch_factor: int = 2,
        use_shared_memory: bool = True,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        persistent_workers: bool = False,
    ) -> None:
        """``paddle.io.DataLoader``'s signature and meaning, with these differences: ``feed_list`` is required
        (batches are fed by variable name); ``places`` is ignored (the pipeline places each variable on its
        stage); batches always travel through a queue of ``prefetch_factor`` batches per worker (or per
        loader, ``num_workers=0``), so ``use_buffer_reader`` and ``reader_buffer_size`` (Paddle 3's) change
        nothing; worker batches travel through
        pipes, so ``use_shared_memory`` changes nothing; workers are forked for each epoch, so
        ``persistent_workers`` changes nothing but worker state (it is not kept between epochs);
        ``paddle.io.get_worker_info()`` is ``None`` in the workers, and an IterableDataset takes no workers.
        """
        self._setup(feed_list, True, return_list, drop_last)
        self._check_flags(return_list=return_list)
        self._dataset = DatasetSource(dataset, self.feed_names, batch_sampler, batch_size, shuffle, drop_last,
                                      collate_fn, num_workers, prefetch_factor, timeout, worker_init_fn)
        self.dataset, self.batch_sampler = dataset, self._dataset.batch_sampler
        self.num_workers = self._dataset.num_workers
        self.batch_size = batch_size if batch_sampler is None else None
        self._open = self._dataset.open
        self._origin = ("made by the dataset's collate_fn" if collate_fn is not None
                        else "made of the dataset's samples by the default collate")
        register(self)

    @classmethod
    def from_generator(
        cls,
        feed_list: Sequence[Any] | None = None,
        capacity: int | None = None,
        use_double_buffer: bool = True,
        iterable: bool = True,
        return_list: bool = False,
        use_multiprocess: bool = False,
        drop_last: bool = True,
    ) -> DataLoader:
        """``paddle.io.DataLoader.from_generator``'s signature and meaning in static mode.

        ``capacity``: batches prefetched (``None``: 64). ``use_multiprocess=True`` runs the generator in a
        forked producer process instead of a thread (so it must not rely on the parent's later state).
        """
        capacity = cls.DEFAULT_CAPACITY if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer (batches prefetched), got {capacity!r}")
        loader = cls.__new__(cls)  # not __init__: that is Paddle's dataset constructor
        loader._setup(feed_list, iterable, return_list, drop_last)
        loader._check_flags(iterable=iterable, return_list=return_list, use_multiprocess=use_multiprocess,
                            drop_last=drop_last)
        loader._dataset = None
        loader.batch_size = None
        loader.capacity = int(capacity)
        # on CPU the prefetch queue is the only buffer; there is no device copy for a second one to overlap
        loader.use_double_buffer = use_double_buffer
        loader.use_multiprocess = use_multiprocess
        register(loader)
        return loader

    def _setup(self, feed_list: Any, iterable: bool, return_list: bool, drop_last: bool) -> None:
        """What both constructors share: the feed variables, checked, and the epoch's state."""
        self._specs = feed_specs(feed_list)
        self._program = weakref.ref(program_of(feed_list))
        self.iterable = iterable
        self.return_list = return_list
        # a dataset loader's is its batch sampler's. A generator loader's, in Paddle, drops the batches it cannot spread
        # over its devices; one batch feeds the whole pipeline here: none dropped (set_sample_generator's: samples)
        self.drop_last = drop_last
        self._open: Callable[[int], Producer] | None = None  # an epoch's producer, after its first n batches
        self._origin = ""  # what makes the batches ("made by ..."), for the note on a batch's errors
        self._prefetcher: Producer | None = None
        self._last_epoch: EpochStats | None = None
        self._eof_raised = False  # next_batch raised EOFException in this epoch: a second call is a mistake
        self._epoch = -1  # the current (or last) epoch's number
        self._resume: Position | None = None  # where the next epoch opened resumes (resume_from)
        self._skipped = 0  # batches the current epoch resumed after
        self._opened_random: dict | None = None  # the global generators' as the last epoch opened

    @staticmethod
    def _check_flags(**flags: Any) -> None:
        """A flag that is not a bool (``iterable="False"`` is true) would silently pick the wrong mode."""
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")

    # -- what the executor asks

    @property
    def feed_specs(self) -> list[FeedSpec]:
        return list(self._specs)

    @property
    def feed_names(self) -> list[str]:
        return [spec.name for spec in self._specs]

    @property
    def program(self) -> framework.Program | None:
        """The program whose data variables this loader feeds (``None`` once that program is gone)."""
        return self._program()

    @property
    def started(self) -> bool:
        """Whether a non-iterable loader is between ``start()`` and ``reset()``; never for iterable ones."""
        return not self.iterable and self._prefetcher is not None

    @property
    def last_epoch(self) -> EpochStats | None:
        """What the current epoch gave so far, or the last one (see :class:`~.epoch.EpochStats`); ``None``
        before the first. E.g. ``batches == 0 and dropped_samples``: the source gave fewer samples than
        ``batch_size`` and ``drop_last=True`` dropped them all."""
        return self._last_epoch

    def __len__(self) -> int:
        """Batches per epoch, for a loader over a map-style dataset (as Paddle's)."""
        if self._dataset is None:
            raise TypeError("a DataLoader.from_generator loader has no len(): its generator decides the epoch")
        return len(self._dataset)

    # -- data sources of from_generator loaders: each returns the loader so that calls chain like Paddle's;
    # ``places`` is Paddle's per-device feeding, which the pipeline does itself: accepted and ignored

    def set_sample_generator(
        self, reader: Callable[[], Iterable[Any]], batch_size: int, drop_last: bool = True, places: Any = None
    ) -> DataLoader:
        """``reader()`` yields samples, a tuple/list with one value per feed variable, a dict keyed by feed
        variable name, or (for a single feed variable) the bare value; they are stacked ``batch_size`` at a
        time, and a last, smaller batch is kept unless ``drop_last``."""
        self._check_generator(reader, "set_sample_generator")
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self._check_flags(drop_last=drop_last)
        self.batch_size = int(batch_size)
        return self._use(sample_source(reader, int(batch_size), drop_last), "made by set_sample_generator's reader")

    def set_sample_list_generator(
        self, reader: Callable[[], Iterable[Sequence[Any]]], places: Any = None
    ) -> DataLoader:
        """``reader()`` yields lists of samples, each list one batch."""
        self._check_generator(reader, "set_sample_list_generator")
        self.batch_size = None
        return self._use(sample_list_source(reader), "made by set_sample_list_generator's reader")

    def set_batch_generator(self, reader: Callable[[], Iterable[Any]], places: Any = None) -> DataLoader:
        """``reader()`` yields whole batches: a tuple/list with one array per feed variable, or a dict
        keyed by feed variable name."""
        self._check_generator(reader, "set_batch_generator")
        self.batch_size = None
        return self._use(batch_source(reader), "made by set_batch_generator's reader")

    def _check_generator(self, reader: Any, method: str) -> None:
        if self._dataset is not None:
            raise RuntimeError(f"{method} is for loaders made by DataLoader.from_generator; this loader reads "
                               f"its dataset ({type(self._dataset.dataset).__name__})")
        check_reader(reader, method)

    def _use(self, source: Source, origin: str) -> DataLoader:
        kind = ProcessPrefetcher if self.use_multiprocess else Prefetcher
        self._open = lambda skip: kind(after_batches(source, skip), self.capacity)
        self._origin = origin
        return self

    # -- iterable mode

    def __iter__(self) -> Iterator[Batch | list]:
        batches = self.epoch()
        if not self.return_list:
            return batches
        names = self.feed_names
        return ([batch[name] for name in names] for batch in batches)

    def __call__(self) -> Iterator[Batch | list]:
        return self.__iter__()

    def epoch(self) -> Iterator[Batch]:
        """One epoch of batches as ``{name: array}`` dicts, in either mode.

        Iterable mode: starts a fresh epoch (ending any earlier one still running). Non-iterable mode:
        drains the epoch begun by ``start()``, stopping at EOF; ``reset()`` stays the caller's job, and an
        epoch that has ended (read to its end, or failed) is refused rather than read again as empty.
        """
        if self._open is None:
            raise RuntimeError(_NO_SOURCE)
        if self.iterable:
            return self._iterable_epoch()
        if self._prefetcher is None:
            raise RuntimeError(_NOT_STARTED)
        if self._prefetcher.done:
            raise RuntimeError(_ENDED)
        return self._drain(self._prefetcher)

    def position(self) -> Position:
        """Where this loader's data stands (what a checkpoint records): its current or last epoch, the
        batches handed out of it, whether it was read to its end, the global generators as it opened (as
        they are now, once it ended)."""
        stats = self._last_epoch or EpochStats()
        return Position(max(self._epoch, 0), self._skipped + stats.batches, stats.complete,
                        random_state() if stats.complete or self._epoch < 0 else self._opened_random)

    def resume_from(self, position: Position) -> None:
        """Go on where ``position`` (a ``position()``, from a checkpoint) left: the global generators as they
        were, then the next epoch opened is its epoch, after the batches handed out of it (a dataset's batch
        sampler draws the whole epoch and those batches are never loaded; a generator cannot be restored,
        so it makes them again and they are dropped), or, once ended, the epoch after."""
        if not isinstance(position, Position):
            raise TypeError(f"resume_from takes a DataLoader.position(), got {type(position).__name__}")
        if position.ended:
            if position.random is not None:
                set_random_state(position.random)
            self._epoch, self._resume = position.epoch, None
        else:
            self._resume = position

    def _begin(self) -> Producer:
        resume, self._resume = self._resume, None
        if resume is not None and resume.random is not None:
            set_random_state(resume.random)
        self._opened_random = random_state()
        self._epoch = resume.epoch if resume is not None else self._epoch + 1
        self._skipped = resume.batches if resume is not None else 0
        self._prefetcher = self._open(self._skipped)
        self._last_epoch = EpochStats()
        self._eof_raised = False
        return self._prefetcher

    def _take(self, prefetcher: Producer) -> Batch | None:
        """The epoch's next batch, checked, or ``None`` at its end; counted in ``last_epoch`` either way."""
        if prefetcher is not self._prefetcher:  # an iterator of an epoch that reset() or a newer epoch ended
            return None
        while (item := self._get(prefetcher)) is not None:
            kind, payload = item
            if kind == "dropped":
                self._last_epoch = self._last_epoch.with_dropped(payload)
                continue
            try:
                batch = to_batch(self._specs, item)
            except Exception as e:
                e.add_note(f"(checking batch {self._last_epoch.batches} of the DataLoader's epoch, {self._origin})")
                self._last_epoch = self._last_epoch.with_failure()
                raise
            first = next(iter(batch.values()))
            self._last_epoch = self._last_epoch.with_batch(len(first) if first.ndim else 1)
            return batch
        self._last_epoch = self._last_epoch.completed()
        return None

    def _get(self, prefetcher: Producer) -> Item | None:
        try:
            return prefetcher.get()
        except BaseException:
            if prefetcher.done:  # the source's error, not the consumer interrupted while it waited
                self._last_epoch = self._last_epoch.with_failure()
            raise

    def _iterable_epoch(self) -> Iterator[Batch]:
        self.reset()  # started lazily, so an iterator never advanced holds no thread or process
        prefetcher = self._begin()
        try:
            while (batch := self._take(prefetcher)) is not None:
                yield batch
        finally:  # also runs when the consumer breaks out or drops the iterator
            prefetcher.close(self.JOIN_TIMEOUT_S)
            if self._prefetcher is prefetcher:
                self._prefetcher = None

    def _drain(self, prefetcher: Producer) -> Iterator[Batch]:
        """The rest of the started epoch; its end raises no EOFException here, so a later ``next_batch``
        still raises the one that Paddle's loop expects."""
        while (batch := self._take(prefetcher)) is not None:
            yield batch

    # -- non-iterable mode

    def start(self) -> None:
        """Begin an epoch (non-iterable mode); prefetching starts now. Until ``reset()`` the loader stays alive
        for ``loaders_of`` to find, even with no name left for it, as Paddle's started loader does."""
        if self.iterable:
            raise RuntimeError("start() is for non-iterable loaders (iterable=False); iterate this loader instead")
        if self._open is None:
            raise RuntimeError(_NO_SOURCE)
        if self._prefetcher is not None:
            raise RuntimeError("DataLoader is already started: call loader.reset() before loader.start() again")
        self._begin()
        hold(self, True)

    def next_batch(self) -> Batch:
        """Next batch of the started epoch; raises ``core.EOFException`` once at its end, as ``exe.run`` does,
        and a ``RuntimeError`` if called again before ``reset()`` (a loop that missed the EOF)."""
        if self.iterable:
            raise RuntimeError("next_batch() is for non-iterable loaders (iterable=False); iterate this loader instead")
        if self._prefetcher is None:
            raise RuntimeError(_NOT_STARTED)
        if self._eof_raised:
            raise RuntimeError(_ENDED)
        batch = self._take(self._prefetcher)
        if batch is None:
            self._eof_raised = True
            raise core.EOFException("DataLoader epoch ended: call loader.reset() before the next loader.start()")
        return batch

    def reset(self) -> None:
        """End the current epoch, stopping its producer; safe to call at any time, in both modes."""
        if self._prefetcher is not None:
            self._prefetcher.close(self.JOIN_TIMEOUT_S)
            self._prefetcher = None
        hold(self, False)
