"""GPU acceptance: what the first machine with CUDA must show before staticpipe's GPU path is trusted.

    python bench/gpu_acceptance.py            # on a machine with paddlepaddle-gpu==2.6.2 and 1+ GPUs
    python bench/gpu_acceptance.py --quick    # the same checks with small sizes (a few minutes)
    python bench/gpu_acceptance.py --cpu --quick   # a dry run of the harness on CPU devices (what CI runs)

Without CUDA (and without ``--cpu``) it prints why it skipped and exits 0. Otherwise it prints ONE table,
a row per check (check, devices, result / metric, PASS / FAIL / SKIP, seconds), and exits 1 if any check
failed:

  a. equivalence on GPU stages: MLP, ResNet-50 (batch norm) and GPT (tied embedding) pipelines against
     single-device training on one GPU (``paddle.static.Executor(paddle.CUDAPlace(0))``), from the same
     initial state on the same batches. MLP and GPT: the reference trains on the whole global batch.
     ResNet: batch norm normalises each micro-batch by its own statistics (as Paddle's pipeline does), so
     its exact reference is Paddle's GradientMergeOptimizer, one executor run per micro-batch. Every
     parameter and optimizer state (batch-norm running statistics included) must be within
     ``atol + rtol * |reference|`` and the losses within rtol; the row gives the largest relative
     difference (max |pipeline - reference| / max |reference|, over each tensor) and the tolerance.
     TF32 is switched off for these rows (``NVIDIA_TF32_OVERRIDE=0``, ``FLAGS_allow_tf32_cublas=0``,
     ``FLAGS_cudnn_deterministic=1``): rtol 1e-4, atol 1e-5. ``--tf32`` leaves TF32 on: rtol 1e-2,
     atol 1e-3. On CPU (``--cpu``) the project's own tolerance, rtol 1e-5, atol 1e-6.
  b. heterogeneous stages: DLRM with its embedding tables on a "cpu" stage and the MLPs on GPU stages,
     against the whole program on one GPU; same tolerances.
  c. the seed job (``examples/train_resnet50_seed.py``, its network imported from there): 2 pipeline
     stages against the same network on one GPU (plain Momentum, the whole global batch per run), both
     fed the same global batch from host memory; samples/s of both and their ratio. With one GPU the
     two stages run on GPU 0 through the device map (``{"gpu:1": "gpu:0"}``), and the row says so.
  d. peak memory per stage of the seed job pipelined: ``Executor.memory_stats()`` (activations held
     between forward and backward, micro-batches in flight: at most 2 / 1 for 1F1B on 2 stages) and
     ``paddle.device.cuda.max_memory_allocated`` of each GPU, in a fresh process.
  e. the launched 2-process path (``python -m staticpipe.launch --nprocs 2``): NCCL when there are 2+ GPUs
     (a cut tensor of 64 MiB at full size), the merged state of both ranks against the same job in one
     process; "skipped: 1 GPU" otherwise. With ``--cpu`` it runs on gloo.
  f. AMP fp16 across the stages: a 2-stage MLP in fp32 and fp16 O1, samples/s and kept activations per
     stage side by side, and every stage's copy of the fp16 loss scale equal.
  g. AMP bf16 across the stages: the same MLP in fp32 and bf16 O1. On CPU stages bfloat16 needs a CPU whose
     oneDNN runs it (``staticpipe.capabilities``); where it does not, the row is SKIP with the reason.

Each check runs in its own process (``--in-process`` runs them here), under a time limit (``--timeout``),
so a crash or a hang (an NCCL deadlock) is reported in its row and the other checks still run.
Each check's whole output is kept in ``--log-dir`` (default: a new temporary directory, printed), and a
failed row names its log. ``--only a-mlp,e-launch`` runs some of them; ``--json PATH`` also writes the
rows as JSON. The table is Markdown: paste it into the README as it is.

``--cpu`` hides every GPU (``CUDA_VISIBLE_DEVICES=""``): the "gpu:k" stages become CPU devices and the
table is labelled CPU DRY RUN -- it exercises the harness, it is never a GPU result.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SEED_SCRIPT = os.path.join(ROOT, "examples", "train_resnet50_seed.py")
RESULT_TAG = "GPU_ACCEPTANCE_ROW "
SKIP_MESSAGE = ("no CUDA device: this Paddle {why}, so there is nothing to accept here; run on a GPU machine "
                "(paddlepaddle-gpu==2.6.2) with `python bench/gpu_acceptance.py` (`--quick` for small sizes), "
                "or `python bench/gpu_acceptance.py --cpu` for a dry run of the harness on CPU devices")
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
MiB = 1 << 20


@dataclass
class Row:
    check: str
    devices: str
    result: str
    status: str
    seconds: float


# --------------------------------------------------------------------------------------------- context

class Context:
    """What a check needs to know: CPU dry run or GPUs, sizes, tolerances, places."""

    def __init__(self, cpu: bool, quick: bool, tf32: bool, in_process: bool = False):
        import staticpipe  # first: it settles Paddle's static-IR flag
        staticpipe.use_legacy_ir()  # on Paddle 3: its checks include AMP and saved plans, legacy-IR features there
        import paddle

        paddle.enable_static()
        self.cpu, self.quick, self.tf32, self.in_process = cpu, quick, tf32, in_process
        self.gpus = paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() and not cpu else 0
        if cpu:
            self.rtol, self.atol = 1e-5, 1e-6
        elif tf32:
            self.rtol, self.atol = 1e-2, 1e-3
        else:
            self.rtol, self.atol = 1e-4, 1e-5

    @property
    def small(self) -> bool:
        return self.cpu or self.quick

    def place(self):
        """Where single-device references run: GPU 0, or the CPU in a dry run (never a CUDAPlace without
        a GPU: constructing one on a CPU build of Paddle kills the process)."""
        import paddle
        return paddle.CUDAPlace(0) if self.gpus else paddle.CPUPlace()

    def device_map(self, devices) -> dict:
        """Pipeline device -> GPU for a pipeline of more GPU devices than this machine has (gpu:k on GPU
        k mod count); empty when every device exists (and on CPU, where gpu:k are CPU devices anyway).
        Always a dict, so that STATICPIPE_DEVICE_MAP in the environment does not change a check."""
        if not self.gpus:
            return {}
        return {d: f"gpu:{int(d.split(':')[1]) % self.gpus}" for d in devices
                if d.startswith("gpu:") and int(d.split(":")[1]) >= self.gpus}

    def describe(self, devices) -> str:
        """The devices column: the pipeline's devices and where they ran."""
        devices = list(devices)
        if not self.gpus:
            return f"CPU: {'+'.join(devices)} as CPU devices"
        mapping = self.device_map(devices)
        used = sorted({mapping.get(d, d) for d in devices if d.startswith("gpu:")})
        where = ", ".join(f"GPU {u.split(':')[1]}" for u in used)
        cpu = "CPU + " if "cpu" in devices else ""
        mapped = f" (device map {', '.join(f'{k}->{v}' for k, v in mapping.items())})" if mapping else ""
        return f"{'+'.join(devices)} on {cpu}{where}{mapped}"

    def tolerance(self) -> str:
        if self.cpu:
            return f"rtol {self.rtol:g}, atol {self.atol:g}"
        return f"rtol {self.rtol:g}, atol {self.atol:g}, TF32 {'on' if self.tf32 else 'off'}"


