"""Fault watchdog of a job of several processes: a rank that fails, dies or freezes stops every other rank.

Why: a rank waits for its peers inside gloo's C++ ``recv``, which nothing in Python can interrupt; a peer
that raised or was killed would leave it blocked until gloo's own timeout. So every rank runs a daemon
thread that talks to the job's TCPStore (the one ``paddle.distributed`` already has, served by rank 0;
the watchdog opens a client connection of its own because Paddle's client is not thread-safe):

- it adds 1 to ``hb/<rank>`` every ``BEAT_S`` seconds (a thread, not step progress: long steps are fine);
- a rank whose step fails (``Executor``) or whose script raises publishes a failure record
  (``why/<rank>``, then ``failed/<rank>`` and the job's ``faults`` count) -- unless another rank's
  record is there already, or the error is gloo's broken connection: then another rank failed first,
  and this one waits for the monitor to name it -- or names at once a peer that has left: that peer
  exited while this rank still needed it (``sys.exit(4)`` between steps, say: its atexit cannot tell
  that from a normal end, and cannot learn the exit code; the launcher knows it);
- each round it reads ``faults`` and its peers' heartbeats. On a failure record, on a peer whose
  heartbeat stopped for ``timeout_s`` (the peer's record is then published for the others), or when
  the store itself is gone (rank 0 died), it prints ``staticpipe: <why>; stopping rank <r>`` to stderr
  and ends the process with ``os._exit(STOPPED_EXIT)``;
- a frozen or hung rank 0 (SIGSTOP, a deadlock) keeps its socket open but never answers: a store call
  then blocks for good (Paddle's client has no reply timeout; tested: it returns when rank 0 is
  resumed). So on the other ranks a second thread, the guard, ends the process when a store call has
  not returned for ``timeout_s`` (noticed within ``timeout_s + BEAT_S``), without touching the store.
  Nothing ends the frozen rank 0 itself but a launcher; resumed, it finds its peers' heartbeats gone
  and stops ``timeout_s`` later naming one of them (nobody could write the true record to its store);
- under ``staticpipe.launch`` (``STATICPIPE_REPORT`` set) a rank that stops also writes the culprit
  to that file as JSON, ``{"rank": 1, "why": "...", "silent_s": 3.1}`` (``silent_s``: the culprit went
  silent, not failed): the launcher names that rank, never the one its watchdog stopped.
- Leaving normally (atexit) adds 1 to ``left/<rank>``: peers stop watching a rank that left. Rank 0
  serves the store, so it stays until every peer has left (or died), ``timeout_s`` at most; a rank that
  saw rank 0 leave stops watching when the store goes. When rank 0 stops a job, it waits a few seconds
  for the others to read why. So a rank 0 that exits in the middle of the job stops the others only
  ``timeout_s`` later (its gloo connections close when its process ends).

Reads are ``store.add(key, 0)``, which never blocks (``get`` waits for a missing key). A store call takes
about 45 ms on loopback (small writes meet delayed ACKs) and releases the GIL: a round of 2 + peers
calls costs the training nothing measurable. ``STATICPIPE_HEARTBEAT_TIMEOUT`` (seconds, default 20)
sets how long a silent peer is tolerated; 0 turns the watchdog off.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import threading
import time
from typing import NamedTuple

from .._paddle import core

ENV_TIMEOUT = "STATICPIPE_HEARTBEAT_TIMEOUT"
ENV_REPORT = "STATICPIPE_REPORT"  # set by staticpipe.launch: where a stopping rank names the culprit
DEFAULT_TIMEOUT_S = 20.0  # a killed rank is noticed within about 21 s
BEAT_S = 1.0  # heartbeat and check period
LINGER_S = 3.0  # how long rank 0 keeps the store up for the others after it stopped the job
STOPPED_EXIT = 3  # exit code of a rank stopped because another one failed (the launcher names the other)
PREFIX = "staticpipe/watchdog/"
PADDLE_STACK = "In user code:"
GLOO_SOURCE = "/gloo/transport/"  # in the message of every gloo transport error
FAULTS = PREFIX + "faults"


class Stop(NamedTuple):
    """Why a rank stops: the rank to blame, the line to print, and for how long it was silent if it
    went silent rather than failed (the launcher then knows it is frozen or hung while still running)."""
    culprit: int
    why: str
    silent_s: float | None = None


_started: Watchdog | None = None


def store_address() -> str:
    """host:port of the job's TCPStore, found as ``paddle.distributed.init_parallel_env`` finds it."""
    env = os.environ
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return env.get("PADDLE_MASTER") or env["PADDLE_TRAINER_ENDPOINTS"].split(",")[0]


