"""The planner: partition, schedule and recompute chosen together under a memory cap per device.

1. build a GPT with no device guards;
2. ``staticpipe.auto_plan`` profiles it on one micro-batch, builds and times the plans it needs, prices
   every schedule x cut x set of recomputed stages, keeps those whose every device fits ``--cap-mib``,
   applies the fastest and prints why each other schedule lost;
3. it trains like any pipelined program; the activation peak each device reached is printed beside the
   planner's prediction.

    python examples/auto_plan.py [--devices 4] [--cap-mib 6] [--steps 5] [--time-steps 2]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402

from models import build_gpt  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)
from staticpipe.memory_model import human_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--cap-mib", type=float, default=None, help="memory cap per device, MiB (default: none)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--time-steps", type=int, default=2, help="traced steps per built plan and pass (0: profile only)")
    args = ap.parse_args()
    paddle.enable_static()
    net = build_gpt(num_stages=args.devices, guarded=False, vocab=256, seq_len=32, d_model=64, n_layers=8)
    devices = [f"gpu:{k}" for k in range(args.devices)]
    report = staticpipe.auto_plan(
        net.main, net.loss, lambda: paddle.optimizer.Momentum(0.01, momentum=0.9), devices, args.microbatches,
        memory_limit=None if args.cap_mib is None else args.cap_mib * 2**20, feed=net.random_batch(args.micro_batch),
        startup=net.startup, schedules=["1F1B", "F-then-B", "ZB-H1", "ZB-V", "V-Min", "V-Half"],
        time_steps=args.time_steps)
    print(report, "\n")

    exe = staticpipe.Executor()  # net.main now holds the chosen plan
    exe.run(net.startup)
    losses = [float(exe.run(net.main, feed=net.random_batch(args.microbatches * args.micro_batch, seed=k),
                            fetch_list=[net.loss])[0]) for k in range(args.steps)]
    measured = exe.device_memory_stats()
    exe.close()
    print(f"{report.chosen.schedule}, recompute {list(report.chosen.recompute) or 'none'}: "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("activation peak per device, predicted / measured: " + ", ".join(
        f"{d.device} {human_bytes(d.activation_bytes)} / {human_bytes(measured[d.device]['peak_activation_bytes'])}"
        for d in report.chosen.memory))


if __name__ == "__main__":
    main()
