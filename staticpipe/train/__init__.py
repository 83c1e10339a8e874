"""The training and evaluation loops over a data loader, on top of ``staticpipe.Executor``'s steps."""
from .evaluate import evaluate
from .feeding import loader_for, one_feed, take_step
from .loop import Options, infer_from_dataset, train_from_dataset

__all__ = ["train_from_dataset", "infer_from_dataset", "evaluate", "Options", "loader_for", "one_feed", "take_step"]
