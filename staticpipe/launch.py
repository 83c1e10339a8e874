"""``python -m staticpipe.launch --nprocs N script.py [args]``: one pipeline rank per process on this machine.

Each process runs the same script with the ``paddle.distributed`` environment of its rank (gloo on
CPU, loopback ports chosen free); ``staticpipe.Executor`` sees it, joins the job and runs only its own
stages. ``python -m paddle.distributed.launch`` works as well; this is the thin local variant.

How a job ends, each way with one ``staticpipe.launch: ...`` line on stderr naming the cause:

- every rank exits 0: exit code 0, nothing printed.
- a rank exits non-zero: the others are stopped (SIGTERM, SIGKILL after ``grace_s``) and the launcher
  exits with that rank's code (1 for a rank killed by a signal): "rank 1 exited with code 7; stopping
  the other ranks", "rank 1 was killed by signal SIGKILL; ...". A rank stopped by its watchdog because
  of another (code ``STOPPED_EXIT``) is not the one named: it reports the culprit in a file
  (``runtime/watchdog.py``) and the launcher names that rank, exit code 1: at once when it went silent
  yet still runs ("rank 1 stopped sending heartbeats for 3.1 s (frozen or hung)"; it gets SIGKILL, as it
  may never act on SIGTERM); else once every rank has ended, or ``wait_origin_s`` after the first one
  did while the culprit has not exited by itself with its own code ("rank 1 exited in the middle of a
  step (...)" for a rank whose ``sys.exit(0)`` left a peer waiting for it).
- ``--max-restarts N`` (default 0: none) and a rank fails: once the other ranks have stopped as above,
  every rank starts again (fresh ports) ``--restart-delay`` seconds later (default 1.0), N times at
  most, and resumes from its job's newest checkpoint. Instead of the line above, one line once the
  ranks have stopped: "rank 1 was killed by signal SIGKILL at step 7; restart 1 of 3 in 1.0 s, resuming
  from ckpt/step-00000006 (1 step lost)" (``launch_restarts``). The failure that finds no restart left ends
  the job as above: "... at step 9 in run 4 of 4; no restart left, stopped the other ranks", or "... at
  step 3 in each of the 4 runs: the same failure every time (a bug, not a fault); not restarting again".
  Every run's ranks get the ``restarts`` variables: the run's number of restarts and the job's id (one
  per launch), also with N = 0 (harmless); with N > 0 the file to report their progress in.
- SIGINT, SIGTERM or SIGHUP to the launcher: forwarded to every running rank, which gets ``grace_s``
  to exit before SIGKILL (at once on a second signal); exit code 128 + the signal's number (130, 143,
  129): "SIGTERM received; stopped ranks 0, 1"; between runs, "... no rank was running", and no run
  starts after it. A signal the launcher was started ignoring (SIGINT under ``cmd &`` in a script)
  stays ignored, by its ranks too. Python runs signal handlers in the main thread only: ``launch``
  called from another thread forwards nothing.
- Ctrl-Z (SIGTSTP): the launcher stops the ranks with SIGSTOP, then itself, and resumes them when it
  is resumed (``fg``, ``bg``).
- the launcher dies, even by SIGKILL: the kernel SIGKILLs every rank (``PR_SET_PDEATHSIG``; Linux only,
  elsewhere the ranks run on).
- ``--nprocs`` below 1, ``--max-restarts`` below 0, a ``--restart-delay`` that is not a number of seconds
  >= 0, or a script that does not exist: refused (exit code 2) before any rank starts.

Each rank runs in a session of its own: a terminal's Ctrl-C reaches the launcher alone, which forwards it
once, and a signal to the rank's process group reaches the processes the rank started (loader workers).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

from .launch_restarts import Runs
from .placement import cuda_device_count
from .runtime.watchdog import ENV_REPORT, STOPPED_EXIT

GRACE_S = 10.0  # how long a stopped rank may take to exit before SIGKILL
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def rank_environments(nprocs: int) -> list[dict[str, str]]:
    """The ``paddle.distributed`` variables of each rank of a job on this machine (loopback ports)."""
    ports = free_ports(nprocs + 1)
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports[1:])
    gpus = cuda_device_count() >= nprocs  # a GPU per rank: NCCL, rank r on GPU r; else gloo on CPU
    return [dict(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(nprocs),
                 PADDLE_DISTRI_BACKEND="nccl" if gpus else "gloo", PADDLE_MASTER=f"127.0.0.1:{ports[0]}",
                 PADDLE_TRAINER_ENDPOINTS=endpoints, PADDLE_CURRENT_ENDPOINT=f"127.0.0.1:{ports[rank + 1]}",
                 **({"FLAGS_selected_gpus": str(rank)} if gpus else {})) for rank in range(nprocs)]


def launch(nprocs: int, argv: list[str], poll_s: float = 0.2, wait_origin_s: float = 5.0,
           grace_s: float = GRACE_S, max_restarts: int = 0, restart_delay_s: float = 1.0) -> int:
    """Run ``python argv...`` as ranks 0 .. nprocs - 1 until they end, again after a failure up to
    ``max_restarts`` times; the launcher's exit code."""
    with tempfile.TemporaryDirectory(prefix="staticpipe-launch-") as reports:
        job, runs = Job(reports), Runs(reports, nprocs, max_restarts, restart_delay_s)
        with job.signals_handled():
            while True:
                job.start(nprocs, argv, runs.environments())
                code = job.watch(poll_s, wait_origin_s, grace_s, announce=max_restarts == 0)
                if job.failure is None or max_restarts == 0:
                    return code
                failed = runs.failed(job.failure.why, job.failure.rank, job.procs[job.failure.rank].returncode)
                if job.received:  # while the ranks were being stopped: no restart, the signal's exit code
                    print(f"staticpipe.launch: {failed}; stopped the other ranks", file=sys.stderr, flush=True)
                    return job.interrupted(grace_s)
                line = runs.next(failed)
                print(f"staticpipe.launch: {line or runs.last(failed)}", file=sys.stderr, flush=True)
                if line is None:
                    return code
                if not job.pause(restart_delay_s):
                    return job.interrupted(grace_s)