@contextlib.contextmanager
def exact_gpu_math(ctx: Context):
    """TF32 off in cuBLAS and deterministic cuDNN algorithms for an equivalence check (unless --tf32);
    flags a CPU build does not define are skipped. The environment variables set by the parent
    (NVIDIA_TF32_OVERRIDE=0, read when CUDA libraries start) do the rest."""
    import paddle
    wanted = {} if (ctx.tf32 or not ctx.gpus) else {"FLAGS_allow_tf32_cublas": False, "FLAGS_cudnn_deterministic": True}
    saved = {}
    for flag, value in wanted.items():
        try:
            saved.update(paddle.get_flags([flag]))
            paddle.set_flags({flag: value})
        except Exception:  # noqa: BLE001 -- not defined in this build of Paddle
            pass
    try:
        yield
    finally:
        for flag, value in saved.items():
            paddle.set_flags({flag: value})


def compare(got: dict, want: dict, ctx: Context) -> tuple[float, str, list[str]]:
    """(largest relative difference, its tensor, tensors beyond ``atol + rtol * |want|``) of ``got``
    against ``want`` (name -> array); a name in only one of them counts as beyond."""
    import numpy as np
    worst, worst_name = 0.0, "-"
    bad = sorted(set(got) ^ set(want))
    for name, ref in want.items():
        if name not in got or ref.size == 0:
            continue
        value = np.asarray(got[name])
        rel = float(np.max(np.abs(value.astype(np.float64) - ref))) / max(float(np.max(np.abs(ref))), 1e-30)
        if rel > worst:
            worst, worst_name = rel, name
        if not np.allclose(value, ref, rtol=ctx.rtol, atol=ctx.atol):
            bad.append(name)
    return worst, worst_name, bad


