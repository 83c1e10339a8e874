"""What one epoch of a loader gave, counted on the consumer's side.

Why the loader counts and does not complain: an empty epoch (a generator that yields nothing, or fewer
samples than one batch with ``drop_last=True``) is not wrong for a loader, but a training loop that gets no
step from it should say why; these counts let it name the cause instead of returning nothing silently.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EpochStats:
    """``DataLoader.last_epoch``: the current epoch's counts as it runs, and the last one's once it stopped.

    ``batches``: batches handed to the consumer. ``samples``: the samples the data source gave, those of the
    handed-out batches (their first dim) plus ``dropped_samples``. ``dropped_samples``: samples left out as a
    partial last batch (``drop_last=True``; as far as the loader knows it: a ``batch_sampler`` you give
    drops what it drops unseen). ``complete``: the source was read to its end without an error. ``failed``: an
    error of the source, or of a batch it made, reached the consumer. Neither: running, or stopped early.
    """

    batches: int = 0
    samples: int = 0
    dropped_samples: int = 0
    complete: bool = False
    failed: bool = False

    def with_batch(self, rows: int) -> EpochStats:
        return replace(self, batches=self.batches + 1, samples=self.samples + rows)

    def with_dropped(self, count: int) -> EpochStats:
        return replace(self, samples=self.samples + count, dropped_samples=self.dropped_samples + count)

    def with_failure(self) -> EpochStats:
        return replace(self, failed=True)

    def completed(self) -> EpochStats:
        return replace(self, complete=not self.failed)
