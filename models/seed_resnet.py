"""The seed job's network: Paddle fluid's two-GPU ResNet-50 pipeline example, its layers ported by name.

``examples/train_resnet50_seed.py`` trains it as the tutorial did (a DataLoader, ``train_from_dataset``);
``python -m staticpipe.selftest`` (rows c and d) builds the same job. The stem and the first two levels of
bottleneck blocks are on ``gpu:0``, the rest, the loss and the accuracy on ``gpu:1``.

Names changed from fluid: ``fluid.layers`` -> ``paddle.static.nn`` / ``paddle.nn.functional`` (Paddle 2.6 has
no ``fluid.layers``; its convolution and batch norm -> ``paddle.nn.Conv2D`` / ``BatchNorm2D``, which also
build Paddle 3's PIR programs), ``fluid.device_guard`` -> ``staticpipe.device_guard``,
``fluid.optimizer.PipelineOptimizer`` -> ``staticpipe.PipelineOptimizer``, ``fluid.io.DataLoader`` ->
``staticpipe.io.DataLoader``.
"""
from __future__ import annotations

import argparse
import math

import staticpipe  # (first: it settles Paddle's static-IR flag)
import paddle

DEPTH = {50: [3, 4, 6, 3], 101: [3, 4, 23, 3], 152: [3, 8, 36, 3]}  # bottlenecks per level
GPU0_LEVELS = 2  # the stem and this many levels of bottlenecks run on gpu:0, the rest on gpu:1
# the real job: 8 micro-batches of 32 images of 224 x 224 per step, ResNet-50 of width 64, 1000 classes
JOB = dict(microbatch_num=8, microbatch_size=32, image_size=224, width=64, class_dim=1000, layers=50)


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


def build(args, pipeline=True):
    """The seed's program, built into the current default main and startup programs (wrap the call in
    ``paddle.static.program_guard`` for fresh ones). ``args`` has ``JOB``'s attributes. Returns its
    variables, loader and optimizer. ``pipeline=False``: the plain Momentum instead of the
    PipelineOptimizer, the one-device baseline of the same network (``paddle.static.Executor`` ignores the
    gpu index of the guards and runs every op on its own place)."""
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
