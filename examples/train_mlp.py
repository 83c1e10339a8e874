"""Pipelined training of an MLP on two CPU "devices" (or GPUs, when CUDA is present).

The main job of the README: builds the network under device guards, rewrites it into a 2-stage 1F1B
pipeline with 8 micro-batches, trains from a generator data loader as Paddle's pipeline does (the loader
gives micro-batches; ``train_from_dataset(main)`` reads the started loader) and prints throughput.

    python examples/train_mlp.py [--stages 2] [--microbatches 8] [--schedule 1F1B] [--steps 30]
    python examples/train_mlp.py --stages 4 --width 64 --worker-threads 1   # tiny stages: one thread, least CPU
    python examples/train_mlp.py --worker-threads per-stage   # a thread each (the default tries the layouts)
    python -m staticpipe.launch --nprocs 4 examples/train_mlp.py --dp-degree 2   # 2 replicas x 2 stages
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from models import build_mlp  # noqa: E402
import numpy as np  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)


def teacher_reader(num_samples: int, in_dim: int, num_classes: int = 10, seed: int = 0):
    """Learnable synthetic data: Gaussian features labelled by a fixed random linear teacher."""
    teacher = np.random.default_rng(seed).standard_normal((in_dim, num_classes)).astype(np.float32)

    def reader():
        rng = np.random.default_rng(seed + 1)
        for _ in range(num_samples):
            x = rng.standard_normal(in_dim, dtype=np.float32)
            yield x, np.array([int(np.argmax(x @ teacher))])
    return reader


def threads(text: str) -> int | str | None:
    """``--worker-threads``: "auto", "per-stage" (None: a thread per stage) or a number."""
    if text in ("auto", "per-stage"):
        return None if text == "per-stage" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected "auto", "per-stage" or a number of threads, got {text!r}') from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--batch", type=int, default=512, help="global batch: micro-batches x micro-batch size")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--dp-degree", type=int, default=1, help="data-parallel replicas (needs a multi-process launch)")
    ap.add_argument("--worker-threads", type=threads, default="auto",
                    help='threads that run the CPU stages: a number, "per-stage" (one each) or "auto" (the default: '
                         "the first steps try a thread per stage, one per core and one, and keep the best)")
    args = ap.parse_args()

    net = build_mlp(num_stages=args.stages, in_dim=args.width, hidden=args.width, depth=args.depth)
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(args.lr, momentum=0.9),
                                           num_microbatches=args.microbatches, schedule=args.schedule,
                                           dp_degree=args.dp_degree)
        opt.minimize(net.loss)
    print(opt.plan)

    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} is not a multiple of --microbatches {args.microbatches}")
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=8, iterable=False)
    loader.set_sample_generator(teacher_reader(args.batch * args.steps, args.width),
                                batch_size=args.batch // args.microbatches)  # a loader batch is a micro-batch
    exe = staticpipe.Executor(worker_threads=args.worker_threads)
    exe.run(net.startup)
    loader.start()
    start = time.perf_counter()
    history = exe.train_from_dataset(net.main, fetch_list=[net.loss, net.outputs["accuracy"]],
                                     fetch_info=["loss", "accuracy"], print_period=5)
    elapsed = time.perf_counter() - start
    loader.reset()
    print("threads:", " | ".join("+".join(lane) for lane in exe.lanes(net.main)))
    loss = (f"; loss {float(history[0][0]):.4f} -> {float(history[-1][0]):.4f}"
            if history[-1][0] is not None else "")  # under staticpipe.launch only the last stage's process has it
    print(f"{len(history)} steps of {args.batch} samples in {elapsed:.2f} s: "
          f"{len(history) * args.batch / elapsed:.1f} samples/s on {args.stages} pipeline stages"
          f"{f' x {args.dp_degree} replicas' if args.dp_degree > 1 else ''}{loss}")
    exe.close()


if __name__ == "__main__":
    main()
