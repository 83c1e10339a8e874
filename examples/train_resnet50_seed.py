"""The seed job: Paddle fluid's two-GPU ResNet-50 pipeline example, ported literally to staticpipe.

Paddle 1.8's pipeline tutorial trains ResNet-50 on random data with the stem and the first two levels of
bottleneck blocks on ``gpu:0`` and the rest, the loss and the accuracy on ``gpu:1``, a DataLoader whose
every batch is one micro-batch, and ``exe.train_from_dataset(fluid.default_main_program())``. This is that
script with only the names changed: ``fluid.layers`` -> ``paddle.static.nn`` / ``paddle.nn.functional``
(Paddle 2.6 has no ``fluid.layers``; its convolution and batch norm -> ``paddle.nn.Conv2D`` /
``BatchNorm2D``, which also build Paddle 3's PIR programs), ``fluid.device_guard`` -> ``staticpipe.device_guard``,
``fluid.optimizer.PipelineOptimizer`` -> ``staticpipe.PipelineOptimizer``, ``fluid.io.DataLoader`` ->
``staticpipe.io.DataLoader``, ``fluid.Executor`` -> ``staticpipe.Executor``. The network, its loss and its
optimizer (``build``) are in ``models/seed_resnet.py``, where ``python -m staticpipe.selftest`` builds the
same job; this file is the tutorial's reader, executor and training loop.

A step takes ``--microbatch_num`` loader batches of ``--microbatch_size`` samples each (Paddle's
convention: global batch = microbatch_num x microbatch_size), so the defaults train on 8 x 32 = 256
images of 224 x 224 per step.

Run it:

    # two GPUs: stage 0 on GPU 0, stage 1 on GPU 1
    python examples/train_resnet50_seed.py
    # one GPU: both stages on GPU 0, each still its own worker
    STATICPIPE_DEVICE_MAP="gpu:1=gpu:0" python examples/train_resnet50_seed.py
    # CPU only (a CPU build of Paddle): both stages are CPU devices; shrink it to finish in seconds
    python examples/train_resnet50_seed.py --image_size 32 --width 8 --microbatch_num 2 \\
        --microbatch_size 2 --num_steps 2 --class_dim 10

``--width`` is the stem's channel count (64: the real ResNet-50; tests shrink it), ``--class_dim`` the
number of classes (at least 5, for the top-5 accuracy).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402  (first: it settles Paddle's static-IR flag)
import numpy as np  # noqa: E402
import paddle  # noqa: E402
from models.seed_resnet import DEPTH, JOB, build  # noqa: E402  (the network, its loss and its optimizer)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatch_num", type=int, default=JOB["microbatch_num"], help="micro-batches per step")
    parser.add_argument("--microbatch_size", type=int, default=JOB["microbatch_size"],
                        help="samples per micro-batch (loader batch)")
    parser.add_argument("--image_size", type=int, default=JOB["image_size"])
    parser.add_argument("--num_steps", type=int, default=10, help="steps of random data to train")
    parser.add_argument("--width", type=int, default=JOB["width"], help="stem channels (64: the real network)")
    parser.add_argument("--class_dim", type=int, default=JOB["class_dim"])
    parser.add_argument("--layers", type=int, default=JOB["layers"], choices=sorted(DEPTH))
    parser.add_argument("--print_period", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="random seed of the programs (0: not fixed)")
    args = parser.parse_args(argv)
    for name in ("microbatch_num", "microbatch_size", "image_size", "num_steps", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.class_dim < 5:
        parser.error(f"--class_dim must be >= 5 (top-5 accuracy), got {args.class_dim}")
    return args


def make_train_reader(num_samples, image_size, class_dim, seed=0):
    """The tutorial's train_reader: ``num_samples`` random (image, label) samples, one at a time."""
    def train_reader():
        rng = np.random.default_rng(seed)
        for _ in range(num_samples):
            image = rng.random((3, image_size, image_size), dtype=np.float32)
            label = rng.integers(0, class_dim, size=(1,), dtype=np.int64)
            yield image, label
    return train_reader


def plan_summary(plan):
    """``print(plan)`` without the long parameter lists: each stage's device, parameter count and first
    and last parameter, then the cut variables."""
    lines = str(plan).splitlines()
    summary = [lines[0]]
    for stage in plan.stages:
        params = stage.parameters
        span = f" ({params[0]} .. {params[-1]})" if params else ""
        summary.append(f"  stage {stage.index} on {stage.device}: {len(params)} parameters{span}")
    if "  cut variables:" in lines:
        start = lines.index("  cut variables:")
        summary.append(lines[start])
        for line in lines[start + 1:]:
            if not line.startswith("    "):
                break
            summary.append(line)
    return "\n".join(summary)


def main(argv=None):
    args = parse_args(argv)
    paddle.enable_static()
    if args.seed:
        paddle.static.default_startup_program().random_seed = args.seed
        paddle.static.default_main_program().random_seed = args.seed
    model = build(args)
    plan = model.opt.plan
    print(f"ResNet-{args.layers} (width {args.width}, {args.image_size}x{args.image_size}, {args.class_dim} "
          f"classes): {plan.num_stages} stages on {', '.join(plan.devices)}, {plan.num_microbatches} "
          f"micro-batches of {args.microbatch_size}, schedule {plan.schedule}")
    print(plan_summary(plan))

    samples = args.num_steps * args.microbatch_num * args.microbatch_size
    model.data_loader.set_sample_generator(make_train_reader(samples, args.image_size, args.class_dim),
                                           batch_size=args.microbatch_size)
    place = paddle.CUDAPlace(0) if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0 \
        else paddle.CPUPlace()
    exe = staticpipe.Executor(place)
    exe.run(paddle.static.default_startup_program())
    model.data_loader.start()
    start_time = time.time()
    history = exe.train_from_dataset(paddle.static.default_main_program(),
                                     fetch_list=[model.loss, model.acc_top1, model.acc_top5],
                                     fetch_info=["loss", "acc1", "acc5"], print_period=args.print_period)
    end_time = time.time()
    model.data_loader.reset()
    elapsed = end_time - start_time
    print("loss per step:", " ".join(f"{float(np.mean(loss)):.6g}" for loss, _, _ in history))
    print("top-1 / top-5 accuracy of the last step:", f"{float(np.mean(history[-1][1])):.4f} / "
          f"{float(np.mean(history[-1][2])):.4f}" if history else "-")
    global_batch = args.microbatch_num * args.microbatch_size
    print(f"Execution time: {elapsed:.3f} s")
    print(f"{len(history)} steps of {global_batch} samples: {len(history) * global_batch / elapsed:.1f} samples/s")
    exe.close()


if __name__ == "__main__":
    main()
