"""What the default's trial of thread layouts costs: the first steps of a new executor with
``worker_threads="auto"`` beside the same steps on each layout given outright, side by side.

Each repetition makes a new executor per setting (interleaved, so that a slow spell of the machine hits
each alike), runs the startup program, then times its first ``--first`` steps (the first prepares
the runs: that one-off cost is in every setting's figure) and ``--after`` steps after them (steady).
Printed per setting, medians over the repetitions: the first steps' total, the steady steps scaled to
as many steps, their ratio, and the layout the steps ended on. Targets (issue 43): the default's first
steps <= 1.03x those of the fastest layout given outright, and its steady steps no slower than 1.03x
the fastest layout's.

Pipelines (1F1B, SGD, each stage one intra-op thread):

- ``large2``: MLP 8 x 2048, global batch 1024, 8 micro-batches, 2 stages (actions of tens of ms);
- ``large4``: MLP 8 x 1024, global batch 512, 8 micro-batches, 4 stages;
- ``tiny4``: MLP 4 x 64, global batch 64, 16 micro-batches, 4 stages (actions of tens of µs).

    python bench/first_steps.py [--configs large2,large4,tiny4] [--repeats 3] [--first 10] [--after 5]
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

CONFIGS = {"large2": dict(stages=2, width=2048, depth=8, batch=1024, microbatches=8, repeats=1),
           "large4": dict(stages=4, width=1024, depth=8, batch=512, microbatches=8, repeats=1),
           "tiny4": dict(stages=4, width=64, depth=4, batch=64, microbatches=16, repeats=10)}
SETTINGS = {"auto (default)": "auto", "a thread per stage": None, "2 threads": 2, "1 thread": 1}


def program(config: dict):
    net = build_mlp(num_stages=config["stages"], in_dim=config["width"], hidden=config["width"], depth=config["depth"])
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.01), num_microbatches=config["microbatches"]
                                     ).minimize(net.loss)
    return net


def run(net, batch, setting, first: int, after: int) -> tuple[float, float, int]:
    """(seconds of the first ``first`` steps, of the ``after`` steps after them, threads of the last step)."""
    exe = staticpipe.Executor(worker_threads=setting)
    try:
        exe.run(net.startup)
        times = []
        for _ in range(first + after):
            start = time.perf_counter()
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
            times.append(time.perf_counter() - start)
        return sum(times[:first]), sum(times[first:]), len(exe.lanes(net.main))
    finally:
        exe.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3, help="new executors per setting (tiny4: 10x as many)")
    ap.add_argument("--first", type=int, default=10)
    ap.add_argument("--after", type=int, default=5)
    args = ap.parse_args()
    paddle.enable_static()
    print(f"{cpu_model()}, {os.cpu_count()} cores; medians of new executors' steps, interleaved")
    print(f"{'config':<7} {'worker_threads':<19} {'threads':>7} {'first s':>8} {'steady s':>8} {'first/steady':>12} "
          f"{'first/best first':>16} {'steady/best steady':>18}")
    for name in args.configs.split(","):
        config = CONFIGS[name]
        net = program(config)
        batch = net.random_batch(config["batch"])
        settings = {label: s for label, s in SETTINGS.items() if s != 2 or config["stages"] > 2}
        got = {label: [] for label in settings}
        for _ in range(args.repeats * config["repeats"]):
            for label, setting in settings.items():
                got[label].append(run(net, batch, setting, args.first, args.after))
        first = {label: statistics.median(g[0] for g in runs) for label, runs in got.items()}
        steady = {label: statistics.median(g[1] for g in runs) * args.first / args.after for label, runs in got.items()}
        fixed = [label for label, s in settings.items() if s != "auto"]
        best_first, best_steady = min(first[label] for label in fixed), min(steady[label] for label in fixed)
        for label in settings:
            threads = sorted({g[2] for g in got[label]})
            print(f"{name:<7} {label:<19} {'/'.join(map(str, threads)):>7} {first[label]:8.3f} {steady[label]:8.3f} "
                  f"{first[label] / steady[label]:11.3f}x {first[label] / best_first:15.3f}x "
                  f"{steady[label] / best_steady:17.3f}x")


if __name__ == "__main__":
    main()
