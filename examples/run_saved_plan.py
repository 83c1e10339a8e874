"""Exported stages: save the MLP pipeline's plan to a directory, then train from that directory alone.

Part 1 ("save") builds the MLP from models/, rewrites it into a 2-stage 1F1B pipeline and writes its
plan, section programs, main and startup programs and learning-rate scheduler with staticpipe.save_plan.
Part 2 ("train") needs only staticpipe and the directory: staticpipe.load_plan gives back the main and
startup programs with the plan attached, and training runs as with the original program. Launched as one
process per device, each process reads only its own stage's section files.

    python examples/run_saved_plan.py                            # both parts, into ./saved_mlp_plan
    python examples/run_saved_plan.py --part save --dir DIR      # part 1 only
    python -m staticpipe.launch --nprocs 2 examples/run_saved_plan.py --part train --dir DIR
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402

import numpy as np  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)


def save(args: argparse.Namespace) -> None:
    """Part 1: the only part that uses the model code."""
    from models import build_mlp

    net = build_mlp(num_stages=args.stages, in_dim=args.width, hidden=args.width, depth=args.depth)
    with paddle.static.program_guard(net.main, net.startup):
        lr = paddle.optimizer.lr.StepDecay(args.lr, step_size=10, gamma=0.5)
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(lr, momentum=0.9),
                                     num_microbatches=args.microbatches, schedule=args.schedule).minimize(net.loss)
    staticpipe.save_plan(net.main, args.dir, net.startup)
    files = sorted(os.path.relpath(os.path.join(d, f), args.dir) for d, _, fs in os.walk(args.dir) for f in fs)
    print(f"saved the plan to {args.dir}: {', '.join(files)}")


def argmax_batches(num_batches: int, batch_size: int, in_dim: int, num_classes: int, seed: int = 0):
    """Learnable synthetic data: Gaussian features, each labelled by which of its first ``num_classes``
    features is the largest."""
    def reader():
        rng = np.random.default_rng(seed)
        for _ in range(num_batches):
            x = rng.standard_normal((batch_size, in_dim), dtype=np.float32)
            yield x, np.argmax(x[:, :num_classes], axis=1)[:, None]
    return reader


def train(args: argparse.Namespace) -> None:
    """Part 2: staticpipe and the saved directory only."""
    main, startup = staticpipe.load_plan(args.dir)  # under staticpipe.launch: this rank's stages only
    plan = staticpipe.plan_of(main)
    print(plan)
    features, label = staticpipe.variable(main, "features"), staticpipe.variable(main, "label")
    loader = staticpipe.io.DataLoader.from_generator(feed_list=[features, label], capacity=8, iterable=False)
    # a loader batch is one micro-batch (Paddle's pipeline convention): --batch is the global batch
    loader.set_batch_generator(argmax_batches(args.steps * plan.num_microbatches, args.batch // plan.num_microbatches,
                                              features.shape[1], args.classes))
    exe = staticpipe.Executor()
    exe.run(startup)
    loader.start()
    history = exe.train_from_dataset(main, fetch_list=[plan.loss], print_period=5, lr_step="step")
    loader.reset()
    exe.close()
    if history[-1][0] is not None:  # under staticpipe.launch only the last stage's process has the loss
        print(f"trained {len(history)} steps from {args.dir}: loss {float(history[0][0]):.4f} -> "
              f"{float(history[-1][0]):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["both", "save", "train"], default="both")
    ap.add_argument("--dir", default="saved_mlp_plan")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--classes", type=int, default=10, help="the MLP's classes (build_mlp's default)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.part != "train" and int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1:
        ap.error("under staticpipe.launch run --part train only (save the plan once, before launching)")
    if args.part in ("both", "save"):
        save(args)
    if args.part in ("both", "train"):
        train(args)


if __name__ == "__main__":
    main()
