"""Row e: the launched 2-process path (``python -m staticpipe.launch --nprocs 2``), NCCL on 2 GPUs (gloo in
a CPU dry run), its two ranks' merged state against the same job in one process."""
from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import time

from .._paddle import np
from .harness import FAIL, PASS, SKIP, Context, MiB, compare
from .process import run_group, with_packages_on_path

# the job both runs train, written to a temporary folder: its ranks save their state and losses there
LAUNCH_SCRIPT = textwrap.dedent("""
    import os
    import numpy as np
    import staticpipe
    from models import build_mlp
    import paddle
    paddle.enable_static()
    cfg = {cfg!r}
    net = build_mlp(num_stages=2, in_dim=cfg["in_dim"], hidden=cfg["hidden"], depth=cfg["depth"])
    with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard():
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9),
                                     num_microbatches=cfg["m"], schedule=cfg["schedule"]).minimize(net.loss)
    exe = staticpipe.Executor(device_map={{}})
    exe.run(net.startup)
    rank = os.environ.get("PADDLE_TRAINER_ID", "single") if int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1 \\
        else "single"
    losses = []
    for step in range(cfg["steps"]):
        loss, = exe.run(net.main, feed=net.random_batch(cfg["batch"], seed=step), fetch_list=[net.loss])
        losses.append(np.nan if loss is None else float(np.mean(loss)))
    np.savez(os.path.join(cfg["out"], f"state_{{rank}}.npz"), **exe.state_dict(net.main))
    np.save(os.path.join(cfg["out"], f"loss_{{rank}}.npy"), np.array(losses))
    exe.close()
""")


def check_launch(ctx: Context):
    if not ctx.cpu and ctx.gpus < 2:
        return f"{ctx.gpus} GPU", f"skipped: {ctx.gpus} GPU (the NCCL path needs 2)", SKIP
    small = ctx.small
    with tempfile.TemporaryDirectory(prefix="staticpipe-selftest-") as out:
        cfg = dict(in_dim=64 if small else 1024, hidden=256 if small else 4096, depth=4, m=4 if small else 8,
                   batch=32 if small else 8 * 4096, steps=3 if small else 20, schedule="1F1B", out=out)
        script = os.path.join(out, "train.py")
        with open(script, "w") as f:
            f.write(LAUNCH_SCRIPT.format(cfg=cfg))
        env = with_packages_on_path(os.environ)
        env.pop("STATICPIPE_DEVICE_MAP", None)
        limit = 240 if small else 400  # each of the two runs; the check's own limit is --timeout
        code, tail = run_group([sys.executable, script], env, limit)
        if code != 0:
            what = f"timed out after {limit} s" if code is None else f"exited {code}"
            raise RuntimeError(f"the one-process run {what}: {tail[-1500:]}")
        start = time.perf_counter()
        code, tail = run_group([sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", script], env, limit)
        launched_s = time.perf_counter() - start
        if code != 0:
            what = f"timed out after {limit} s (a hang?)" if code is None else f"exited {code}"
            raise RuntimeError(f"the 2-process job {what}: {tail[-1500:]}")
        single = dict(np.load(os.path.join(out, "state_single.npz")))
        merged = {}
        for rank in (0, 1):
            merged.update(dict(np.load(os.path.join(out, f"state_{rank}.npz"))))
        losses = np.load(os.path.join(out, "loss_1.npy"))  # the last stage computes the loss
        reference = np.load(os.path.join(out, "loss_single.npy"))
    worst, _, bad = compare(merged, single, ctx)
    ok = not bad and np.allclose(losses, reference, rtol=ctx.rtol, atol=ctx.atol)
    backend = "gloo (CPU dry run)" if ctx.cpu else "NCCL"
    cut = cfg["batch"] // cfg["m"] * cfg["hidden"] * 4
    cut_text = f"{cut / MiB:.0f} MiB" if cut >= MiB else f"{cut / 1024:.0f} KiB"
    text = (f"{backend}, MLP {cfg['depth']}x{cfg['hidden']}, {cfg['m']} micro-batches, cut tensor {cut_text}, "
            f"{cfg['steps']} steps in {launched_s:.1f} s: 2 processes vs 1 process max rel diff {worst:.2e}; "
            f"{ctx.tolerance()}" + (f"; differ: {', '.join(bad[:4])}" if bad else ""))
    devices = "2 processes on CPU" if ctx.cpu else "2 processes, GPU 0 + GPU 1"
    return devices, text, PASS if ok else FAIL