class Failure(NamedTuple):
    """What ended a run: the verdict naming the culprit ``rank``, the launcher's exit code for it, and
    whether the rank froze (it still runs)."""

    why: str
    code: int
    rank: int
    frozen: bool = False


class Job:
    """The ranks of one run of a launch, the signals the launcher received, and the ranks' reports."""

    def __init__(self, reports: str):
        self.reports = reports
        self.procs: list[subprocess.Popen] = []
        self.received: list[int] = []
        self.failure: Failure | None = None  # the failure that ended the run, once ``watch`` found it

    def start(self, nprocs: int, argv: list[str], restart_envs: list[dict[str, str]]) -> None:
        """Start a run: the ranks of a restart run with new ports and, like the first, no watchdog report."""
        self.procs, self.failure = [], None
        try:
            for rank, env in enumerate(rank_environments(nprocs)):
                env[ENV_REPORT] = os.path.join(self.reports, f"rank{rank}.json")
                with contextlib.suppress(FileNotFoundError):  # the previous run's: ``verdict`` reads it
                    os.remove(env[ENV_REPORT])
                env.update(restart_envs[rank])
                self.procs.append(subprocess.Popen([sys.executable] + argv, env=dict(os.environ, **env),
                                                   start_new_session=True, preexec_fn=_dies_with(os.getpid())))
        except BaseException:  # the ranks started so far must not run on alone
            self.signal_all(signal.SIGKILL)
            for p in self.procs:
                p.wait()
            raise

    def watch(self, poll_s: float, wait_origin_s: float, grace_s: float, announce: bool = True) -> int:
        """Until the run ends: the launcher's exit code. A failure (``self.failure``) stops the other ranks,
        ``announce``: after a line naming it."""
        failed_at = None
        while True:
            if self.received:
                return self.interrupted(grace_s)
            codes = [p.poll() for p in self.procs]
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            self.failure = self.verdict(codes, failed_at is not None and time.monotonic() - failed_at > wait_origin_s)
            if self.failure is not None:
                if announce:
                    print(f"staticpipe.launch: {self.failure.why}; stopping the other ranks", file=sys.stderr,
                          flush=True)
                if self.failure.frozen:  # it would act on SIGTERM late or never
                    self.signal_rank(self.failure.rank, signal.SIGKILL)
                self.stop(signal.SIGTERM, grace_s)
                return self.failure.code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(poll_s)

    def interrupted(self, grace_s: float) -> int:
        """The first signal received, forwarded to the running ranks (none between runs), and its line."""
        signum = self.received[0]
        running, killed = self.stop(signum, grace_s, handled=1)
        stopped = f"stopped ranks {', '.join(map(str, running))}" if running else "no rank was running"
        late = f" (killed with SIGKILL: {', '.join(map(str, killed))})" if killed else ""
        print(f"staticpipe.launch: {signal.Signals(signum).name} received; {stopped}{late}", file=sys.stderr,
              flush=True)
        return 128 + signum

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` between runs unless a signal comes first (it ends the job): True if none came."""
        deadline = time.monotonic() + seconds
        while not self.received and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return not self.received

    def verdict(self, codes: list[int | None], waited: bool) -> Failure | None:
        """What ended the run once a rank failed, else None. A rank that exits
        non-zero by itself is named. One stopped by its watchdog (``STOPPED_EXIT``) was stopped because
        of another rank, which its report names: the silent one still running, at once; else the one
        that failed, when it has not exited by itself (``waited``) or every rank has."""
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        for rank, code in failed:
            if code != STOPPED_EXIT:
                return Failure(_exit_words(rank, code), code if code > 0 else 1, rank)
        reports = [r for r in (self.report(rank) for rank, _ in failed) if r is not None]
        for r in reports:
            if r["silent_s"] is not None and codes[r["rank"]] is None:
                silent = f"stopped sending heartbeats for {r['silent_s']:.1f} s (frozen or hung)"
                return Failure(f"rank {r['rank']} {silent}", 1, r["rank"], frozen=True)
        if not failed or not (waited or None not in codes):
            return None
        if reports:
            return Failure(reports[0]["why"], 1, reports[0]["rank"])
        rank, code = failed[0]
        return Failure(_exit_words(rank, code), code, rank)

    def report(self, rank: int) -> dict | None:
        """What rank ``rank``'s watchdog wrote before stopping it: the culprit's rank and why; or None."""
        try:
            with open(os.path.join(self.reports, f"rank{rank}.json"), encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError):
            return None
        return report if report.get("rank") in range(len(self.procs)) else None

    def stop(self, signum: int, grace_s: float, handled: int = 0) -> tuple[list[int], list[int]]:
        """Send ``signum`` to every running rank (with SIGCONT: a stopped rank acts on it only when it runs);
        SIGKILL those still running after ``grace_s``, or at once when another signal comes: any received
        beyond the first ``handled`` (the one being forwarded), also one that came before this call -- on a
        loaded machine a second Ctrl-C can arrive before the loop in ``watch`` has acted on the first.
        (the ranks that were running, those that had to be killed)."""
        running = [rank for rank, p in enumerate(self.procs) if p.poll() is None]
        self.signal_all(signum)
        self.signal_all(signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while (any(self.procs[r].poll() is None for r in running) and time.monotonic() < deadline
               and len(self.received) <= handled):
            time.sleep(0.05)
        killed = [r for r in running if self.procs[r].poll() is None]
        self.signal_all(signal.SIGKILL)
        for r in running:
            self.procs[r].wait()
        return running, killed

    def signal_all(self, signum: int) -> None:
        for rank in range(len(self.procs)):
            self.signal_rank(rank, signum)

    def signal_rank(self, rank: int, signum: int) -> None:
        """``signum`` to the process group of ``rank`` (the rank and its children) unless it was reaped."""
        if self.procs[rank].returncode is None:
            try:
                os.killpg(self.procs[rank].pid, signum)
            except ProcessLookupError:  # exited since
                pass

    def suspend(self, signum, frame) -> None:
        """Ctrl-Z: the ranks have sessions of their own, so stop them here, then the launcher; resume them
        when it resumes (SIGSTOP, not the SIGTSTP the terminal sent: it always stops)."""
        self.signal_all(signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)
        self.signal_all(signal.SIGCONT)

    @contextlib.contextmanager
    def signals_handled(self):
        """While the job runs: FORWARDED signals are recorded (``watch`` forwards them), SIGTSTP suspends.
        Python runs handlers in the main thread only: called from another, ``launch`` handles none."""
        handlers = {s: self.record for s in FORWARDED} | {signal.SIGTSTP: self.suspend}
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, h) for s, h in handlers.items()
                    if main and signal.getsignal(s) is not signal.SIG_IGN}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)  # None: set outside Python

    def record(self, signum, frame) -> None:
        self.received.append(signum)


def _exit_words(rank: int, code: int) -> str:
    """How rank ``rank`` ended with return code ``code``: its exit code, or the signal that killed it (< 0)."""
    if code >= 0:
        return f"rank {rank} exited with code {code}"
    try:
        return f"rank {rank} was killed by signal {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal Python has no name for
        return f"rank {rank} was killed by signal {-code}"


def _dies_with(parent: int):
    """A rank's ``preexec_fn`` (run in the child before exec): the kernel SIGKILLs the rank when the
    launcher dies, however it dies (Linux's PR_SET_PDEATHSIG); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up in the launcher: the child only calls it

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)
    return arm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", type=int, required=True, help="processes: one per pipeline device")
    ap.add_argument("--max-restarts", type=int, default=0, metavar="N",
                    help="after a rank fails, run the job again (from its newest checkpoint) up to N times")
    ap.add_argument("--restart-delay", type=float, default=1.0, metavar="S",
                    help="seconds between a failure and its restart (default 1.0)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.nprocs < 1:
        ap.error(f"--nprocs must be >= 1, got {args.nprocs}")
    if args.max_restarts < 0:
        ap.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not 0 <= args.restart_delay < math.inf:
        ap.error(f"--restart-delay must be a number of seconds >= 0, got {args.restart_delay}")
    if not os.path.exists(args.script):
        ap.error(f"script {args.script!r} does not exist (from {os.getcwd()})")
    sys.exit(launch(args.nprocs, [args.script] + args.args, max_restarts=args.max_restarts,
                    restart_delay_s=args.restart_delay))


if __name__ == "__main__":
    main()