def heartbeat_timeout() -> float:
    value = os.environ.get(ENV_TIMEOUT, str(DEFAULT_TIMEOUT_S))
    try:
        timeout = float(value)
    except ValueError:
        timeout = -1.0
    if timeout < 0:
        raise ValueError(f"{ENV_TIMEOUT} must be a number of seconds >= 0 (0: no watchdog), got {value!r}")
    return timeout


def start(rank: int, size: int) -> Watchdog | None:
    """The process's watchdog, started on first use; None when ``STATICPIPE_HEARTBEAT_TIMEOUT=0``."""
    global _started
    timeout = heartbeat_timeout()
    if _started is None and timeout > 0:
        _started = Watchdog(rank, size, store_address(), timeout)
        _started.start()
    return _started


def _key(kind: str, rank: int) -> str:
    return f"{PREFIX}{kind}/{rank}"


def describe(error: BaseException) -> str:
    """``Type: first line of the message``, one line for a record. A Paddle op error's first line ends
    with "In user code:" (the op's creation stack follows): its "XxxError: ..." line stands for it."""
    lines = str(error).strip().splitlines() or [""]
    head = lines[0]
    if head.endswith(PADDLE_STACK):
        found = [line.strip() for line in lines if re.match(r"\s*\w+Error: ", line)]
        head = head[:-len(PADDLE_STACK)] + found[-1] if found else head
    return f"{type(error).__name__}: {head}"[:500] if head else type(error).__name__


def lost_a_peer(error: BaseException | None) -> bool:
    """Whether ``error`` (or its cause) comes from gloo's transport: a connection to another rank broke."""
    for _ in range(8):
        if error is None:
            return False
        if GLOO_SOURCE in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


