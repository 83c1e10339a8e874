"""Automatic partitioning: a ResNet-50 written with no device guards, profiled, split by measured time.

1. build the forward program without any ``device_guard``;
2. ``staticpipe.profile`` times every op (forward and backward) at the micro-batch size;
3. ``staticpipe.auto_place`` cuts it into balanced stages and tags the ops (compared with the
   "uniform" and "params" policies first, on throw-away builds);
4. ``PipelineOptimizer.minimize`` splits the tagged program as usual, and it trains.

    python examples/auto_partition.py [--stages 2] [--steps 6] [--policy time]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402

from models import build_resnet  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)
from paddle.base import core  # noqa: E402


def build():
    return build_resnet(50, num_stages=1, guarded=False, width=8, image_size=32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--policy", default="time", choices=["uniform", "params", "time", "memory"])
    ap.add_argument("--memory-limit", type=float, default=None, help="bytes per device, for --policy memory")
    args = ap.parse_args()
    micro = args.batch // args.microbatches

    net = build()

    def loader(batch_size: int, samples: int):
        ld = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=8, iterable=True)
        return ld.set_sample_generator(net.sample_reader(samples), batch_size=batch_size)

    core.set_num_threads(1)  # time ops with the one intra-op thread each stage worker gets
    profile = staticpipe.profile(net.main, loader(micro, micro), startup=net.startup)
    print(profile, "\n")

    for policy in ("uniform", "params"):
        other = staticpipe.auto_place(build().main, args.stages, policy=policy, profile=profile,
                                      num_microbatches=args.microbatches)
        print(f"policy {policy}: slowest stage / mean {other.imbalance():.3f}, predicted step "
              f"{other.predicted_step_time() * 1e3:.1f} ms")
    placement = staticpipe.auto_place(net.main, args.stages, policy=args.policy, profile=profile,
                                      memory_limit=args.memory_limit, num_microbatches=args.microbatches)
    print(placement, "\n")

    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9),
                                           num_microbatches=args.microbatches)
        opt.minimize(net.loss)
    exe = staticpipe.Executor(trace=True)
    exe.run(net.startup)
    history = exe.train_from_dataset(net.main, loader(micro, args.batch * args.steps), fetch_list=[net.loss],
                                     print_period=2)  # a loader batch is one micro-batch
    busy = exe.timeline(net.main).busy()
    print(f"loss {float(history[0][0]):.4f} -> {float(history[-1][0]):.4f}; last step's busy time per stage: "
          + ", ".join(f"{b:.3f} s" for b in busy.values())
          + f" (slowest / mean {max(busy.values()) / (sum(busy.values()) / len(busy)):.3f})")
    exe.close()


if __name__ == "__main__":
    main()
