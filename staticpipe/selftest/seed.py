"""Rows c and d: the seed job (Paddle fluid's two-GPU ResNet-50 pipeline example, ``models/seed_resnet.py``)
on 2 stages against the same network on one device (samples/s), and its peak memory per stage."""
from __future__ import annotations

import argparse

import staticpipe

from .._paddle import np, paddle
from .harness import FAIL, PASS, Context, MiB, timed


def seed_args(ctx: Context) -> argparse.Namespace:
    """The job's sizes: small on CPU and with --quick, else the real job (224x224, width 64, 8
    micro-batches of 32, 1000 classes)."""
    from models.seed_resnet import JOB

    if ctx.cpu:
        sizes = dict(image_size=32, width=8, microbatch_num=2, microbatch_size=2, class_dim=10)
    elif ctx.quick:
        sizes = dict(image_size=64, width=16, microbatch_num=4, microbatch_size=8, class_dim=100)
    else:
        sizes = {}
    return argparse.Namespace(**{**JOB, **sizes})


def build_seed(args, pipeline: bool):
    """(main, startup, the job's variables) of the seed job, in fresh programs."""
    from models.seed_resnet import build

    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        model = build(args, pipeline=pipeline)
    return main, startup, model


def seed_batch(args, rows: int) -> dict:
    """``rows`` random images and labels, the same on every call."""
    rng = np.random.default_rng(0)
    return {"image": rng.random((rows, 3, args.image_size, args.image_size), dtype=np.float32),
            "label": rng.integers(0, args.class_dim, size=(rows, 1), dtype=np.int64)}


def check_seed(ctx: Context):
    args = seed_args(ctx)
    rows = args.microbatch_num * args.microbatch_size
    batch = seed_batch(args, rows)
    warmup, steps = (1, 2) if ctx.cpu else (2, 3) if ctx.quick else (3, 10)
    place = ctx.place()

    main, startup, model = build_seed(args, pipeline=False)  # one device, the whole global batch
    single, scope = paddle.static.Executor(place), paddle.static.Scope()
    single.run(startup, scope=scope)
    one_s, one_losses = timed(lambda: float(np.mean(single.run(main, feed=batch, fetch_list=[model.loss],
                                                                scope=scope)[0])), warmup, steps)
    single = scope = None  # free the baseline's GPU memory before the pipeline runs

    main, startup, model = build_seed(args, pipeline=True)
    plan = staticpipe.plan_of(main)
    exe = staticpipe.Executor(place, device_map=ctx.device_map(plan.devices))
    try:
        exe.run(startup)
        pipe_s, pipe_losses = timed(lambda: float(np.mean(exe.run(main, feed=batch, fetch_list=[model.loss])[0])),
                                    warmup, steps)
    finally:
        exe.close()
    one_rate, pipe_rate = steps * rows / one_s, steps * rows / pipe_s
    finite = bool(np.all(np.isfinite(one_losses)) and np.all(np.isfinite(pipe_losses)))
    onto = " (both stages on GPU 0: this machine has 1 GPU)" if ctx.gpus == 1 else ""
    text = (f"ResNet-{args.layers} width {args.width}, {args.image_size}x{args.image_size}, {args.microbatch_num} "
            f"micro-batches of {args.microbatch_size}: 2 stages {pipe_rate:.1f} samples/s{onto}, 1 device "
            f"{one_rate:.1f} samples/s, ratio {pipe_rate / one_rate:.2f}x ({steps} steps after {warmup} warm-up; "
            f"losses {'finite' if finite else f'NOT finite: {pipe_losses} / {one_losses}'}"
            f"{'' if ctx.cpu else ', TF32 default'})")
    return ctx.describe(plan.devices), text, PASS if finite else FAIL


def check_memory(ctx: Context):
    args = seed_args(ctx)
    main, startup, model = build_seed(args, pipeline=True)
    plan = staticpipe.plan_of(main)
    mapping = ctx.device_map(plan.devices)
    exe = staticpipe.Executor(ctx.place(), device_map=mapping)
    batch = seed_batch(args, args.microbatch_num * args.microbatch_size)
    try:
        exe.run(startup)
        losses = [float(np.mean(exe.run(main, feed=batch, fetch_list=[model.loss])[0])) for _ in range(2)]
        stats = exe.memory_stats()
    finally:
        exe.close()
    parts, ok = [], bool(np.all(np.isfinite(losses)))
    limits = {0: 2, 1: 1}  # 1F1B on 2 stages: stage s holds at most p - s micro-batches
    for stage in plan.stages:
        s = stats.get(stage.index)
        if s is None:
            parts.append(f"stage {stage.index}: no statistics")
            ok = False
            continue
        inflight = s["peak_inflight_microbatches"]
        ok = ok and s["peak_activation_bytes"] > 0 and 1 <= inflight <= limits.get(stage.index, plan.num_microbatches)
        parts.append(f"stage {stage.index} ({stage.device}) activations {s['peak_activation_bytes'] / MiB:.1f} MiB, "
                     f"{inflight} in flight")
    if ctx.gpus:
        used = sorted({int(mapping.get(d, d).split(":")[1]) for d in plan.devices if d.startswith("gpu:")})
        for k in used:
            peak = paddle.device.cuda.max_memory_allocated(k)
            owners = [st.index for st in plan.stages if int(mapping.get(st.device, st.device).split(":")[1]) == k]
            parts.append(f"GPU {k} (stage{'s' if len(owners) > 1 else ''} {'+'.join(map(str, owners))}) peak "
                         f"allocated {peak / MiB:.0f} MiB")
        if ctx.in_process:
            parts.append("(--in-process: the GPU peaks include the checks run before this one)")
    else:
        parts.append("GPU allocator peaks: n/a on CPU")
    text = (f"seed ResNet-{args.layers} width {args.width}, {args.image_size}x{args.image_size}, 1F1B: "
            + "; ".join(parts))
    return ctx.describe(plan.devices), text, PASS if ok else FAIL