# ------------------------------------------------------------------------------------------ equivalence

def train_pair(ctx: Context, builder: Callable, steps: int, batch_size: int, num_microbatches: int,
               micro_reference: bool = False, lr: float = 0.05) -> dict:
    """Train ``builder()`` pipelined on ``ctx``'s devices and ``builder(guarded=False)`` with Paddle on one
    device (GPU 0), from the same initial state on the same batches; compare every state tensor.

    ``micro_reference``: the reference runs one micro-batch per executor run under Paddle's
    GradientMergeOptimizer (the exact reference for batch norm); else the whole batch per run."""
    import numpy as np
    import paddle
    import staticpipe

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
    from functools import partial
    from models import build_mlp
    if ctx.small:
        return _equivalence(ctx, partial(build_mlp, num_stages=2), 3, 32, 4, False, "MLP 4x256")
    return _equivalence(ctx, partial(build_mlp, num_stages=2, in_dim=1024, hidden=2048, depth=8), 5, 512, 8,
                        False, "MLP 8x2048")


def check_resnet(ctx: Context):
    from functools import partial
    from models import build_resnet
    if ctx.small:
        return _equivalence(ctx, partial(build_resnet, depth=50, num_stages=2, width=8, image_size=16), 3, 16, 4,
                            True, "ResNet-50 width 8, 16x16")
    return _equivalence(ctx, partial(build_resnet, depth=50, num_stages=2, width=32, image_size=64), 3, 64, 4,
                        True, "ResNet-50 width 32, 64x64")


def check_gpt(ctx: Context):
    from functools import partial
    from models import build_gpt
    if ctx.small:
        return _equivalence(ctx, partial(build_gpt, num_stages=2), 3, 16, 4, False, "GPT 4 layers d32")
    return _equivalence(ctx, partial(build_gpt, num_stages=2, vocab=1024, seq_len=128, d_model=256, n_heads=8,
                                     n_layers=8), 3, 32, 8, False, "GPT 8 layers d256")


def check_dlrm(ctx: Context):
    from functools import partial
    from models import build_dlrm
    if ctx.small:
        return _equivalence(ctx, partial(build_dlrm, num_stages=2), 3, 64, 4, False, "DLRM, embeddings on cpu")
    return _equivalence(ctx, partial(build_dlrm, num_stages=3, vocab_size=100_000, embed_dim=64, hidden=(512, 256)),
                        3, 1024, 8, False, "DLRM vocab 100k, embeddings on cpu")


# ------------------------------------------------------------------------------------------ the seed job

