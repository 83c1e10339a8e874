"""Feeding static programs: prefetching loaders with Paddle's API (generators, datasets, producer
processes), the registry of which loader feeds which program, and microbatch splitting."""
from .dataloader import DataLoader
from .epoch import EpochStats
from .feed import FeedSpec, batch_rows, checked_batch, split_microbatches
from .registry import loaders_of

__all__ = ["DataLoader", "EpochStats", "FeedSpec", "batch_rows", "checked_batch", "split_microbatches", "loaders_of"]
