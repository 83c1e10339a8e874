"""The training and evaluation loops over a data loader, on top of ``staticpipe.Executor``'s steps."""
from .evaluate import evaluate
from .loop import train_from_dataset

__all__ = ["train_from_dataset", "evaluate"]
