"""What splitting the backward into B and W costs, and whether the simulator orders 1F1B and ZB-H1 as the
runtime does.

ZB-H1 splits each backward into B (activation gradients) and W (weight gradients): an op that makes both
(``matmul_v2_grad``: dX and dW) runs twice, each copy with the other half's outputs dropped, and W's
inputs wait in the micro-batch's scope until W runs. The schedule fills the pipeline's bubble with W,
which pays only if the split costs less than the bubble it saves. Side by side in one run, on the same
stages:

1. Each stage's backward work per step, from traced steps on one thread (no other thread competes for a
   core, so an action's CPU time is its own): the fused backward (1F1B's B) against B + W (ZB-H1's),
   summed over the micro-batches, CPU seconds per action as the runtime's ``Timeline.action_costs``
   records them. Target (issue 43): the split costs <= 3 % more.
2. The step on a thread per stage (the layout both schedules are meant for on 2 cores), measured
   (median of interleaved rounds, untraced) and predicted (the shared-cores simulator, on the machine's
   cores, with each action costing what the traced steps measured): ZB-H1 / 1F1B both ways. Target: the
   prediction orders the two as the measurement does, within 3 %.

    python bench/split_backward.py [--width 2048] [--depth 8] [--batch 1024] [--microbatches 8] [--rounds 5]
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
from staticpipe.schedule import Kind, simulate  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)
from models import build_mlp  # noqa: E402

SCHEDULES = ("1F1B", "ZB-H1")


def build(args, schedule: str):
    net = build_mlp(num_stages=2, in_dim=args.width, hidden=args.width, depth=args.depth)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9), num_microbatches=args.microbatches,
                                     schedule=schedule).minimize(net.loss)
    return net


def traced_costs(net, batch, steps: int) -> dict:
    """Per action, its least CPU seconds over ``steps`` traced steps on one thread."""
    exe = staticpipe.Executor(worker_threads=1, trace=True)
    try:
        exe.run(net.startup)
        exe.run(net.main, feed=batch, fetch_list=[net.loss])  # prepares the runs
        costs: dict = {}
        for _ in range(steps):
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
            for action, cost in exe.timeline(net.main).action_costs().items():
                costs[action] = min(cost, costs.get(action, cost))
        return costs
    finally:
        exe.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of each schedule each)")
    ap.add_argument("--traced", type=int, default=3, help="traced steps per schedule (the least cost counts)")
    args = ap.parse_args()
    paddle.enable_static()
    cores = len(os.sched_getaffinity(0))
    print(f"{cpu_model()}, {cores} cores; MLP {args.depth} x {args.width}, batch {args.batch}, "
          f"m={args.microbatches}, 2 stages, Momentum")
    nets = {s: build(args, s) for s in SCHEDULES}
    batch = nets["1F1B"].random_batch(args.batch)
    costs = {s: traced_costs(nets[s], batch, args.traced) for s in SCHEDULES}

    print(f"\n{'stage':<6} {'1F1B backward s':>16} {'ZB-H1 B s':>10} {'ZB-H1 W s':>10} {'B + W / backward':>17}")
    for stage in range(2):
        def total(schedule, kind):
            return sum(c for a, c in costs[schedule].items() if a.stage == stage and a.kind is kind)
        fused, b, w = total("1F1B", Kind.B), total("ZB-H1", Kind.B), total("ZB-H1", Kind.W)
        print(f"{stage:<6} {fused:16.3f} {b:10.3f} {w:10.3f} {(b + w) / fused:16.3f}x")

    exes = {}
    for s in SCHEDULES:
        exes[s] = staticpipe.Executor(worker_threads=None)
        exes[s].run(nets[s].startup)
        exes[s].run(nets[s].main, feed=batch, fetch_list=[nets[s].loss])
    walls = {s: [] for s in SCHEDULES}
    for _ in range(args.rounds):
        for s in SCHEDULES:
            start = time.perf_counter()
            exes[s].run(nets[s].main, feed=batch, fetch_list=[nets[s].loss])
            walls[s].append(time.perf_counter() - start)
    for exe in exes.values():
        exe.close()
    measured = {s: statistics.median(w) for s, w in walls.items()}
    predicted = {s: simulate(staticpipe.plan_of(nets[s].main).actions, costs=lambda a, s=s: costs[s].get(a, 0.0),
                             cores=cores, collectives=True).total for s in SCHEDULES}
    print(f"\n{'schedule':<9} {'measured s':>10} {'predicted s':>11}")
    for s in SCHEDULES:
        print(f"{s:<9} {measured[s]:10.3f} {predicted[s]:11.3f}")
    m, p = measured["ZB-H1"] / measured["1F1B"], predicted["ZB-H1"] / predicted["1F1B"]
    print(f"ZB-H1 / 1F1B: measured {m:.3f}, predicted {p:.3f} (prediction off by {abs(p / m - 1) * 100:.1f} %)")


if __name__ == "__main__":
    main()
