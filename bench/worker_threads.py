"""How many threads should run the stages? The same pipeline on 1, 2 and p worker threads, and with the
default ("auto": its first steps try those and keep the best), side by side.

``Executor(worker_threads=n)`` runs the CPU stages' ranks on n threads, consecutive ranks sharing one
and taking turns where one would wait (``runtime/lanes.py``); None runs a thread per rank; "auto"
(the default) measures each layout on the first steps (``runtime/thread_choice.py``). Two
pipelines of 1F1B over p=4 stages, interleaved rounds (a slow spell of the machine hits every
configuration alike), median step and mean CPU (all threads) per step:

- large stages (MLP 8 x 1024, batch 512, m=8): each action computes for milliseconds, so what counts is
  how well the threads keep the cores busy;
- tiny stages (MLP 4 x 64, batch 64, m=16): each action computes for tens of microseconds, so what
  counts is what a message between threads costs.

Ratios are against a thread per rank; < 1.00 is faster or cheaper. "threads" is how many threads the
steps ran on once warm (for "auto": the layout its trial kept).

    python bench/worker_threads.py [--rounds 7] [--stages 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from staticpipe.capabilities import cpu_model  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)
from models import build_mlp  # noqa: E402

SHAPES = {"large": dict(width=1024, depth=8, batch=512, microbatches=8, rounds_scale=1),
          "tiny": dict(width=64, depth=4, batch=64, microbatches=16, rounds_scale=40)}


def pipeline(stages: int, shape: dict, threads: int | str | None):
    net = build_mlp(num_stages=stages, in_dim=shape["width"], hidden=shape["width"], depth=shape["depth"])
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.01), num_microbatches=shape["microbatches"]
                                     ).minimize(net.loss)
    exe = staticpipe.Executor(worker_threads=threads)
    exe.run(net.startup)
    batch = net.random_batch(shape["batch"])
    return (lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss])), (lambda: len(exe.lanes(net.main)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds of the large stages (tiny: 40x as many)")
    ap.add_argument("--stages", type=int, default=4)
    args = ap.parse_args()
    paddle.enable_static()
    print(f"{cpu_model()}, {os.cpu_count()} CPU cores, 1F1B over p={args.stages} stages; ratios against a thread per rank")
    print(f"{'stages':<7} {'worker_threads':<18} {'threads':>7} {'ms/step':>9} {'CPU ms':>9} {'wall ratio':>10} "
          f"{'CPU ratio':>9}")
    for name, shape in SHAPES.items():
        choices = {"None (one per rank)": None, "auto (default)": "auto", "2": 2, "1": 1}
        made = {label: pipeline(args.stages, shape, n) for label, n in choices.items()}
        steps = {label: step for label, (step, _) in made.items()}
        for step in steps.values():
            for _ in range(14):  # warm-up, and the "auto" trial (7 steps at most)
                step()
        wall = {label: [] for label in steps}
        cpu = {label: [] for label in steps}
        for _ in range(args.rounds * shape["rounds_scale"]):
            for label, step in steps.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                wall[label].append(time.perf_counter() - start)
                cpu[label].append(time.process_time() - start_cpu)
        med = {label: statistics.median(t) for label, t in wall.items()}
        mean_cpu = {label: statistics.mean(t) for label, t in cpu.items()}
        base = next(iter(steps))
        for label in steps:
            print(f"{name:<7} {label:<18} {made[label][1]():>7} {med[label] * 1e3:9.2f} {mean_cpu[label] * 1e3:9.2f} "
                  f"{med[label] / med[base]:9.2f}x {mean_cpu[label] / mean_cpu[base]:8.2f}x")


if __name__ == "__main__":
    main()
