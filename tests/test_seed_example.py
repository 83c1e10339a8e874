"""The seed job, examples/train_resnet50_seed.py: Paddle fluid's two-GPU ResNet-50 pipeline example as a
user runs it (here on CPU devices, small sizes), and the placement its guards ask for (its network:
models/seed_resnet.py)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import staticpipe
from models import seed_resnet
from pipeline_util import dense_layers
from staticpipe._paddle import paddle

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "train_resnet50_seed.py")
SMALL = ["--image_size", "32", "--width", "8", "--microbatch_num", "2", "--microbatch_size", "2",
         "--class_dim", "10", "--seed", "1"]


def load_seed():
    spec = importlib.util.spec_from_file_location("train_resnet50_seed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_seed_job_trains_num_steps_of_microbatch_num_loader_batches():
    env = dict(os.environ)
    env.pop("STATICPIPE_DEVICE_MAP", None)
    result = subprocess.run([sys.executable, SCRIPT, *SMALL, "--num_steps", "3"], capture_output=True, text=True,
                            timeout=100, env=env, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    # Paddle's convention: a loader batch (microbatch_size samples) is one micro-batch, a step takes
    # microbatch_num of them
    assert ("staticpipe: a loader batch is one micro-batch: micro-batch size 2, 2 micro-batches per step, "
            "global batch 4") in output
    assert output.count("a loader batch is one micro-batch") == 1
    assert "not trained on" not in output  # 3 steps x 2 batches: nothing left over
    assert "ResNet-50 (width 8, 32x32, 10 classes): 2 stages on gpu:0, gpu:1, 2 micro-batches of 2" in result.stdout
    assert re.search(r"^Execution time: [0-9.]+ s$", result.stdout, re.M), result.stdout
    assert re.search(r"^3 steps of 4 samples: [0-9.]+ samples/s$", result.stdout, re.M), result.stdout
    losses = re.search(r"^loss per step: (.*)$", result.stdout, re.M)
    assert losses, result.stdout
    values = [float(v) for v in losses.group(1).split()]
    assert len(values) == 3 and np.all(np.isfinite(values)), values


def test_guards_put_the_stem_and_two_levels_on_gpu0_and_the_rest_and_the_loss_on_gpu1():
    args = load_seed().parse_args(SMALL)
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        model = seed_resnet.build(args)
    plan = staticpipe.plan_of(main)
    assert plan is model.opt.plan
    assert plan.devices == ["gpu:0", "gpu:1"] and plan.num_microbatches == 2

    block = main.global_block()
    convs = [op for op in block.ops if op.type == "conv2d"]  # forward convolutions, in network order
    # stem, then per bottleneck 3 convolutions, plus a projection shortcut in each level's first block
    on_gpu0 = 1 + sum(3 * n + 1 for n in seed_resnet.DEPTH[50][:seed_resnet.GPU0_LEVELS])
    assert len(convs) == 1 + sum(3 * n + 1 for n in seed_resnet.DEPTH[50]) == 53
    assert [op.attr("op_device") for op in convs] == ["gpu:0"] * on_gpu0 + ["gpu:1"] * (53 - on_gpu0)
    width = args.width
    # the last convolution on gpu:0 closes level 1 (x4 expansion of 2 * width), the first on gpu:1 opens level 2
    assert block.var(convs[on_gpu0 - 1].input("Filter")[0]).shape[0] == 4 * 2 * width
    assert block.var(convs[on_gpu0].input("Filter")[0]).shape[0] == 4 * width
    filters = [op.input("Filter")[0] for op in convs]
    stage0, stage1 = (set(s.parameters) for s in plan.stages)
    assert set(filters[:on_gpu0]) <= stage0 and not set(filters[:on_gpu0]) & stage1
    assert set(filters[on_gpu0:]) <= stage1 and not set(filters[on_gpu0:]) & stage0
    fc = [name for layer in dense_layers(main) for name in layer]  # the classifier's weight and bias
    assert fc and set(fc) <= stage1
    assert stage0 | stage1 == {p.name for p in main.all_parameters()}

    loss_op = next(op for op in block.ops if model.loss.name in op.output_arg_names)
    head = [loss_op] + [op for op in block.ops if op.type in ("softmax_with_cross_entropy", "accuracy", "top_k_v2",
                                                             "top_k")]
    assert {op.type for op in head} >= {"softmax_with_cross_entropy", "accuracy"}
    assert {op.attr("op_device") for op in head} == {"gpu:1"}
    assert len([op for op in block.ops if op.type == "accuracy"]) == 2  # top-1 and top-5
    assert model.loss.name == plan.loss
    assert plan.data_vars == {"image": (0,), "label": (1,)}
    assert [v.name for v in (model.image, model.label)] == ["image", "label"]
    assert model.image.shape[1:] == (3, 32, 32) and model.label.shape[1:] == (1,)


def test_arguments_default_to_the_real_job_and_refuse_nonsense():
    seed = load_seed()
    args = seed.parse_args([])
    assert (args.microbatch_num, args.microbatch_size, args.image_size, args.width, args.class_dim,
            args.num_steps) == (8, 32, 224, 64, 1000, 10)
    with pytest.raises(SystemExit):
        seed.parse_args(["--class_dim", "4"])  # top-5 accuracy needs 5 classes
    with pytest.raises(SystemExit):
        seed.parse_args(["--microbatch_num", "0"])
