"""Rows a and b: pipelines against single-device Paddle training, from the same initial state on the same
batches, every parameter and optimizer state compared (MLP, ResNet with batch norm, GPT with a tied
embedding, DLRM with its embeddings on a "cpu" stage)."""
from __future__ import annotations

from functools import partial
from typing import Callable

import staticpipe

from .._paddle import np, paddle
from .harness import FAIL, PASS, Context, compare, exact_gpu_math


def train_pair(ctx: Context, builder: Callable, steps: int, batch_size: int, num_microbatches: int,
               micro_reference: bool = False, lr: float = 0.05) -> dict:
    """Train ``builder()`` pipelined on ``ctx``'s devices and ``builder(guarded=False)`` with Paddle on one
    device (GPU 0), from the same initial state on the same batches; compare every state tensor.

    ``micro_reference``: the reference runs one micro-batch per executor run under Paddle's
    GradientMergeOptimizer (the exact reference for batch norm); else the whole batch per run."""
    def momentum():
        return paddle.optimizer.Momentum(lr, momentum=0.9)

    ref, pipe = builder(guarded=False), builder()
    with paddle.static.program_guard(ref.main, ref.startup), paddle.utils.unique_name.guard():
        opt = momentum()
        if micro_reference:
            opt = paddle.incubate.optimizer.GradientMergeOptimizer(opt, k_steps=num_microbatches, avg=True)
        opt.minimize(ref.loss)
    with paddle.static.program_guard(pipe.main, pipe.startup), paddle.utils.unique_name.guard():
        staticpipe.PipelineOptimizer(momentum(), num_microbatches=num_microbatches).minimize(pipe.loss)
    place = ctx.place()
    ref_exe, scope = paddle.static.Executor(place), paddle.static.Scope()
    ref_exe.run(ref.startup, scope=scope)
    exe = staticpipe.Executor(place, device_map=ctx.device_map(pipe.devices))
    try:
        exe.run(pipe.startup)
        names = [n for n in exe.state_dict(pipe.main) if scope.find_var(n) is not None]
        params = [p.name for p in pipe.main.all_parameters()]
        missing = [p for p in params if p not in names]
        if missing:
            raise AssertionError(f"the reference scope lacks parameters {missing[:5]}")
        exe.set_state_dict(pipe.main, {n: np.array(scope.find_var(n).get_tensor()) for n in names})
        mb = batch_size // num_microbatches
        pipe_losses, ref_losses = [], []
        for step in range(steps):
            batch = ref.random_batch(batch_size, seed=step)
            if micro_reference:
                losses = [ref_exe.run(ref.main, feed={k: v[m * mb:(m + 1) * mb] for k, v in batch.items()},
                                      fetch_list=[ref.loss], scope=scope)[0] for m in range(num_microbatches)]
                ref_losses.append(float(np.mean(losses)))
            else:
                ref_losses.append(float(np.mean(ref_exe.run(ref.main, feed=batch, fetch_list=[ref.loss],
                                                            scope=scope)[0])))
            pipe_losses.append(float(np.mean(exe.run(pipe.main, feed=batch, fetch_list=[pipe.loss])[0])))
        state = exe.state_dict(pipe.main)
    finally:
        exe.close()
    worst, worst_name, bad = compare({n: state[n] for n in names},
                                     {n: np.array(scope.find_var(n).get_tensor()) for n in names}, ctx)
    loss_rel = max(abs(p - r) / max(abs(r), 1e-30) for p, r in zip(pipe_losses, ref_losses))
    finite = all(np.isfinite(pipe_losses)) and all(np.isfinite(ref_losses))
    ok = finite and not bad and np.allclose(pipe_losses, ref_losses, rtol=ctx.rtol, atol=ctx.atol)
    text = (f"{len(names)} tensors after {steps} steps: max rel diff {worst:.2e} ({worst_name}), losses "
            f"{loss_rel:.1e}; {ctx.tolerance()}")
    if bad:
        text += f"; beyond tolerance: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} ({len(bad)})"
    if not finite:
        text += f"; non-finite losses {pipe_losses} / {ref_losses}"
    return {"ok": ok, "text": text, "devices": pipe.devices}


def _equivalence(ctx: Context, builder: Callable, steps: int, batch: int, m: int, micro: bool,
                 what: str) -> tuple[str, str, str]:
    with exact_gpu_math(ctx):
        got = train_pair(ctx, builder, steps, batch, m, micro_reference=micro)
    reference = "GradientMerge, one run per micro-batch" if micro else "whole batch per run"
    return (ctx.describe(got["devices"]), f"{what}, {m} micro-batches vs 1 device ({reference}): {got['text']}",
            PASS if got["ok"] else FAIL)


def check_mlp(ctx: Context):
    from models import build_mlp
    if ctx.small:
        return _equivalence(ctx, partial(build_mlp, num_stages=2), 3, 32, 4, False, "MLP 4x256")
    return _equivalence(ctx, partial(build_mlp, num_stages=2, in_dim=1024, hidden=2048, depth=8), 5, 512, 8,
                        False, "MLP 8x2048")


def check_resnet(ctx: Context):
    from models import build_resnet
    if ctx.small:
        return _equivalence(ctx, partial(build_resnet, depth=50, num_stages=2, width=8, image_size=16), 3, 16, 4,
                            True, "ResNet-50 width 8, 16x16")
    return _equivalence(ctx, partial(build_resnet, depth=50, num_stages=2, width=32, image_size=64), 3, 64, 4,
                        True, "ResNet-50 width 32, 64x64")


def check_gpt(ctx: Context):
    from models import build_gpt
    if ctx.small:
        return _equivalence(ctx, partial(build_gpt, num_stages=2), 3, 16, 4, False, "GPT 4 layers d32")
    return _equivalence(ctx, partial(build_gpt, num_stages=2, vocab=1024, seq_len=128, d_model=256, n_heads=8,
                                     n_layers=8), 3, 32, 8, False, "GPT 8 layers d256")


def check_dlrm(ctx: Context):
    from models import build_dlrm
    if ctx.small:
        return _equivalence(ctx, partial(build_dlrm, num_stages=2), 3, 64, 4, False, "DLRM, embeddings on cpu")
    return _equivalence(ctx, partial(build_dlrm, num_stages=3, vocab_size=100_000, embed_dim=64, hidden=(512, 256)),
                        3, 1024, 8, False, "DLRM vocab 100k, embeddings on cpu")
