"""Every schedule on the same models, measured side by side: step time, bubble, and runtime overhead.

For each schedule the runtime traces one step's actions; the simulator then replays the schedule with
each action costing exactly what it cost in that run. That replay is the schedule's own lower bound,
so bound / measured (the "efficiency") says how much the runtime adds: 1.00 = nothing.

    python bench/schedules.py [--model mlp|resnet|all] [--steps 3]

MLP: 8 x 2048, global batch 2048, 8 micro-batches of 256, 2 devices (one thread each).
ResNet-50 (width 16, 32x32 images): global batch 64, 8 micro-batches, 2 devices.
Interleaved and ZB-V run the same layers as 4 chunks (gpu:0, gpu:1, gpu:0, gpu:1 / gpu:0, gpu:1,
gpu:1, gpu:0).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from models import build_mlp, build_resnet  # noqa: E402
from staticpipe._paddle import paddle  # noqa: E402

LAYOUTS = {  # schedule -> device of each stage
    "F-then-B": ["gpu:0", "gpu:1"],
    "1F1B": ["gpu:0", "gpu:1"],
    "interleaved": ["gpu:0", "gpu:1", "gpu:0", "gpu:1"],
    "ZB-H1": ["gpu:0", "gpu:1"],
    "ZB-V": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
}
MODELS = {
    "mlp": (lambda devices: build_mlp(num_stages=len(devices), in_dim=2048, hidden=2048, depth=8,
                                      stage_devices=devices), 2048),
    "resnet": (lambda devices: build_resnet(depth=50, num_stages=len(devices), width=16, image_size=32,
                                            stage_devices=devices), 64),
}


def prepare(model: str, schedule: str):
    """A traced executor ready to run one step of ``model`` under ``schedule``."""
    build, batch_size = MODELS[model]
    net = build(LAYOUTS[schedule])
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9), num_microbatches=8,
                                     schedule=schedule).minimize(net.loss)
    exe = staticpipe.Executor(trace=True)
    exe.run(net.startup)
    batch = net.random_batch(batch_size)
    exe.run(net.main, feed=batch)  # warm-up
    return exe, net, batch


def measure(model: str, steps: int) -> dict[str, dict]:
    """Interleaved rounds (one step of every schedule each), so that the machine's drifts in speed hit
    all schedules alike; the median round of each is reported."""
    prepared = {schedule: prepare(model, schedule) for schedule in LAYOUTS}
    runs: dict[str, list[tuple]] = {schedule: [] for schedule in LAYOUTS}
    for _ in range(steps):
        for schedule, (exe, net, batch) in prepared.items():
            start = time.perf_counter()
            exe.run(net.main, feed=batch)
            wall = time.perf_counter() - start
            timeline = exe.timeline(net.main)
            runs[schedule].append((wall, timeline.bubble(), timeline.predicted().total / timeline.total))
    batch_size = MODELS[model][1]
    results = {}
    for schedule, (exe, _, _) in prepared.items():
        exe.close()
        wall, bubble, efficiency = (statistics.median(x) for x in zip(*runs[schedule]))
        results[schedule] = {"step": wall, "bubble": bubble, "efficiency": efficiency,
                             "samples/s": batch_size / wall}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all", choices=["mlp", "resnet", "all"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    for model in (["mlp", "resnet"] if args.model == "all" else [args.model]):
        results = measure(model, args.steps)
        base = results["1F1B"]
        print(f"\n{model}: median of {args.steps} interleaved rounds")
        print(f"{'schedule':<12} {'s/step':>8} {'samples/s':>10} {'vs 1F1B':>8} {'bubble':>7} "
              f"{'bubble vs 1F1B':>15} {'bound/measured':>15}")
        for name, r in results.items():
            print(f"{name:<12} {r['step']:8.3f} {r['samples/s']:10.1f} {base['step'] / r['step']:7.2f}x "
                  f"{r['bubble']:7.3f} {r['bubble'] / base['bubble']:14.2f}x {r['efficiency']:15.3f}")
        print("targets: bound/measured >= 0.95 for every schedule; ZB-H1 bubble <= 0.4 x 1F1B's")


if __name__ == "__main__":
    main()
