"""Activation memory of F-then-B vs 1F1B, with and without recompute, measured side by side.

Each configuration trains a few steps in its own process (so peak RSS is its own) and reports, per
stage, the peak bytes of activations held between a micro-batch's forward and its backward, the peak
number of micro-batches in flight, and the process's peak RSS.

    python bench/memory.py [--model resnet50|mlp] [--stages 2] [--microbatches 8] [--batch 64] [--steps 2]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_one(args) -> dict:
    import staticpipe
    from models import build_mlp, build_resnet
    import paddle  # after staticpipe, which settles Paddle's IR flag

    if args.model == "mlp":
        net = build_mlp(num_stages=args.stages, in_dim=1024, hidden=1024, depth=8)
    else:
        net = build_resnet(depth=50, num_stages=args.stages, width=16, image_size=32)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9),
                                     num_microbatches=args.microbatches, schedule=args.schedule,
                                     recompute=args.recompute).minimize(net.loss)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    batch = net.random_batch(args.batch)
    for _ in range(args.steps):
        exe.run(net.main, feed=batch)
    return {"stages": exe.memory_stats(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "mlp"])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--schedule", help=argparse.SUPPRESS)
    ap.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.schedule:  # one configuration, in this process
        print(json.dumps(run_one(args)))
        return
    print(f"{args.model}, {args.stages} stages, {args.microbatches} micro-batches of "
          f"{args.batch // args.microbatches}, {args.steps} steps")
    print(f"{'schedule':<10} {'recompute':<10} {'stage':>5} {'peak activations MiB':>21} "
          f"{'peak in flight':>15} {'process peak RSS MiB':>21}")
    base = None
    for schedule in ("F-then-B", "1F1B"):
        for recompute in (False, True):
            cmd = [sys.executable, __file__, "--model", args.model, "--stages", str(args.stages),
                   "--microbatches", str(args.microbatches), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--schedule", schedule] + (["--recompute"] if recompute else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            for stage, m in result["stages"].items():
                mib = m["peak_activation_bytes"] / 2**20
                base = base or mib
                print(f"{schedule:<10} {str(recompute):<10} {stage:>5} {mib:14.2f} ({mib / base:4.2f}x) "
                      f"{m['peak_inflight_microbatches']:>15} {result['peak_rss_mib']:>21.0f}")


if __name__ == "__main__":
    main()
