"""Producer processes: the prefetch thread's twin for sources whose Python work would hold the GIL that
the pipeline's workers need, and the in-order merge of several of them (a dataset loader's workers).

Why ``fork``: a source is a closure over the user's generator or dataset, which a spawned process could
only get by pickling; a forked child inherits it. Why a pipe the parent does not write to: when the child
dies, even half way through sending a batch, the parent reads end-of-file instead of waiting forever.
Items are pickled on the child's producing thread, so an item that cannot be pickled fails there as the
source's error, and a sender thread writes them out, so that the source runs ``capacity`` items ahead.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Sequence

from .prefetch import Item, Producer

NAME = "staticpipe.io.DataLoader"  # every producer process's name, for ``multiprocessing.active_children()``
_CONTEXT = multiprocessing.get_context("fork")
_POLL_S = 0.05
_FORK_LOCK = threading.Lock()  # one freeze-fork-unfreeze at a time: another thread's unfreeze must not come between


class ProcessPrefetcher:
    """Runs ``source`` in a forked child, up to ``capacity`` items ahead; ``get``/``close`` as ``Prefetcher``.

    ``label`` names the child in errors; ``init`` runs in the child first (a worker's ``worker_init_fn``);
    ``timeout`` > 0 bounds the wait for one item, in seconds, as ``paddle.io.DataLoader``'s ``timeout``.
    """

    def __init__(
        self,
        source: Callable[[], Iterable[Item]],
        capacity: int,
        label: str = "the staticpipe DataLoader's producer process",
        init: Callable[[], None] | None = None,
        timeout: float = 0,
    ) -> None:
        self._label = label
        self._timeout = timeout
        self.done = False
        self._reader, writer = _CONTEXT.Pipe(duplex=False)
        args = (source, init, writer, capacity, label, os.getpid())
        self._process = _CONTEXT.Process(target=_produce, args=args, name=NAME, daemon=True)
        with _FORK_LOCK:  # the child never collects what it inherits (see _produce); the parent goes on collecting
            ours = not gc.get_freeze_count()  # a process that froze objects itself keeps its arrangement as it is
            if ours:
                gc.freeze()
            try:
                self._process.start()
            finally:
                if ours:
                    gc.unfreeze()
        writer.close()  # the child now holds the only write end: its death reads as end-of-file here

    def get(self) -> Item | None:
        """Next item, ``None`` at the end (or once closed); re-raises the source's exception."""
        deadline = time.monotonic() + self._timeout if self._timeout else None
        while not self.done:
            if not self._reader.poll(_POLL_S):
                if deadline is not None and time.monotonic() > deadline:
                    self.done = True
                    raise RuntimeError(f"{self._label} (pid {self._process.pid}) sent no batch within "
                                       f"timeout={self._timeout} s")
                if self._process.is_alive() or self._reader.poll(0):
                    continue
                raise self._died()
            try:
                kind, payload = pickle.loads(self._reader.recv_bytes())
            except (EOFError, OSError):
                raise self._died() from None
            if kind == "item":
                return payload
            self.done = True
            if kind == "error":
                raise payload
            if kind == "failure":
                raise RuntimeError(payload)
        return None

    def _died(self) -> RuntimeError:
        self.done = True
        self._process.join(1.0)
        code = self._process.exitcode
        how = f" (killed by signal {_signal_name(-code)})" if code is not None and code < 0 else ""
        return RuntimeError(f"{self._label} (pid {self._process.pid}) died with exit code {code}{how} before the "
                            "end of its epoch; the batches it had not sent are lost")

    def close(self, timeout: float) -> None:
        """Stop the child now (terminate, then kill after ``timeout``): it holds nothing worth a graceful exit."""
        self.done = True
        process = self._process
        if process.exitcode is None:
            process.terminate()
            process.join(timeout)
            if process.exitcode is None:
                process.kill()
                process.join(timeout)
        self._reader.close()


class RoundRobin:
    """Producers that each make every n-th item of one stream (worker k: items k, k+n, ...), read in order."""

    def __init__(self, producers: Sequence[Producer]) -> None:
        self._producers = list(producers)
        self._turn = 0
        self.done = False

    def get(self) -> Item | None:
        if self.done:
            return None
        self.done = True  # until the item arrives: after an error or the end, the stream stays ended
        item = self._producers[self._turn].get()
        self._turn = (self._turn + 1) % len(self._producers)
        self.done = item is None
        return item

    def close(self, timeout: float) -> None:
        self.done = True
        for producer in self._producers:
            producer.close(timeout)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return str(number)


def _produce(source: Callable[[], Iterable[Item]], init: Callable[[], None] | None, writer: Any, capacity: int,
             label: str, parent: int) -> None:
    """The child: sends ``("item", item)`` for each item of ``source()``, then ``("end", None)``, or the
    failure that ended it (``_failure``)."""
    # What the parent left unreachable is never collected here: the parent froze it (``gc.freeze``) before the
    # fork, because the first collection runs inside the fork itself (threading's after-fork hook), before this
    # function. Finalized here, on a copy of the parent's state without its threads, Paddle objects (scopes, a
    # paddle.io loader's BufferedReader waiting for its reader thread) and other threads' greenlets hung or
    # crashed the child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then stops this child
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Paddle's handler would print a crash report on close()
    outbox: queue.Queue = queue.Queue(capacity)
    sender = threading.Thread(target=_send, args=(outbox, writer), daemon=True)
    sender.start()

    def put(data: bytes | None) -> None:
        while True:
            try:
                outbox.put(data, timeout=_POLL_S)
                return
            except queue.Full:
                if os.getppid() != parent or not sender.is_alive():
                    os._exit(0)  # orphaned, or the parent closed its end: no one will read

    def message(kind: str, payload: Any) -> bytes:
        return pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)

    try:
        if init is not None:
            init()
        for item in source():
            put(message("item", item))
        put(message("end", None))
    except BaseException as error:  # every failure is the consumer's to see
        put(message(*_failure(error, label)))
    put(None)
    sender.join()


def _send(outbox: queue.Queue, writer: Any) -> None:
    while (data := outbox.get()) is not None:
        try:
            writer.send_bytes(data)
        except OSError:  # the parent is gone or closed its end
            return


def _failure(error: BaseException, label: str) -> tuple[str, Any]:
    """What carries ``error`` to the consumer: the exception itself where it survives pickling, so that the
    consumer raises the same type (a ``KeyboardInterrupt`` or ``SystemExit`` the source raised too: the
    consumer, as with the prefetch thread, decides what it ends), else its text for a ``RuntimeError``; the
    child's traceback either way."""
    text = "".join(traceback.format_exception(error)).rstrip()
    error.add_note(f"(raised in {label}, pid {os.getpid()}; the traceback there:\n{text})")
    try:
        pickle.loads(pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL))
        return "error", error
    except Exception:  # an exception class that cannot be rebuilt from its pickle
        return "failure", f"{label} (pid {os.getpid()}) raised {type(error).__qualname__}: {error}\n{text}"