class Watchdog:
    def __init__(self, rank: int, size: int, address: str, timeout_s: float, beat_s: float = BEAT_S):
        self.rank, self.size, self.address = rank, size, address
        self.timeout_s, self.beat_s = timeout_s, beat_s
        host, port = address.rsplit(":", 1)
        self._store = core.TCPStore(host, int(port), False, 0, 900)
        self._lock = threading.RLock()  # one client connection: one call at a time
        self._call_since: float | None = None  # when the store call in progress began (guard thread)
        self._stop = threading.Event()
        self._halting = threading.Lock()
        self._thread = threading.Thread(target=self._monitor, daemon=True, name=f"staticpipe-watchdog-{rank}")
        now = time.monotonic()
        self._watched = {p: (-1, now) for p in range(size) if p != rank}  # peer -> (heartbeats, seen at)
        self._last_round = now
        self._failure: str | None = None  # this rank's published failure record
        self._left = False
        self._host_left = False  # rank 0 finished normally: its store goes away and that is fine

    @property
    def hosts_store(self) -> bool:
        return self.rank == 0  # paddle.distributed's TCPStore master

    def start(self) -> None:
        self._thread.start()
        if not self.hosts_store:  # rank 0's own store calls stay in its process: they cannot hang alone
            threading.Thread(target=self._guard, daemon=True, name=f"staticpipe-watchdog-guard-{self.rank}").start()
        atexit.register(self.leave)
        previous = sys.excepthook

        def excepthook(kind, value, tb):  # an uncaught error outside a step fails the job too
            self.publish_failure(describe(value))
            previous(kind, value, tb)
        sys.excepthook = excepthook

    # --- called by the process ------------------------------------------------------------------------
    def step_failed(self, error: BaseException, where: str = "") -> None:
        """The executor's step failed on this rank (called before it raises): publish the failure, unless
        gloo saw a connection to another rank break -- then that rank failed first, or left in the middle
        of the step: stop this process naming it, at once if its record or its leaving is in the store,
        else when the monitor learns which (its silence, or rank 0's store gone); publish this failure
        only if nothing is found within the heartbeat timeout."""
        if self._failure is None and not self._left and lost_a_peer(error):
            try:
                with self._calling():
                    earlier = self._peer_failure() or self._peer_gone()
            except Exception:  # noqa: BLE001 -- rank 0 is gone: the one if it had left, else the monitor names it
                earlier = self._gone(0) if self._host_left else None
            if earlier is not None:
                self._halt(earlier)
            self._thread.join(self.timeout_s + 3 * self.beat_s)  # ends early if rank 0 has left normally
        self.publish_failure(describe(error), where)

    def publish_failure(self, why: str, where: str = "") -> None:
        """Tell the other ranks that this rank failed (first failure only): "rank 1 (gpu:1) failed: ..."."""
        if self._failure is not None or self._left:
            return
        record = f"rank {self.rank}{f' ({where})' if where else ''} failed: {why}"
        try:
            with self._calling():
                earlier = self._peer_failure()  # then this failure is its consequence (gloo saw the peer go)
                if earlier is None:
                    self._publish(self.rank, record)
        except Exception:  # noqa: BLE001 -- rank 0 died (the likely cause of this failure), or left
            earlier = None if self._host_left else self._store_lost()
        if earlier is not None:
            self._halt(earlier)
        self._failure = record

    def leave(self) -> None:
        """Normal exit (atexit): stop the thread, mark this rank as left; rank 0 then serves the store
        until every peer has left or died, for ``timeout_s`` at most (a peer may wait for it in vain)."""
        if self._left:
            return
        self._stop.set()
        self._thread.join()
        try:
            with self._calling():
                self._store.add(_key("left", self.rank), 1)
                self._left = True
                deadline = time.monotonic() + self.timeout_s
                while self.hosts_store and self._watched and time.monotonic() < deadline:
                    stop = self._round(leaving=True)
                    if stop is not None:
                        self._halt(stop)
                    if self._watched:
                        time.sleep(self.beat_s)
        except Exception:  # the store is gone: nothing left to coordinate
            pass

    # --- the monitor thread ---------------------------------------------------------------------------
    def _monitor(self) -> None:
        while True:
            try:
                with self._calling():
                    if self._stop.is_set():
                        return
                    self._store.add(_key("hb", self.rank), 1)
                    stop = self._round()
            except Exception:  # noqa: BLE001 -- any store error means rank 0's process is gone
                if self._stop.is_set() or self._host_left:  # rank 0 finished: no store to watch with
                    return
                # after this rank's own failure, rank 0 may leave
                stop = Stop(self.rank, self._failure) if self._failure else self._store_lost()
            if stop is not None:
                self._halt(stop)
            if self._stop.wait(self.beat_s):
                return

    def _round(self, leaving: bool = False) -> Stop | None:
        """One check (store lock held): why this rank must stop, or None."""
        now = time.monotonic()
        stalled = now - self._last_round > self.timeout_s / 2 + 2 * self.beat_s  # this process did not run
        self._last_round = now
        if not leaving:
            stop = self._peer_failure()
            if stop is not None:
                return stop
        if not self.hosts_store and not self._host_left:
            self._host_left = self._store.add(_key("left", 0), 0) > 0
        for peer, (beats, seen) in list(self._watched.items()):
            now_beats = self._store.add(_key("hb", peer), 0)
            if now_beats != beats:
                self._watched[peer] = (now_beats, now)
            elif self._store.add(_key("left", peer), 0) > 0:
                del self._watched[peer]  # finished normally, or stopped by a failure already published
            elif stalled:  # the silence may be this process's: blame no peer yet
                self._watched[peer] = (now_beats, now)
            elif now - seen > self.timeout_s:
                why = f"rank {peer} stopped (no heartbeat for {now - seen:.1f} s)"
                del self._watched[peer]
                self._publish(peer, why)
                return Stop(peer, why, now - seen)
        if self._failure is not None and not self._watched and not leaving:
            return Stop(self.rank, self._failure)  # every peer has left: nothing will stop this failed rank
        return None

    # --- the guard thread (not on rank 0) ---------------------------------------------------------------
    def _guard(self) -> None:
        """Stop this rank when a store call has not returned for ``timeout_s``: rank 0 serves the store and
        is frozen or hung. Time this process itself did not run (stopped, starved) does not count."""
        resumed = time.monotonic()
        while True:
            last = time.monotonic()
            time.sleep(self.beat_s)
            now, since = time.monotonic(), self._call_since
            if now - last > 2 * self.beat_s:
                resumed = now
            elif since is not None and now - max(since, resumed) > self.timeout_s:
                if self._halting.locked():  # another thread, stopping this rank, hangs in its last store calls
                    os._exit(STOPPED_EXIT)
                silent = now - max(since, resumed)
                self._halt(Stop(0, f"rank 0 stopped (its TCPStore at {self.address} has not answered for "
                                   f"{silent:.1f} s)", silent), use_store=False)

    # --- store helpers (store lock held) --------------------------------------------------------------
    @contextlib.contextmanager
    def _calling(self):
        """Hold the store lock; the guard sees since when the outermost holder has been in a call."""
        with self._lock:
            outer = self._call_since
            if outer is None:
                self._call_since = time.monotonic()
            try:
                yield
            finally:
                self._call_since = outer

    def _peer_failure(self) -> Stop | None:
        """The failure record of another rank, if there is one."""
        if self._store.add(FAULTS, 0) > 0:
            for r in range(self.size):
                if r != self.rank and self._store.add(_key("failed", r), 0) > 0:
                    return Stop(r, bytes(self._store.get(_key("why", r))).decode())
        return None

    def _peer_gone(self) -> Stop | None:
        """A peer that has left (atexit) while this rank still exchanged with it: its record, published."""
        for peer in range(self.size):
            if peer != self.rank and self._store.add(_key("left", peer), 0) > 0:
                gone = self._gone(peer)
                self._publish(peer, gone.why)
                return gone
        return None

    def _gone(self, peer: int) -> Stop:
        return Stop(peer, f"rank {peer} exited in the middle of a step (rank {self.rank}'s exchange with it broke)")

    def _store_lost(self) -> Stop:
        return Stop(0, f"rank 0 stopped (its TCPStore at {self.address} is unreachable)")

    def _publish(self, rank: int, why: str) -> None:
        self._store.set(_key("why", rank), why.encode())
        self._store.add(_key("failed", rank), 1)
        self._store.add(FAULTS, 1)

    # --- stopping -------------------------------------------------------------------------------------
    def _halt(self, stop: Stop, use_store: bool = True) -> None:
        """Print why, tell the launcher whom to blame, and end the process now: its workers may be blocked
        in gloo for good. Rank 0 first serves the store a little longer: the others read why from it."""
        if not self._halting.acquire(blocking=False):  # the other thread is ending the process
            threading.Event().wait()
        print(f"staticpipe: {stop.why}; stopping rank {self.rank}", file=sys.stderr, flush=True)
        _report(stop)
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        try:
            if not use_store or not self._lock.acquire(timeout=LINGER_S):  # a store call hangs: no linger
                os._exit(STOPPED_EXIT)
            self._call_since = time.monotonic()  # the guard ends the process if these calls hang
            self._store.add(_key("left", self.rank), 1)
            deadline = time.monotonic() + LINGER_S
            while self.hosts_store and time.monotonic() < deadline and any(
                    self._store.add(_key("left", p), 0) == 0 for p in self._watched):
                time.sleep(0.2)
        except Exception:  # noqa: BLE001
            pass
        os._exit(STOPPED_EXIT)


def _report(stop: Stop) -> None:
    """Write ``stop`` where the launcher looks (``STATICPIPE_REPORT``), if it looks."""
    path = os.environ.get(ENV_REPORT)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"rank": stop.culprit, "why": stop.why, "silent_s": stop.silent_s}, f)
    except OSError as exc:  # the launcher then names this rank's exit code instead
        print(f"staticpipe: could not write the report for the launcher to {path}: {exc}", file=sys.stderr)
