"""Where a pipelined step's batches come from: Paddle's pipeline convention, a loader batch is one
micro-batch and a step takes ``num_microbatches`` of them (global batch = micro-batches x batch size).

Why this convention: it is what Paddle's pipeline (1.8 and 2.x static) does, so a script written for
it trains the same job here; ``Executor.run(main, feed=global_batch)`` still takes a whole global batch
and splits it. The end of an epoch is never a silent partial step: batches that do not fill a step
(fewer than ``num_microbatches``, or a last, smaller batch of a ``drop_last=False`` loader) are not
trained on, as in Paddle's pipeline, and a message names the counts.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from .._paddle import core, framework
from ..io import loaders_of
from ..plan import Plan

Batch = dict[str, Any]


def loader_for(program: framework.Program, plan: Plan, dataset: Any, call: str) -> Any:
    """The loader a call (``train_from_dataset``, ``infer_from_dataset``, ``run``) reads: ``dataset``, or
    the one started loader whose feed variables are ``program``'s. Errors name what is missing or extra."""
    if dataset is None:
        bound = loaders_of(program)
        started = [ld for ld in bound if ld.started]
        if not started:
            found = "; ".join(f"a loader of {ld.feed_names} ({'iterable' if ld.iterable else 'not started'})"
                              for ld in bound)
            raise ValueError(
                f"{call} has no dataset and no started loader feeds this program ({found or 'no loader at all'}): "
                "create staticpipe.io.DataLoader.from_generator(feed_list=[...], iterable=False), set its generator "
                "and call loader.start() first, or pass the loader as dataset=")
        if len(started) > 1:
            raise ValueError(f"{call}: {len(started)} started loaders feed this program "
                             f"({'; '.join(str(ld.feed_names) for ld in started)}); reset all but one, or pass "
                             "the one to train on as dataset=")
        dataset = started[0]
    elif not hasattr(dataset, "epoch") or not hasattr(dataset, "feed_names"):
        raise ValueError(f"dataset must be a staticpipe.io.DataLoader, got {type(dataset).__name__} (Paddle's "
                         "QueueDataset / InMemoryDataset feed the parameter-server trainers, not pipelines)")
    names = list(dataset.feed_names)
    missing = sorted(n for n in plan.data_vars if n not in names)
    extra = [n for n in names if n not in plan.data_vars]
    if missing or extra:
        raise ValueError(f"the loader's feed_list {names} does not match the program's data variables "
                         f"{sorted(plan.data_vars)}: missing {missing}, not data variables of the program {extra}")
    return dataset


def steps(batches: Iterator[Batch], num_microbatches: int, note: Callable[[str], None]) -> Iterator[list[Batch]]:
    """The loader's batches in steps of ``num_microbatches``; what is left at the end is reported to
    ``note`` and not yielded."""
    size: int | None = None  # the epoch's micro-batch size: its first batch's
    group: list[Batch] = []
    index = -1
    batches = iter(batches)
    for index, batch in enumerate(batches):
        rows = len(next(iter(batch.values())))
        size = rows if size is None else size
        if rows != size:
            following = next(batches, None)
            if following is not None:
                raise ValueError(f"loader batch {index} has {rows} samples, but the micro-batch size is {size} "
                                 "(the epoch's first batch); only the last batch of an epoch may be smaller "
                                 "(drop_last=False)")
            note(f"the last loader batch has {rows} samples, not the micro-batch size {size} (drop_last=False): "
                 f"it and the {len(group)} batches before it in its step were not trained on")
            return
        group.append(batch)
        if len(group) == num_microbatches:
            yield group
            group = []
    if group:
        note(f"the epoch's last {len(group)} loader batches (of {index + 1}) do not fill a step of "
             f"num_microbatches={num_microbatches} micro-batches: they were not trained on, as in Paddle's "
             "pipeline; give the loader a multiple of num_microbatches batches per epoch to use them")


def take_step(loader: Any, num_microbatches: int) -> list[Batch]:
    """The next step's batches from a started non-iterable loader, for ``Executor.run(main)``; raises
    ``core.EOFException`` at the end of the epoch, as Paddle's executor does (a partial step too, naming
    the batches it drops)."""
    group = []
    while len(group) < num_microbatches:
        try:
            group.append(loader.next_batch())
        except core.EOFException:
            if group:
                raise core.EOFException(
                    f"the epoch ended {len(group)} loader batches into a step of num_microbatches="
                    f"{num_microbatches}: they were not trained on; call loader.reset()") from None
            raise
    return group


def one_feed(feed: dict | list | tuple | None) -> dict:
    """Paddle's feed forms for one device: a dict, or a list holding one dict per place."""
    if isinstance(feed, (list, tuple)):
        if len(feed) != 1:
            raise ValueError(f"a list feed holds one dict per place; a pipeline takes one global batch, got a list of "
                             f"{len(feed)}: pass one dict (or Executor.step(program, micro-batches))")
        feed = feed[0]
    if feed is None:
        return {}
    if not isinstance(feed, dict):
        raise ValueError(f"feed must be a dict {{data variable name: array}} (or a list holding one), got "
                         f"{type(feed).__name__}")
    return feed
