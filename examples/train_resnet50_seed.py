"""The seed job: Paddle fluid's two-GPU ResNet-50 pipeline example, ported literally to staticpipe.

Paddle 1.8's pipeline tutorial trains ResNet-50 on random data with the stem and the first two levels of
bottleneck blocks on ``gpu:0`` and the rest, the loss and the accuracy on ``gpu:1``, a DataLoader whose
every batch is one micro-batch, and ``exe.train_from_dataset(fluid.default_main_program())``. This is that
script with only the names changed: ``fluid.layers`` -> ``paddle.static.nn`` / ``paddle.nn.functional``
(Paddle 2.6 has no ``fluid.layers``; its convolution and batch norm -> ``paddle.nn.Conv2D`` /
``BatchNorm2D``, which also build Paddle 3's PIR programs), ``fluid.device_guard`` -> ``staticpipe.device_guard``,
``fluid.optimizer.PipelineOptimizer`` -> ``staticpipe.PipelineOptimizer``, ``fluid.io.DataLoader`` ->
``staticpipe.io.DataLoader``, ``fluid.Executor`` -> ``staticpipe.Executor``.

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
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402  (first: it settles Paddle's static-IR flag)
import numpy as np  # noqa: E402
import paddle  # noqa: E402

DEPTH = {50: [3, 4, 6, 3], 101: [3, 4, 23, 3], 152: [3, 8, 36, 3]}  # bottlenecks per level
GPU0_LEVELS = 2  # the stem and this many levels of bottlenecks run on gpu:0, the rest on gpu:1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatch_num", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--microbatch_size", type=int, default=32, help="samples per micro-batch (loader batch)")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--num_steps", type=int, default=10, help="steps of random data to train")
    parser.add_argument("--width", type=int, default=64, help="stem channels (64: the real network)")
    parser.add_argument("--class_dim", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=50, choices=sorted(DEPTH))
    parser.add_argument("--print_period", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="random seed of the programs (0: not fixed)")
    args = parser.parse_args(argv)
    for name in ("microbatch_num", "microbatch_size", "image_size", "num_steps", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.class_dim < 5:
        parser.error(f"--class_dim must be >= 5 (top-5 accuracy), got {args.class_dim}")
    return args


def conv_bn_layer(input, num_filters, filter_size, stride=1, groups=1, act=None):
    # fluid.layers.conv2d / batch_norm: paddle.static.nn's on Paddle 2.6 build legacy programs only, so this
    # uses paddle.nn's layers, the same ops and parameters on Paddle 2.6 and on Paddle 3's PIR
    conv = paddle.nn.Conv2D(input.shape[1], num_filters, filter_size, stride=stride, padding=(filter_size - 1) // 2,
                            groups=groups, bias_attr=False)(input)
    norm = paddle.nn.BatchNorm2D(num_filters)(conv)
    return paddle.nn.functional.relu(norm) if act == "relu" else norm


def shortcut(input, ch_out, stride):
    ch_in = input.shape[1]
    if ch_in != ch_out or stride != 1:
        return conv_bn_layer(input, ch_out, 1, stride)
    return input


def bottleneck_block(input, num_filters, stride):
    conv0 = conv_bn_layer(input=input, num_filters=num_filters, filter_size=1, act="relu")
    conv1 = conv_bn_layer(input=conv0, num_filters=num_filters, filter_size=3, stride=stride, act="relu")
    conv2 = conv_bn_layer(input=conv1, num_filters=num_filters * 4, filter_size=1, act=None)
    short = shortcut(input, num_filters * 4, stride)
    return paddle.nn.functional.relu(paddle.add(short, conv2))


def build_network(input, layers=50, class_dim=1000, width=64):
    """ResNet-``layers`` logits of ``input`` [N, 3, S, S]: the stem and levels 0-1 on gpu:0, levels 2-3,
    the global pool and the classifier on gpu:1."""
    depth = DEPTH[layers]
    num_filters = [width, width * 2, width * 4, width * 8]
    with staticpipe.device_guard("gpu:0"):
        conv = conv_bn_layer(input=input, num_filters=width, filter_size=7, stride=2, act="relu")
        conv = paddle.nn.functional.max_pool2d(conv, kernel_size=3, stride=2, padding=1)
    for block in range(len(depth)):
        with staticpipe.device_guard("gpu:0" if block < GPU0_LEVELS else "gpu:1"):
            for i in range(depth[block]):
                conv = bottleneck_block(input=conv, num_filters=num_filters[block],
                                        stride=2 if i == 0 and block != 0 else 1)
    with staticpipe.device_guard("gpu:1"):
        pool = paddle.nn.functional.adaptive_avg_pool2d(conv, 1)  # fluid: pool2d(global_pooling=True)
        pool = paddle.flatten(pool, start_axis=1)
        stdv = 1.0 / math.sqrt(pool.shape[1] * 1.0)
        out = paddle.static.nn.fc(pool, class_dim,
                                  weight_attr=paddle.ParamAttr(initializer=paddle.nn.initializer.Uniform(-stdv, stdv)))
    return out


def make_train_reader(num_samples, image_size, class_dim, seed=0):
    """The tutorial's train_reader: ``num_samples`` random (image, label) samples, one at a time."""
    def train_reader():
        rng = np.random.default_rng(seed)
        for _ in range(num_samples):
            image = rng.random((3, image_size, image_size), dtype=np.float32)
            label = rng.integers(0, class_dim, size=(1,), dtype=np.int64)
            yield image, label
    return train_reader


def build(args, pipeline=True):
    """The seed's program, built into the current default main and startup programs (wrap the call in
    ``paddle.static.program_guard`` for fresh ones). Returns its variables, loader and optimizer.
    ``pipeline=False``: the plain Momentum instead of the PipelineOptimizer, the one-device baseline of the
    same network (``paddle.static.Executor`` ignores the gpu index of the guards and runs every op on its
    own place)."""
    with staticpipe.device_guard("gpu:0"):
        image = paddle.static.data(name="image", shape=[None, 3, args.image_size, args.image_size], dtype="float32")
        label = paddle.static.data(name="label", shape=[None, 1], dtype="int64")
        data_loader = staticpipe.io.DataLoader.from_generator(feed_list=[image, label], capacity=64,
                                                              use_double_buffer=True, iterable=False)
    fc = build_network(image, layers=args.layers, class_dim=args.class_dim, width=args.width)
    with staticpipe.device_guard("gpu:1"):
        out, prob = paddle.nn.functional.softmax_with_cross_entropy(logits=fc, label=label, return_softmax=True)
        loss = paddle.mean(out)
        acc_top1 = paddle.static.accuracy(input=prob, label=label, k=1)
        acc_top5 = paddle.static.accuracy(input=prob, label=label, k=5)
    if pipeline:
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.1, momentum=0.9),
                                           num_microbatches=args.microbatch_num)
    else:
        opt = paddle.optimizer.Momentum(0.1, momentum=0.9)
    opt.minimize(loss)
    return argparse.Namespace(image=image, label=label, data_loader=data_loader, loss=loss, acc_top1=acc_top1,
                              acc_top5=acc_top5, opt=opt)


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
