"""Throughput of a 2-stage pipeline against the unsplit program, measured side by side in one run.

The pipeline row runs 1F1B; a last row shows the zero-bubble ZB-H1 schedule on the same stages.

Config (issue #2): MLP 8 x 2048, global batch 2048, 8 micro-batches of 256 rows, one thread per stage.
Compared with: the unsplit program on 1 intra-op thread, the unsplit program on 2 threads, and naive
model parallelism (the same two stages one after another, no micro-batches). Ratios > 1 favour the
pipeline. On 2 cores the ideal over 1 thread is 2 * m / (m + p - 1) = 1.78.

    python bench/throughput.py [--steps 5] [--batch 2048] [--microbatches 8] [--width 2048] [--depth 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from staticpipe.capabilities import cpu_model  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)
from paddle.base import core  # noqa: E402
from models import build_mlp  # noqa: E402


def build(args, guarded: bool, microbatches: int, schedule: str = "1F1B"):
    net = build_mlp(num_stages=2, guarded=guarded, in_dim=args.width, hidden=args.width, depth=args.depth)
    with paddle.static.program_guard(net.main, net.startup):
        opt = paddle.optimizer.Momentum(0.01, momentum=0.9)
        if guarded:
            opt = staticpipe.PipelineOptimizer(opt, num_microbatches=microbatches, schedule=schedule)
        opt.minimize(net.loss)
    return net


def pipeline(args, microbatches: int, batch, schedule: str = "1F1B") -> Callable[[], None]:
    net = build(args, True, microbatches, schedule)
    exe = staticpipe.Executor(threads_per_stage=1, worker_threads=None)  # a thread per stage, from the first step
    exe.run(net.startup)
    return lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss])


def unsplit(args, threads: int, batch) -> Callable[[], None]:
    net = build(args, False, 1)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(net.startup, scope=scope)

    def step() -> None:
        core.set_num_threads(threads)
        exe.run(net.main, feed=batch, fetch_list=[net.loss], scope=scope)
        core.set_num_threads(1)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (one step of every configuration each)")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=8)
    args = ap.parse_args()
    paddle.enable_static()
    batch = build_mlp(num_stages=2, guarded=False, in_dim=args.width, hidden=args.width,
                      depth=args.depth).random_batch(args.batch)
    print(f"{cpu_model()}; MLP {args.depth} x {args.width}, global batch {args.batch}, {args.microbatches} micro-batches "
          f"of {args.batch // args.microbatches}, {os.cpu_count()} CPU cores, {args.steps} interleaved timed rounds")
    steps = {
        "pipeline 2 stages x 1 thread": pipeline(args, args.microbatches, batch),
        "unsplit, 1 thread": unsplit(args, 1, batch),
        "unsplit, 2 threads": unsplit(args, 2, batch),
        "naive model parallel (2 stages, 1 micro-batch)": pipeline(args, 1, batch),
        "pipeline 2 stages x 1 thread, ZB-H1": pipeline(args, args.microbatches, batch, "ZB-H1"),
    }
    # Interleaved rounds: a slow spell of the machine hits every configuration alike, and the median
    # of each configuration's rounds is compared.
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    results = {name: statistics.median(t) for name, t in times.items()}
    base = results["pipeline 2 stages x 1 thread"]
    print(f"{'configuration':<48} {'s/step (median)':>15} {'samples/s':>10} {'pipeline speed-up':>18}")
    for name, sec in results.items():
        print(f"{name:<48} {sec:15.3f} {args.batch / sec:10.1f} {sec / base:17.2f}x")
    m, p = args.microbatches, 2
    print(f"ideal pipeline speed-up over 1 thread: {2 * m / (m + p - 1):.2f}x; targets: >= 1.70x over "
          "unsplit-1-thread, >= 1.05x over unsplit-2-threads")


if __name__ == "__main__":
    main()
