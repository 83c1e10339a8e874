"""The same pipelines built as legacy-IR and as PIR programs, timed side by side in one run (Paddle 3.x).

For each configuration (an MLP, the GPT or the ResNet-50 of ``models/``, ``p`` stages, ``m`` micro-batches,
1F1B, Adam; the GPT with global-norm clipping and its tied embedding exchanged between the stages; the
ResNet with batch norm's running statistics in the stages) the
legacy program is built in legacy-IR mode (the process opts in) and the PIR one inside
``paddle.pir_utils.IrGuard``; both train on the same batches. Rounds interleave the two (a slow spell of
the machine hits both alike) and the table gives each one's median step, the PIR/legacy ratio (issue 18's
target: <= 1.05), the time per compute action (F, B, OPT), which on the narrow MLP is mostly
staticpipe's and Paddle's per-run machinery rather than arithmetic, and the largest device's peak of
activations held between forward and backward (``Executor.device_memory_stats``).

AMP has no PIR row: Paddle 3.3.1 cannot train a PIR AMP program on a CPU at all (float16 has no CPU
kernels; a bfloat16 step dies by SIGSEGV in oneDNN's matmul backward, on one device: README "PIR
programs"), so the bench says so instead of timing one.

    python bench/ir_compare.py [--rounds 30] [--batch 64]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
staticpipe.use_legacy_ir()  # on Paddle 3: the process's mode: legacy programs; the PIR ones are built under IrGuard
from staticpipe._paddle import PADDLE_MAJOR, paddle  # noqa: E402
from staticpipe.schedule import Kind  # noqa: E402
from models import build_gpt, build_mlp, build_resnet  # noqa: E402

CONFIGS = [  # (label, model, width, depth, stages, micro-batches); GPT: d_model = width, depth layers
    ("narrow MLP (machinery-bound)", "mlp", 64, 4, 2, 8),
    ("narrow MLP (machinery-bound)", "mlp", 64, 8, 4, 16),
    ("wide MLP (compute-bound)", "mlp", 768, 4, 2, 4),
    ("GPT, tied embedding, clip", "gpt", 128, 4, 2, 4),
    ("ResNet-50, batch norm, 32x32", "resnet", 8, 50, 2, 4),
]


def network(model: str, width: int, depth: int, stages: int):
    if model == "gpt":
        return build_gpt(num_stages=stages, d_model=width, n_layers=depth, seq_len=32, vocab=256)
    if model == "resnet":
        return build_resnet(depth=depth, num_stages=stages, width=width, image_size=32)
    return build_mlp(num_stages=stages, in_dim=width, hidden=width, depth=depth)


def mode(ir: str):
    return paddle.pir_utils.IrGuard() if ir == "PIR" else contextlib.nullcontext()


def pipeline(ir: str, model: str, width: int, depth: int, stages: int, microbatches: int, batch: dict):
    """A step function of the pipeline built in ``ir``, its compute actions per step, and its executor."""
    with mode(ir):
        net = network(model, width, depth, stages)
        with paddle.static.program_guard(net.main, net.startup):
            clip = paddle.nn.ClipGradByGlobalNorm(1.0) if model == "gpt" else None
            opt = staticpipe.PipelineOptimizer(paddle.optimizer.Adam(1e-3, grad_clip=clip), num_microbatches=microbatches)
            opt.minimize(net.loss)
        exe = staticpipe.Executor(paddle.CPUPlace())
        exe.run(net.startup)
    actions = sum(1 for acts in opt.plan.actions.values() for a in acts if a.kind in (Kind.F, Kind.B, Kind.OPT))
    return (lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss])), actions, exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds (one step of every configuration each)")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    if PADDLE_MAJOR < 3:
        print(f"paddle {paddle.__version__} has no PIR programs: nothing to compare (run this on Paddle 3.x)")
        return
    paddle.enable_static()
    runs = {}
    for label, model, width, depth, p, m in CONFIGS:
        batch = network(model, width, depth, p).random_batch(args.batch)
        for ir in ("legacy", "PIR"):
            runs[(label, width, p, m, ir)] = pipeline(ir, model, width, depth, p, m, batch)
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    for key, (step, _, _) in runs.items():
        with mode(key[-1]):
            for _ in range(3):  # warm-up: interpreters, scopes, allocator
                step()
    for _ in range(args.rounds):
        for key, (step, _, _) in runs.items():
            with mode(key[-1]):  # Paddle runs a PIR program only in PIR mode (its APIs are switched per process)
                start = time.perf_counter()
                step()
                times[key].append(time.perf_counter() - start)
    print(f"paddle {paddle.__version__}, {args.rounds} rounds, batch {args.batch}, Adam, 1F1B, CPU devices, "
          f"{os.cpu_count()} cores")
    print(f"{'configuration':<46} {'legacy ms':>10} {'PIR ms':>10} {'PIR/legacy':>11} {'legacy µs/act':>14} "
          f"{'PIR µs/act':>11} {'legacy peak MiB':>16} {'PIR peak MiB':>13}")
    for label, _, width, _, p, m in CONFIGS:
        legacy, pir = (statistics.median(times[(label, width, p, m, ir)]) for ir in ("legacy", "PIR"))
        actions = runs[(label, width, p, m, "legacy")][1]
        peaks = [max(d["peak_activation_bytes"] for d in runs[(label, width, p, m, ir)][2].device_memory_stats().values())
                 / 2**20 for ir in ("legacy", "PIR")]
        print(f"{f'{label} w={width} p={p} m={m}':<46} {legacy * 1e3:>10.2f} {pir * 1e3:>10.2f} {pir / legacy:>11.2f} "
              f"{legacy / actions * 1e6:>14.0f} {pir / actions * 1e6:>11.0f} {peaks[0]:>16.2f} {peaks[1]:>13.2f}")
    print("AMP (fp16 loss scaling, bf16): legacy only; Paddle 3.3.1 cannot train a PIR AMP program on a CPU (float16 "
          "has no CPU kernels, a bfloat16 step dies in oneDNN's matmul backward): README \"PIR programs\"")


if __name__ == "__main__":
    main()
