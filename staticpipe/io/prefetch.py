"""A producer thread that runs a data source ahead of its consumer, and stops promptly when told."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Protocol

# a queue item: ("samples", list of samples) to stack, ("batch", one whole batch), or, last, ("dropped", number
# of samples left out as a partial last batch), which the loader counts (``DataLoader.last_epoch``)
Item = tuple[str, Any]


class Producer(Protocol):
    """What a loader reads an epoch from: this thread, a producer process, or worker processes.

    ``done``: the stream is over, its end or its failure handed out (not merely a consumer interrupted while
    waiting), so that the loader can tell an ended epoch from one still running.
    """

    done: bool

    def get(self) -> Item | None: ...

    def close(self, timeout: float) -> None: ...


class _Failure:
    """Carries an exception from the producer thread to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def after_batches(source: Callable[[], Iterable[Item]], skip: int) -> Callable[[], Iterable[Item]]:
    """``source`` whose items start after its first ``skip`` batches, which are made and dropped (where a
    resumed epoch of a source that cannot be restored starts); what drop_last left out still comes."""
    if not skip:
        return source

    def items() -> Iterable[Item]:
        left = skip
        for item in source():
            if left and item[0] != "dropped":
                left -= 1
                continue
            yield item
    return items


class Prefetcher:
    """Runs a source of items on a daemon thread, up to ``capacity`` items ahead of the consumer.

    Every blocking call polls a stop event, so ``close`` ends the producer promptly whatever the
    consumer was doing, and a consumer never waits on a producer that has died.
    """

    _POLL_S = 0.05

    def __init__(
        self, source: Callable[[], Iterable[Item]], capacity: int, label: str = "the staticpipe DataLoader's generator"
    ) -> None:
        self._label = label  # what runs on the thread, for the note on its errors
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self.done = False
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

    def _produce(self, source: Callable[[], Iterable[Item]]) -> None:
        items: Iterable[Item] = ()
        try:
            items = source()
            for item in items:
                if not self._put(item):
                    return
            self._put(_END)
        # every kind, KeyboardInterrupt and SystemExit too: left to this thread they would end the epoch as if the
        # generator were exhausted (threading drops SystemExit silently); the consumer re-raises it, with this traceback
        except BaseException as e:
            e.add_note(f"(raised in {self._label}, on its prefetch thread)")
            self._put(_Failure(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:  # run the user's generator cleanup when stopped early
                close()

    def get(self) -> Item | None:
        """Next item, ``None`` at the end (or once closed); re-raises the generator's exception."""
        while not self.done and not self._stop.is_set():
            try:
                item = self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                if self._thread.is_alive() or not self._queue.empty():
                    continue
                break  # the producer died without a word
            if item is _END:
                break
            if isinstance(item, _Failure):
                self.done = True
                raise item.error
            return item
        self.done = True
        return None

    def close(self, timeout: float) -> None:
        """Stop the producer; a generator blocked inside ``next`` past ``timeout`` is left to exit alone."""
        self._stop.set()
        self._thread.join(timeout)
