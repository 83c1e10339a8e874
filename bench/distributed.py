"""2 processes (gloo) vs 2 threads: the same 2-stage pipeline, and the cost of one cut-variable message.

MLP 8 x 2048, global batch 2048, 8 micro-batches of 256 (the config of bench/throughput.py), 1F1B.
The parent process measures the threaded pipeline, then launches itself as 2 processes with
``staticpipe.launch``; rank 1 reports its step time and the round-trip time of one micro-batch's
activation (256 x 2048 float32, 2 MiB) between the ranks.

    python bench/distributed.py [--steps 3]
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
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank-report", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_report:  # inside the 2-process job
        times, exe, net = step_times(args.steps)
        trip = message_round_trip()
        if os.environ["PADDLE_TRAINER_ID"] == "1":
            print(f"RESULT {statistics.median(times)} {trip}", flush=True)
        return
    threaded = statistics.median(step_times(args.steps)[0])
    out = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", __file__, "--steps",
                          str(args.steps), "--rank-report"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    processes, trip = (float(x) for x in line.split()[1:])
    print(f"MLP 8 x 2048, batch 2048, 8 micro-batches, 1F1B, median of {args.steps} steps")
    print(f"{'2 threads (one process)':<28} {threaded:7.3f} s/step  {2048 / threaded:7.1f} samples/s")
    print(f"{'2 processes (gloo)':<28} {processes:7.3f} s/step  {2048 / processes:7.1f} samples/s  "
          f"({threaded / processes:.2f}x the threaded run)")
    print(f"one 2 MiB activation message, rank 0 -> 1 -> 0: {trip * 1e3:.1f} ms round trip, "
          f"{trip / 2 * 1e3:.1f} ms one way; a step sends {2 * 8} such messages")


if __name__ == "__main__":
    main()
