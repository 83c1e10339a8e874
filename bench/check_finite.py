"""What ``Executor(check_finite=True)`` costs: the same pipeline with and without Paddle's NaN/Inf check of
every op's output, side by side in interleaved rounds.

The check reads every element every op writes (``FLAGS_check_nan_inf``), so its cost grows with the
activations: the table gives it for a small and a mid-sized MLP, 2 stages, 8 micro-batches, 1F1B.

    python bench/check_finite.py [--rounds 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from models import build_mlp  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)

SIZES = {"MLP 4 x 256, batch 256": (256, 256), "MLP 4 x 1024, batch 1024": (1024, 1024)}


def step(width: int, batch_size: int, check_finite: bool):
    net = build_mlp(num_stages=2, in_dim=width, hidden=width, depth=4)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.01), num_microbatches=8).minimize(net.loss)
    exe = staticpipe.Executor(check_finite=check_finite)
    exe.run(net.startup)
    batch = net.random_batch(batch_size)
    return lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    paddle.enable_static()
    print(f"{os.cpu_count()} CPU cores, {args.rounds} interleaved rounds, median s/step")
    print(f"{'model':<28} {'unchecked':>10} {'check_finite':>13} {'cost':>7}")
    for name, (width, batch) in SIZES.items():
        runs = {flag: step(width, batch, flag) for flag in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for run in runs.values():
            run()  # warm-up
        for _ in range(args.rounds):
            for flag, run in runs.items():
                start = time.perf_counter()
                run()
                times[flag].append(time.perf_counter() - start)
        plain, checked = statistics.median(times[False]), statistics.median(times[True])
        print(f"{name:<28} {plain:10.4f} {checked:13.4f} {checked / plain:6.2f}x")


if __name__ == "__main__":
    main()
