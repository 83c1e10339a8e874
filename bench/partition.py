"""Automatic partitioning, measured: how balanced each policy's stages really are, and what it buys.

For each model and stage count, the unguarded model is profiled once at the micro-batch size with one
intra-op thread (what a stage worker has), then placed by every policy and trained as a 1F1B pipeline
(one thread per stage). Per policy:
- predicted: slowest stage / mean stage from the profile (what the policy optimised);
- measured: slowest / mean of the stages' busy time (F, B and OPT actions) in a traced step;
- the step time and throughput, beside the step time the simulator predicts from the profile.
Policies run in interleaved rounds (one step of each per round, the median round reported), so that the
machine's drifts in speed hit all of them alike. "memory" is capped at 80 % of the "time" placement's
largest stage memory, so it has to trade some balance for memory.

    python bench/partition.py [--model resnet|gpt|all] [--stages 2 4] [--steps 3]

ResNet-50: width 16, 32x32 images, global batch 64 in 8 micro-batches of 8.
GPT: 8 blocks, d_model 128, 4 heads, 64 tokens, vocab 512, global batch 32 in 8 micro-batches of 4.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from models import build_gpt, build_resnet  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)
from paddle.base import core  # noqa: E402

MICROBATCHES = 8
MODELS = {  # name -> (unguarded builder, global batch)
    "resnet": (lambda: build_resnet(50, num_stages=1, guarded=False, width=16, image_size=32), 64),
    "gpt": (lambda: build_gpt(num_stages=1, guarded=False, vocab=512, seq_len=64, d_model=128, n_heads=4,
                              n_layers=8), 32),
}
POLICIES = ("uniform", "params", "time", "memory")


def prepare(model: str, num_stages: int, policy: str, profile, memory_limit: float | None):
    """An executor, the placed network and a batch, after one warm-up step."""
    build, batch_size = MODELS[model]
    net = build()
    placement = staticpipe.auto_place(net.main, num_stages, policy=policy, profile=profile,
                                      memory_limit=memory_limit, num_microbatches=MICROBATCHES)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9),
                                     num_microbatches=MICROBATCHES).minimize(net.loss)
    exe = staticpipe.Executor(trace=True)
    exe.run(net.startup)
    batch = net.random_batch(batch_size)
    exe.run(net.main, feed=batch)
    return exe, net, batch, placement


def measure(model: str, num_stages: int, steps: int) -> dict[str, dict]:
    build, batch_size = MODELS[model]
    net = build()
    core.set_num_threads(1)
    profile = staticpipe.profile(net.main, net.random_batch(batch_size // MICROBATCHES), startup=net.startup)
    peak = max(s.memory_bytes for s in staticpipe.auto_place(
        build().main, num_stages, profile=profile, num_microbatches=MICROBATCHES).stages)
    prepared, results = {}, {}
    for policy in POLICIES:
        try:
            prepared[policy] = prepare(model, num_stages, policy, profile, 0.8 * peak if policy == "memory" else None)
        except ValueError as err:
            results[policy] = {"refused": str(err)}
    runs: dict[str, list[tuple[float, float]]] = {policy: [] for policy in prepared}
    for _ in range(steps):
        for policy, (exe, net, batch, _) in prepared.items():
            start = time.perf_counter()
            exe.run(net.main, feed=batch)
            wall = time.perf_counter() - start
            busy = list(exe.timeline(net.main).busy().values())
            runs[policy].append((wall, max(busy) / statistics.mean(busy)))
    for policy, (exe, _, _, placement) in prepared.items():
        exe.close()
        wall = statistics.median(w for w, _ in runs[policy])
        results[policy] = {"predicted": placement.imbalance(),
                           "measured": statistics.median(r for _, r in runs[policy]),
                           "step": wall, "samples/s": batch_size / wall,
                           "predicted step": placement.predicted_step_time(),
                           "bounds": placement.bounds, "layers": len(placement.layers)}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all", choices=["resnet", "gpt", "all"])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    for model in (["resnet", "gpt"] if args.model == "all" else [args.model]):
        for num_stages in args.stages:
            results = measure(model, num_stages, args.steps)
            print(f"\n{model}, {num_stages} stages, 1F1B, {MICROBATCHES} micro-batches: median of {args.steps} rounds")
            print(f"{'policy':<8} {'predicted max/mean':>18} {'measured max/mean':>18} {'s/step':>8} "
                  f"{'predicted s/step':>16} {'samples/s':>10}  layer bounds")
            for policy in POLICIES:
                r = results[policy]
                if "refused" in r:
                    print(f"{policy:<8} refused: {r['refused']}")
                    continue
                print(f"{policy:<8} {r['predicted']:18.3f} {r['measured']:18.3f} {r['step']:8.3f} "
                      f"{r['predicted step']:16.3f} {r['samples/s']:10.1f}  {r['bounds']} of {r['layers']}")
    print("\ntarget: 'time' measured max/mean <= 1.10")


if __name__ == "__main__":
    main()
