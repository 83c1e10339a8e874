"""Feeding static programs: a prefetching loader with Paddle's API, and microbatch splitting."""
from .dataloader import DataLoader
from .feed import FeedSpec, split_microbatches

__all__ = ["DataLoader", "FeedSpec", "split_microbatches"]