def load_seed():
    """examples/train_resnet50_seed.py as a module (its network builder is the job under test)."""
    spec = importlib.util.spec_from_file_location("train_resnet50_seed", SEED_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seed_args(ctx: Context, seed):
    if ctx.cpu:
        sizes = ["--image_size", "32", "--width", "8", "--microbatch_num", "2", "--microbatch_size", "2",
                 "--class_dim", "10"]
    elif ctx.quick:
        sizes = ["--image_size", "64", "--width", "16", "--microbatch_num", "4", "--microbatch_size", "8",
                 "--class_dim", "100"]
    else:
        sizes = []  # the real job: 224x224, width 64, 8 micro-batches of 32, 1000 classes
    return seed.parse_args(sizes)


def build_seed(seed, args, pipeline: bool):
    import paddle
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        model = seed.build(args, pipeline=pipeline)
    return main, startup, model


def seed_batch(args, rows: int) -> dict:
    import numpy as np
    rng = np.random.default_rng(0)
    return {"image": rng.random((rows, 3, args.image_size, args.image_size), dtype=np.float32),
            "label": rng.integers(0, args.class_dim, size=(rows, 1), dtype=np.int64)}


def _timed(run: Callable, warmup: int, steps: int) -> tuple[float, list]:
    losses = [run() for _ in range(warmup)]
    start = time.perf_counter()
    losses += [run() for _ in range(steps)]
    return time.perf_counter() - start, losses


def check_seed(ctx: Context):
    import numpy as np
    import paddle
    import staticpipe

    seed = load_seed()
    args = seed_args(ctx, seed)
    rows = args.microbatch_num * args.microbatch_size
    batch = seed_batch(args, rows)
    warmup, steps = (1, 2) if ctx.cpu else (2, 3) if ctx.quick else (3, 10)
    place = ctx.place()

    main, startup, model = build_seed(seed, args, pipeline=False)  # one device, the whole global batch
    single, scope = paddle.static.Executor(place), paddle.static.Scope()
    single.run(startup, scope=scope)
    one_s, one_losses = _timed(lambda: float(np.mean(single.run(main, feed=batch, fetch_list=[model.loss],
                                                                 scope=scope)[0])), warmup, steps)
    single = scope = None  # free the baseline's GPU memory before the pipeline runs

    main, startup, model = build_seed(seed, args, pipeline=True)
    plan = staticpipe.plan_of(main)
    exe = staticpipe.Executor(place, device_map=ctx.device_map(plan.devices))
    try:
        exe.run(startup)
        pipe_s, pipe_losses = _timed(lambda: float(np.mean(exe.run(main, feed=batch, fetch_list=[model.loss])[0])),
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
    import numpy as np
    import paddle
    import staticpipe

    seed = load_seed()
    args = seed_args(ctx, seed)
    main, startup, model = build_seed(seed, args, pipeline=True)
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


def check_fp16(ctx: Context):
    """f. fp16 O1 (dynamic loss scaling) beside fp32; every stage's copy of the loss scale must agree. On
    GPU ``paddle.static.amp.decorate`` casts the white-list ops; on CPU (a dry run) fp16 casts nothing
    (Paddle has no CPU fp16 kernels), so only the loss scaling is exercised."""
    return _amp_row(ctx, "fp16")


def check_bf16(ctx: Context):
    """g. bf16 O1 beside fp32: on GPU ``paddle.static.amp.decorate(dtype="bfloat16")``, on CPU (a dry run)
    ``decorate_bf16``, which needs a CPU with bfloat16 kernels: SKIP where the probe says no."""
    from staticpipe.capabilities import cpu_bf16

    if not ctx.gpus and not cpu_bf16().ok:
        return "CPU", f"skipped: this CPU cannot run bfloat16 through Paddle's oneDNN ({cpu_bf16().reason})", SKIP
    return _amp_row(ctx, "bf16")


def _amp_row(ctx: Context, low: str):
    """The same 2-stage MLP in fp32 and in precision ``low``, samples/s and peak memory side by side."""
    import numpy as np
    import paddle
    import staticpipe
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
            took, losses = _timed(lambda: exe.run(net.main, feed=data, fetch_list=[net.loss]), 0, steps)
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


# --------------------------------------------------------------------------------------- 2 processes

LAUNCH_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
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


def run_group(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own; on timeout kill the whole session (a launcher and its ranks).
    Returns (exit code or None on timeout, its output: stdout and stderr together)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        log.seek(0)
        return code, log.read()


def check_launch(ctx: Context):
    import numpy as np

    if not ctx.cpu and ctx.gpus < 2:
        return f"{ctx.gpus} GPU", f"skipped: {ctx.gpus} GPU (the NCCL path needs 2)", SKIP
    small = ctx.small
    with tempfile.TemporaryDirectory(prefix="staticpipe-acceptance-") as out:
        cfg = dict(in_dim=64 if small else 1024, hidden=256 if small else 4096, depth=4, m=4 if small else 8,
                   batch=32 if small else 8 * 4096, steps=3 if small else 20, schedule="1F1B", out=out)
        script = os.path.join(out, "train.py")
        with open(script, "w") as f:
            f.write(LAUNCH_SCRIPT.format(root=ROOT, cfg=cfg))
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
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


# ----------------------------------------------------------------------------------------------- driver

CHECKS: dict[str, tuple[str, Callable, bool]] = {  # key -> (row title, function, needs exact GPU math)
    "a-mlp": ("a. equivalence: MLP", check_mlp, True),
    "a-resnet": ("a. equivalence: ResNet (batch norm)", check_resnet, True),
    "a-gpt": ("a. equivalence: GPT (tied embedding)", check_gpt, True),
    "b-dlrm": ("b. heterogeneous cpu+gpu: DLRM", check_dlrm, True),
    "c-seed": ("c. seed ResNet-50: 2 stages vs 1 GPU", check_seed, False),
    "d-memory": ("d. peak memory per stage", check_memory, False),
    "e-launch": ("e. 2-process launch (NCCL)", check_launch, True),
    "f-amp": ("f. AMP fp16 across stages", check_fp16, False),
    "g-bf16": ("g. AMP bf16 across stages", check_bf16, False),
}


def run_check(key: str, ctx: Context) -> Row:
    """One check in this process; an exception becomes a FAIL row naming it."""
    title, function, _ = CHECKS[key]
    start = time.perf_counter()
    try:
        devices, result, status = function(ctx)
    except Exception as exc:  # noqa: BLE001 -- reported in the row, the other checks still run
        traceback.print_exc()
        devices, result, status = "-", clip(f"error: {type(exc).__name__}: {exc}".replace("\n", " ")), FAIL
    return Row(title, devices, result, status, round(time.perf_counter() - start, 1))


def clip(text: str, limit: int = 700) -> str:
    """``text`` cut to ``limit`` characters, keeping its start and its end (where a traceback ends)."""
    return text if len(text) <= limit else f"{text[:200]} ... {text[-(limit - 205):]}"


def run_isolated(key: str, args) -> Row:
    """One check in a process of its own, under a time limit; a crash or a hang becomes a FAIL row. The
    process's whole output is kept in ``args.log_dir``/<check>.log."""
    title, _, exact = CHECKS[key]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", key]
    cmd += [flag for flag, on in (("--cpu", args.cpu), ("--quick", args.quick), ("--tf32", args.tf32)) if on]
    env = dict(os.environ)
    if exact and not args.tf32 and not args.cpu:
        env.update(NVIDIA_TF32_OVERRIDE="0", FLAGS_allow_tf32_cublas="0", FLAGS_cudnn_deterministic="1")
    timeout = args.timeout or (300 if args.cpu or args.quick else 900)
    start = time.perf_counter()
    code, output = run_group(cmd, env, timeout)
    seconds = round(time.perf_counter() - start, 1)
    log = os.path.join(args.log_dir, f"{key}.log")
    with open(log, "w") as f:
        f.write(output)
    rows = [line[len(RESULT_TAG):] for line in output.splitlines() if line.startswith(RESULT_TAG)]
    if rows:
        row = Row(**json.loads(rows[-1]))
        if row.status == FAIL:
            row.result += f" (log: {log})"
        return row
    lines = [line for line in output.splitlines() if line.strip()]
    why = f"timed out after {timeout:g} s (a hang?)" if code is None else f"the check's process exited with code {code}"
    return Row(title, "-", clip(f"{why}: {' | '.join(lines[-3:])}") + f" (log: {log})", FAIL, seconds)


def environment_line(ctx: Context) -> str:
    import paddle
    cuda = paddle.version.cuda() if paddle.is_compiled_with_cuda() else "none"
    if ctx.cpu:
        return (f"CPU DRY RUN (--cpu): every stage is a CPU device; these are NOT GPU results. Paddle "
                f"{paddle.__version__}, CUDA build {cuda}")
    names = []
    for k in range(ctx.gpus):
        try:
            names.append(f"GPU {k}: {paddle.device.cuda.get_device_name(k)}")
        except Exception:  # noqa: BLE001
            names.append(f"GPU {k}")
    return (f"{ctx.gpus} GPU(s) ({'; '.join(names)}), Paddle {paddle.__version__}, CUDA {cuda}, "
            f"{'quick sizes' if ctx.quick else 'full sizes'}, TF32 in equivalence rows: {'on' if ctx.tf32 else 'off'}")


def format_table(rows: list[Row], header: str) -> str:
    """The rows as one Markdown table (paste it into the README as it is), under ``header``."""
    def cell(text: str) -> str:
        return text.replace("|", "/")

    out = [header, "", "| check | devices | result | status | seconds |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {cell(r.check)} | {cell(r.devices)} | {cell(r.result)} | {r.status} | {r.seconds:.1f} |" for r in rows]
    failed = [r.check for r in rows if r.status == FAIL]
    out.append("")
    out.append(f"{len(rows)} checks: {sum(r.status == PASS for r in rows)} passed, {len(failed)} failed, "
               f"{sum(r.status == SKIP for r in rows)} skipped" + (f" (failed: {'; '.join(failed)})" if failed else ""))
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU devices (labelled CPU; never a GPU result)")
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--tf32", action="store_true", help="leave TF32 on in the equivalence rows (looser tolerance)")
    ap.add_argument("--only", help=f"comma-separated checks: {', '.join(CHECKS)}")
    ap.add_argument("--in-process", action="store_true", help="run every check in this process (no isolation)")
    ap.add_argument("--timeout", type=float, help="seconds per check (default 300 with --quick/--cpu, else 900)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--log-dir", help="where each check's output is kept (default: a new temporary directory)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # run one check and print its row (run_isolated)
    args = ap.parse_args(argv)
    keys = list(CHECKS) if not args.only else [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys + ([args.worker] if args.worker else []) if k not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    args.keys = keys
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before Paddle starts: every gpu:k stage is a CPU device
    if args.in_process and not args.tf32 and not args.cpu:
        # one process for every row: TF32 off for all of them (the equivalence rows need it), read when
        # the CUDA libraries start; isolated checks get it per row from run_isolated
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    import staticpipe  # noqa: F401  (first: it settles Paddle's static-IR flag)
    import paddle

    if args.worker:
        row = run_check(args.worker, Context(args.cpu, args.quick, args.tf32))
        print(RESULT_TAG + json.dumps(asdict(row)), flush=True)
        return 0
    if not args.cpu:
        if not paddle.is_compiled_with_cuda():
            print(SKIP_MESSAGE.format(why="is a CPU build (paddlepaddle, not paddlepaddle-gpu)"))
            return 0
        if paddle.device.cuda.device_count() == 0:
            print(SKIP_MESSAGE.format(why="has CUDA but sees no GPU (CUDA_VISIBLE_DEVICES? driver?)"))
            return 0
    ctx = Context(args.cpu, args.quick, args.tf32, args.in_process)
    header = environment_line(ctx)
    print(header, file=sys.stderr, flush=True)
    if not args.in_process:
        args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="staticpipe-acceptance-logs-")
        os.makedirs(args.log_dir, exist_ok=True)
        print(f"each check's output: {args.log_dir}/<check>.log", file=sys.stderr, flush=True)
    rows = []
    for key in args.keys:
        print(f"running {CHECKS[key][0]} ...", file=sys.stderr, flush=True)
        row = run_check(key, ctx) if args.in_process else run_isolated(key, args)
        print(f"  {row.status} in {row.seconds:.1f} s: {row.result}", file=sys.stderr, flush=True)
        rows.append(row)
    print(format_table(rows, header), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": header, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 1 if any(r.status == FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
