"""Batches from a ``paddle.io.Dataset``, the way Paddle 2.x users load data: ``paddle.io.DataLoader``'s
arguments with Paddle's meaning (its ``BatchSampler`` for ``batch_size``/``shuffle``/``drop_last``, a
``collate_fn`` given the list of samples, ``num_workers`` processes, ``worker_init_fn(worker_id)``).

Why the workers take the sampler's batches round robin (worker k loads batches k, k+n, ...) rather than
from a shared index queue: each is then a plain producer process, so batches come back in sampler order,
and a dead or failing worker is reported, with the same machinery as ``use_multiprocess``. The epoch's
batches are drawn from the sampler up front, on the caller's thread: the shuffle then consumes numpy's
global random state exactly as ``list(paddle.io.BatchSampler(...))`` would, whatever ``num_workers`` is.
What ``drop_last`` left out is sent as a last item of the epoch, ``("dropped", count)``, for the loader to count.
"""
from __future__ import annotations

import numbers
import random
from functools import partial
from typing import Any, Callable, Iterator, Sequence

from .._paddle import np, paddle
from .feed import collate
from .prefetch import Item, Prefetcher, Producer, after_batches
from .process import ProcessPrefetcher, RoundRobin

_LABEL = "the staticpipe DataLoader's dataset"


