"""ResNet-50 trained as a 2-stage pipeline from a random-data generator (Paddle's pipeline tutorial flow).

The stem and the first bottlenecks run on gpu:0, the rest and the classifier on gpu:1; without CUDA both
are CPU devices. Prints execution time and samples/s. The defaults (32x32 images, width 16) finish in
about a minute on a 2-core CPU; use --width 64 --image-size 224 for the real network on GPUs.

    python examples/train_resnet_pipeline.py [--depth 50] [--stages 2] [--steps 10] [--batch 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from models import build_resnet  # noqa: E402
import numpy as np  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)


def random_reader(num_samples: int, image_size: int, num_classes: int):
    """The tutorial's generator: random images and labels, one sample at a time."""
    def reader():
        rng = np.random.default_rng(0)
        for _ in range(num_samples):
            yield (rng.standard_normal((3, image_size, image_size), dtype=np.float32),
                   rng.integers(0, num_classes, size=(1,)))
    return reader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=50, choices=[50, 101, 152])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--width", type=int, default=16)
    args = ap.parse_args()

    net = build_resnet(depth=args.depth, num_stages=args.stages, image_size=args.image_size, width=args.width)
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9),
                                           num_microbatches=args.microbatches, schedule=args.schedule)
        opt.minimize(net.loss)
    plan = opt.plan
    print(f"ResNet-{args.depth}: {plan.num_stages} stages on {', '.join(plan.devices)}, "
          f"{plan.num_microbatches} micro-batches, schedule {plan.schedule}")

    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=16)
    loader.set_sample_generator(random_reader(args.batch * args.steps, args.image_size, 10),
                                batch_size=args.batch)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    loader.start()
    start = time.perf_counter()
    history = exe.train_from_dataset(net.main, loader, fetch_list=[net.loss], print_period=2)
    elapsed = time.perf_counter() - start
    loader.reset()
    print(f"execution time: {elapsed:.2f} s for {len(history)} steps; "
          f"{len(history) * args.batch / elapsed:.1f} samples/s")
    exe.close()


if __name__ == "__main__":
    main()
