"""Rows f and g: AMP across the stages, a 2-stage MLP in fp32 beside fp16 O1 (every stage's copy of the
loss scale equal) and bf16 O1: samples/s and kept activations per stage side by side."""
from __future__ import annotations

import staticpipe

from .._paddle import np, paddle
from ..capabilities import WRONG_BF16_ENV, cpu_bf16, wrong_bf16_allowed
from .harness import FAIL, PASS, SKIP, Context, MiB, timed


def check_fp16(ctx: Context):
    """f. fp16 O1 (dynamic loss scaling) beside fp32; every stage's copy of the loss scale must agree. On
    GPU ``paddle.static.amp.decorate`` casts the white-list ops; on CPU (a dry run) fp16 casts nothing
    (Paddle has no CPU fp16 kernels), so only the loss scaling is exercised."""
    return _amp_row(ctx, "fp16")


def check_bf16(ctx: Context):
    """g. bf16 O1 beside fp32: on GPU ``paddle.static.amp.decorate(dtype="bfloat16")``, on CPU (a dry run)
    ``decorate_bf16``, which needs a CPU with bfloat16 kernels that compute right: SKIP where the probe says
    no, or that Paddle computes it wrong here (unless allowed)."""
    if not ctx.gpus and not cpu_bf16().ok:
        return "CPU", f"skipped: this CPU cannot run bfloat16 through Paddle's oneDNN ({cpu_bf16().reason})", SKIP
    if not ctx.gpus and not cpu_bf16().right and not wrong_bf16_allowed():
        return "CPU", (f"skipped: Paddle computes bfloat16 wrong on this CPU ({cpu_bf16().wrong}); "
                       f"{WRONG_BF16_ENV}=1 runs it all the same"), SKIP
    return _amp_row(ctx, "bf16")


def _amp_row(ctx: Context, low: str):
    """The same 2-stage MLP in fp32 and in precision ``low``, samples/s and peak memory side by side."""
    from models import build_mlp

    size = dict(in_dim=256, hidden=512, depth=4) if ctx.small else dict(in_dim=1024, hidden=4096, depth=8)
    batch, m, steps = (64, 4, 2) if ctx.small else (1024, 8, 5)
    parts, ok, base, devices = [], True, None, []
    for precision in ("fp32", low):
        net = build_mlp(num_stages=2, **size)
        opt = paddle.optimizer.Momentum(0.01, momentum=0.9)
        if precision == "fp16":
            opt = paddle.static.amp.decorate(opt, init_loss_scaling=2.0 ** 15)
        elif precision == "bf16":
            opt = (paddle.static.amp.decorate(opt, dtype="bfloat16") if ctx.gpus
                   else paddle.static.amp.bf16.decorate_bf16(opt))
        with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard():
            staticpipe.PipelineOptimizer(opt, num_microbatches=m).minimize(net.loss)
        plan = staticpipe.plan_of(net.main)
        devices = plan.devices
        exe = staticpipe.Executor(ctx.place(), device_map=ctx.device_map(plan.devices))
        data = net.random_batch(batch)
        try:
            exe.run(net.startup)
            exe.run(net.main, feed=data)
            took, losses = timed(lambda: exe.run(net.main, feed=data, fetch_list=[net.loss]), 0, steps)
            kept = [s["peak_activation_bytes"] / MiB for _, s in sorted(exe.memory_stats().items())]
            if precision == "fp16":
                scale = next(op.input("PrevLossScaling")[0] for op in net.main.global_block().ops
                             if op.type == "update_loss_scaling")
                copies = {s: float(np.array(exe._devices.worker(plan.stages[s].device).scope.find_var(scale)
                                            .get_tensor()).item()) for s in plan.stage_of_var(scale)}
                ok = ok and len(copies) == len(plan.stages) and len(set(copies.values())) == 1
                parts.append(f"fp16 loss scale per stage {copies}")
        finally:
            exe.close()
        finite = all(np.isfinite(np.mean(loss)) for (loss,) in losses)
        ok = ok and finite
        rate = batch * steps / took
        base = base or rate
        cut = next(v for r in plan.routes if r.src.stage == 0 and r.src.kind == "forward" for v in r.vars)
        parts.append(f"{precision} {rate:.0f} samples/s ({rate / base:.2f}x), cut {cut.describe()}, kept "
                     f"activations per stage {', '.join(f'{k:.1f}' for k in kept)} MiB"
                     + ("" if finite else " NON-FINITE LOSS"))
    if ctx.gpus:
        parts.append(f"GPU peaks (both runs) "
                     f"{[round(paddle.device.cuda.max_memory_allocated(k) / MiB) for k in range(ctx.gpus)]} MiB")
    return ctx.describe(devices), "; ".join(parts), PASS if ok else FAIL
