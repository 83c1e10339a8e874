"""Mixed precision through the pipeline: step time, kept activations and message bytes, fp32 beside AMP.

Each precision trains the same pipelined model in a process of its own (so one run's allocator and
thread state cannot help another), rounds alternating, and prints side by side:
- step time (median over the timed steps of every round) and its ratio to fp32;
- per stage, the peak bytes of the activations a forward keeps for its backward (staticpipe's count);
- the bytes one micro-batch sends across the first cut, from the plan's cut variables;
- the bytes of AMP's low-precision parameter copies, which every stage holds once for all micro-batches.

Precisions: "fp32"; "fp16-O1" (``paddle.static.amp.decorate``: on CPU no op is cast, so this is the cost
of dynamic loss scaling itself: the overflow check of every gradient, the flag all-reduced over the
stages); "bf16" (``decorate_bf16``: bfloat16 kernels and bfloat16 activations between stages);
"bf16-pure" (``decorate_bf16(use_pure_bf16=True)``, SGD: parameters and feeds bfloat16 too; MLP only:
Paddle 2.6 has no CPU bfloat16 ``layer_norm_grad``, which the GPT needs). On a
CUDA machine the GPU acceptance bench measures fp16/bf16 on GPU stages.

    python bench/amp.py [--model mlp|gpt] [--stages 2] [--microbatches 8] [--batch 256] [--steps 4] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PRECISIONS = ("fp32", "fp16-O1", "bf16", "bf16-pure")


def run_one(args) -> dict:
    import staticpipe
    staticpipe.use_legacy_ir()  # on Paddle 3: AMP pipelines are built in the legacy IR (README "PIR programs")
    from models import build_gpt, build_mlp
    import paddle  # after staticpipe, which settles Paddle's IR flag
    from paddle.static.amp.bf16.amp_utils import convert_float_to_uint16

    if args.model == "mlp":
        net = build_mlp(num_stages=args.stages, in_dim=1024, hidden=1024, depth=8)
    else:
        net = build_gpt(num_stages=args.stages, d_model=256, n_heads=8, n_layers=8, seq_len=64, vocab=512)
    pure = args.precision == "bf16-pure"
    opt = paddle.optimizer.SGD(0.01, multi_precision=True) if pure else paddle.optimizer.Momentum(0.01, momentum=0.9)
    if args.precision == "fp16-O1":
        opt = paddle.static.amp.decorate(opt, init_loss_scaling=2.0 ** 15)
    elif args.precision.startswith("bf16"):
        opt = paddle.static.amp.bf16.decorate_bf16(opt, use_pure_bf16=pure, use_bf16_guard=False if pure else None)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(opt, num_microbatches=args.microbatches).minimize(net.loss)
    plan = staticpipe.plan_of(net.main)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    batch = net.random_batch(args.batch)
    if pure:
        batch = {k: convert_float_to_uint16(v) if v.dtype.kind == "f" else v for k, v in batch.items()}
    micro = args.batch // args.microbatches
    first_cut = [r for r in plan.routes if r.src.stage == 0 and r.src.kind == "forward"][0]
    message = sum(int(_prod(v.shape_for(micro))) * _itemsize(v.dtype) for v in first_cut.vars)
    exe.run(net.main, feed=batch)  # warm-up: prepared programs, held-byte measurement
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        exe.run(net.main, feed=batch)
        times.append(time.perf_counter() - start)
    stats = exe.memory_stats()
    exe.close()
    return {"times": times, "kept": {s: m["peak_activation_bytes"] for s, m in stats.items()}, "message": message,
            "copies": sum(m["step_value_bytes"] for m in stats.values())}


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _itemsize(dtype: str) -> int:
    import numpy as np
    return np.dtype(dtype).itemsize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.precision:  # one configuration, in this process
        print(json.dumps(run_one(args)))
        return
    results: dict[str, dict] = {}
    precisions = PRECISIONS if args.model == "mlp" else PRECISIONS[:-1]
    from staticpipe.capabilities import cpu_bf16, describe, wrong_bf16_allowed

    print(describe())
    support = cpu_bf16()
    if not (support.right or support.ok and wrong_bf16_allowed()):  # minimize would refuse the bf16 rows
        precisions = tuple(p for p in precisions if not p.startswith("bf16"))
        why = f"Paddle computes bfloat16 wrong on it ({support.wrong})" if support.ok else f"it cannot ({support.reason})"
        print(f"bf16 rows skipped: this CPU does not train bfloat16 here: {why}; STATICPIPE_ALLOW_WRONG_BF16=1 times "
              "them anyway")
    for _ in range(args.rounds):
        for precision in precisions:
            cmd = [sys.executable, __file__, "--model", args.model, "--stages", str(args.stages), "--microbatches",
                   str(args.microbatches), "--batch", str(args.batch), "--steps", str(args.steps),
                   "--precision", precision]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            entry = results.setdefault(precision, {"times": [], "kept": got["kept"], "message": got["message"],
                                                   "copies": got["copies"]})
            entry["times"] += got["times"]
    print(f"{args.model}, {args.stages} stages, {args.microbatches} micro-batches of {args.batch // args.microbatches}, "
          f"1F1B, {args.rounds} rounds x {args.steps} steps, precisions alternating")
    stages = sorted(results["fp32"]["kept"], key=int)
    print(f"{'precision':<10} {'s/step':>8} {'vs fp32':>8} {'message KiB':>12} "
          + " ".join(f"{'kept MiB s' + str(s):>13}" for s in stages) + f" {'param copies MiB':>17}")
    base = statistics.median(results["fp32"]["times"])
    for precision in precisions:
        r = results[precision]
        step = statistics.median(r["times"])
        kept = " ".join(f"{r['kept'][s] / 2**20:13.2f}" for s in stages)
        print(f"{precision:<10} {step:8.3f} {step / base:7.2f}x {r['message'] / 1024:12.1f} {kept} "
              f"{r['copies'] / 2**20:17.2f}")


if __name__ == "__main__":
    main()