class DatasetSource:
    """One dataset loader's data: checks ``paddle.io.DataLoader``'s arguments once, then :meth:`open` starts
    an epoch. ``names``: the feed variables, in feed_list order (what the default collate stacks)."""

    def __init__(
        self,
        dataset: Any,
        names: Sequence[str],
        batch_sampler: Any,
        batch_size: int | None,
        shuffle: bool,
        drop_last: bool,
        collate_fn: Callable[[list], Any] | None,
        num_workers: int,
        prefetch_factor: int,
        timeout: float,
        worker_init_fn: Callable[[int], None] | None,
    ) -> None:
        self.iterable = isinstance(dataset, paddle.io.IterableDataset)
        if not self.iterable and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(f"dataset must be a paddle.io.Dataset (__getitem__ and __len__) or a "
                            f"paddle.io.IterableDataset, got {type(dataset).__name__}")
        for name, value, low in (("num_workers", num_workers, 0), ("prefetch_factor", prefetch_factor, 1)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0 (0: wait for ever), got {timeout!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable (list of samples -> batch), got {collate_fn!r}")
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable (worker id -> None), got {worker_init_fn!r}")
        self.batch_sampler = _batch_sampler(dataset, self.iterable, batch_sampler, batch_size, shuffle, drop_last)
        if self.iterable and num_workers:
            raise ValueError(f"num_workers={num_workers} with a paddle.io.IterableDataset: every worker process would "
                             "replay the whole dataset (staticpipe does not shard it by worker); use num_workers=0")
        self.dataset = dataset
        self._names = list(names)
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._collate_fn = collate_fn
        self.num_workers = int(num_workers)
        self._prefetch_factor = int(prefetch_factor)
        self._timeout = timeout
        self._worker_init_fn = worker_init_fn

    def __len__(self) -> int:
        if self.iterable:
            raise TypeError("a DataLoader over a paddle.io.IterableDataset has no len()")
        return len(self.batch_sampler)

    def open(self, skip: int = 0) -> Producer:
        """Start one epoch: a prefetch thread (``num_workers=0``) or ``num_workers`` worker processes; after
        its first ``skip`` batches, which the sampler draws (so that the rest are the same) and no one loads.
        An iterable dataset cannot skip: its first ``skip`` batches are made and dropped."""
        if self.iterable:
            return Prefetcher(after_batches(self._stream, skip), self._prefetch_factor, _LABEL)
        drawn = self._batches()
        batches = drawn[skip:]
        # the epoch's items, each made by calling it: the batches, then what drop_last left out. Workers take
        # them round robin, so the last item comes from the worker whose turn is next, and in order
        tasks: list[Callable[[], Item]] = [partial(self._load, indices) for indices in batches]
        dropped = len(self.dataset) - sum(map(len, drawn)) if self._drop_last else 0
        if dropped:
            tasks.append(lambda: ("dropped", dropped))
        if not self.num_workers:
            return Prefetcher(partial(_run, tasks), self._prefetch_factor, _LABEL)
        # the workers' random seeds, from Python's generator so that numpy's (the sampler's) runs on as with
        # num_workers=0: every epoch keeps its batches whatever num_workers is
        base_seed = random.randrange(2**31 - self.num_workers)
        n = self.num_workers
        return RoundRobin([
            ProcessPrefetcher(partial(_run, tasks[k::n]), self._prefetch_factor,
                              label=f"staticpipe DataLoader worker {k}", init=partial(self._init_worker, k, base_seed),
                              timeout=self._timeout)
            for k in range(n)
        ])

    def _batches(self) -> list[list[int]]:
        """The epoch's batches of sample indices, from the batch sampler; an error names a sampler that yields
        something else."""
        batches = []
        for number, indices in enumerate(self.batch_sampler):
            if isinstance(indices, (str, bytes, dict)) or not hasattr(indices, "__iter__"):
                raise TypeError(f"the DataLoader's batch_sampler yielded {indices!r} as batch {number}, not a list of "
                                "sample indices")
            batches.append(list(indices))
        return batches

    def _init_worker(self, worker_id: int, base_seed: int) -> None:
        """In worker ``worker_id``: seeds of its own, as Paddle's workers have, then ``worker_init_fn``."""
        random.seed(base_seed + worker_id)
        np.random.seed(base_seed + worker_id)
        if self._worker_init_fn is not None:
            try:
                self._worker_init_fn(worker_id)
            except BaseException as e:
                e.add_note(f"(in the DataLoader's worker_init_fn({worker_id}))")
                raise

    def _load(self, indices: list[int]) -> Item:
        samples = []
        for index in indices:
            try:
                samples.append(self.dataset[index])
            except BaseException as e:  # a KeyboardInterrupt too: it reaches the consumer, naming the sample
                e.add_note(f"(loading sample index {index} of the DataLoader's dataset)")
                raise
        return self._collate(samples, f"sample indices {indices}")

    def _stream(self) -> Iterator[Item]:
        """An iterable dataset's samples, ``batch_size`` at a time."""
        samples: list[Any] = []
        for samples_seen, sample in enumerate(self.dataset, 1):
            samples.append(sample)
            if len(samples) == self._batch_size:
                yield self._collate(samples, f"samples {samples_seen - len(samples)}..{samples_seen - 1}")
                samples = []
        if samples and self._drop_last:
            yield "dropped", len(samples)
        elif samples:
            yield self._collate(samples, f"the last {len(samples)} samples")

    def _collate(self, samples: list, which: str) -> Item:
        try:
            return "batch", (collate(self._names, samples) if self._collate_fn is None else self._collate_fn(samples))
        except BaseException as e:
            e.add_note(f"(collating the DataLoader batch of {which} of its dataset)")
            raise


def _run(tasks: list[Callable[[], Item]]) -> Iterator[Item]:
    return (task() for task in tasks)


def _batch_sampler(dataset: Any, iterable: bool, batch_sampler: Any, batch_size: Any, shuffle: Any,
                   drop_last: Any) -> Any:
    """Paddle's rules: a given ``batch_sampler`` excludes ``batch_size``/``shuffle``/``drop_last``; otherwise a
    ``paddle.io.BatchSampler`` (a map dataset) or plain ``batch_size`` chunks (an iterable one, never shuffled)."""
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if batch_sampler is not None:
        if iterable:
            raise ValueError("batch_sampler must be None for a paddle.io.IterableDataset (it has no indices)")
        if batch_size != 1 or shuffle or drop_last:
            raise ValueError(f"batch_sampler is given, so batch_size, shuffle and drop_last must keep their defaults "
                             f"(1, False, False), got batch_size={batch_size!r}, shuffle={shuffle}, "
                             f"drop_last={drop_last}: the batch sampler decides them")
        if not hasattr(batch_sampler, "__iter__"):
            raise TypeError(f"batch_sampler must be iterable (lists of sample indices), got {batch_sampler!r}")
        return batch_sampler
    if batch_size is None:
        raise ValueError("batch_size=None (the dataset yields whole batches) is not supported: give a batch_size, "
                         "or a batch generator through DataLoader.from_generator(...).set_batch_generator")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if iterable:
        if shuffle:
            raise ValueError("shuffle=True with a paddle.io.IterableDataset: it has no indices to shuffle "
                             "(Paddle refuses it too)")
        return None
    return paddle.io.BatchSampler(dataset=dataset, batch_size=int(batch_size), shuffle=shuffle, drop_last=drop_last)
