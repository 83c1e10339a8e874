"""2 processes (gloo) vs 2 threads: the same 2-stage pipeline, and the cost of one cut-variable message.

MLP 8 x 2048, global batch 2048, 8 micro-batches of 256 (the config of bench/throughput.py), 1F1B.
Rounds alternate: the parent process measures ``--steps`` steps of the threaded pipeline, then launches
itself as 2 processes with ``staticpipe.launch`` for as many steps, ``--rounds`` times, so that a slow
spell of the machine hits both alike; the medians over all rounds are compared. In the 2-process job,
rank 1 also reports the round trip of one micro-batch's activation (256 x 2048 float32, 2 MiB) rank 0
-> 1 -> 0, timed after a barrier (both ranks idle: a first message would otherwise wait for the other
rank's last backward).

    python bench/distributed.py [--steps 3] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import staticpipe  # noqa: E402
from models import build_mlp  # noqa: E402
import numpy as np  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)


def step_times(steps: int) -> tuple[list[float], staticpipe.Executor, object]:
    net = build_mlp(num_stages=2, in_dim=2048, hidden=2048, depth=8)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9),
                                     num_microbatches=8).minimize(net.loss)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    batch = net.random_batch(2048)
    exe.run(net.main, feed=batch)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        exe.run(net.main, feed=batch)
        times.append(time.perf_counter() - start)
    return times, exe, net


def message_round_trip(repeats: int = 10) -> float:
    """Seconds for one 2 MiB message from rank 0 to rank 1 and back, through a channel like the
    pipeline's (the executor has joined the job; this channel makes process groups of its own)."""
    from staticpipe.runtime.distributed import DistributedChannel

    channel = DistributedChannel([0, 1], 2)
    payload = {"x": np.ones((256, 2048), dtype=np.float32)}
    rank = channel.rank
    channel.allreduce(("bench", "ready"), rank, np.zeros(1, np.float32), 2)  # both ranks idle from here
    start = time.perf_counter()
    for k in range(repeats):
        if rank == 0:
            channel.send(("bench", k), payload, 1)
            channel.recv(("bench-back", k), 1)
        else:
            channel.send(("bench-back", k), channel.recv(("bench", k), 0), 0)
    channel.flush()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and configuration")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank-report", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_report:  # inside the 2-process job
        times, exe, net = step_times(args.steps)
        trip = message_round_trip()
        if os.environ["PADDLE_TRAINER_ID"] == "1":
            print("RESULT " + " ".join(map(str, times + [trip])), flush=True)
        return
    threaded, processes, trips = [], [], []
    for _ in range(args.rounds):  # alternating, so both meet the machine's slow spells alike
        threaded += step_times(args.steps)[0]
        out = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", __file__, "--steps",
                              str(args.steps), "--rank-report"], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT), check=True).stdout
        values = [float(x) for x in next(ln for ln in out.splitlines() if ln.startswith("RESULT")).split()[1:]]
        processes += values[:-1]
        trips.append(values[-1])
    one, two, trip = statistics.median(threaded), statistics.median(processes), statistics.median(trips)
    print(f"MLP 8 x 2048, batch 2048, 8 micro-batches, 1F1B, median of {args.rounds} alternating rounds of "
          f"{args.steps} steps")
    print(f"{'2 threads (one process)':<28} {one:7.3f} s/step  {2048 / one:7.1f} samples/s")
    print(f"{'2 processes (gloo)':<28} {two:7.3f} s/step  {2048 / two:7.1f} samples/s  "
          f"({one / two:.2f}x the threaded run)")
    print(f"one 2 MiB activation message, rank 0 -> 1 -> 0 after a barrier: {trip * 1e3:.1f} ms round trip, "
          f"{trip / 2 * 1e3:.1f} ms one way; a step sends {2 * 8} such messages")


if __name__ == "__main__":
    main()
