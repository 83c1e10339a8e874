"""ZeRO stage 1: optimizer bytes per rank and step time, sharded beside unsharded, in one run.

A GPT (tied embeddings, AdamW, global-norm clip) on 2 stages x 4 replicas (8 gloo processes, launched
by ``staticpipe.launch``) trains ``--steps`` steps at ``sharding_degree`` 1, 2 and 4. Each rank reports
the optimizer state it holds (bytes of the state it has after training, parameters excluded), the plan's
prediction for it, and its median step time; the table gives each degree's largest rank against
degree 1's. With 8 processes on a 2-core machine the step times measure the extra broadcasts under
heavy contention, not what a cluster would see: read the ratio, not the seconds.

    python bench/sharding.py [--steps 6] [--d-model 128] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

REPLICAS, MICRO, BATCH = 4, 4, 64


def worker(out: str, shards: int, steps: int, d_model: int, layers: int) -> None:
    import numpy as np
    import staticpipe
    from models import build_gpt
    from staticpipe._paddle import paddle

    rank = int(os.environ["PADDLE_TRAINER_ID"])
    net = build_gpt(num_stages=2, vocab=2048, seq_len=32, d_model=d_model, n_heads=4, n_layers=layers, seed=1)
    with paddle.static.program_guard(net.main, net.startup):
        opt = paddle.optimizer.AdamW(1e-3, weight_decay=0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
        staticpipe.PipelineOptimizer(opt, num_microbatches=MICRO, dp_degree=REPLICAS,
                                     sharding_degree=shards).minimize(net.loss)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    times = []
    for step in range(steps + 1):  # the first step builds the runs: not timed
        batch = net.random_batch(BATCH, seed=step)
        start = time.perf_counter()
        exe.run(net.main, feed=batch)
        times.append(time.perf_counter() - start)
    plan = staticpipe.plan_of(net.main)
    stages = plan.stages_of_process((rank, int(os.environ["PADDLE_TRAINERS_NUM"])))
    state = exe.state_dict(net.main)
    held = sum(v.nbytes for n, v in state.items() if any(n in s.persistables and n not in s.parameters
                                                           for s in stages))
    shard = plan.shard_of_process((rank, int(os.environ["PADDLE_TRAINERS_NUM"])))
    predicted = sum(plan.memory.stages[s.index].held_state_bytes(shard) for s in stages)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"held": held, "predicted": predicted, "step": statistics.median(times[1:]),
                   "params": int(sum(np.prod(v.shape) for n, v in state.items()
                                     if any(n in s.parameters for s in stages)))}, f)
    exe.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shards", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.shards, args.steps, args.d_model, args.layers)
    from staticpipe.capabilities import cpu_model
    print(f"bench/sharding.py on {cpu_model()}, {os.cpu_count()} cores: GPT d_model {args.d_model} x {args.layers} layers, 2 stages x "
          f"{REPLICAS} replicas (8 processes), AdamW, {args.steps} steps")
    rows = {}
    for shards in (1, 2, 4):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "staticpipe.launch", "--nprocs", str(2 * REPLICAS), os.path.abspath(__file__),
                   "--worker", out, "--shards", str(shards), "--steps", str(args.steps), "--d-model",
                   str(args.d_model), "--layers", str(args.layers)]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"sharding_degree {shards} failed:\n{done.stderr[-3000:]}")
            rows[shards] = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2 * REPLICAS)]
    base = rows[1]
    print(f"{'sharding':>8} | {'optimizer bytes, largest rank':>30} | {'x degree 1':>10} | {'predicted = held':>16} |"
          f" {'median step (s)':>15} | {'x degree 1':>10}")
    for shards, ranks in rows.items():
        held = max(r["held"] for r in ranks)
        step = statistics.median(r["step"] for r in ranks)
        exact = all(r["held"] == r["predicted"] for r in ranks)
        print(f"{shards:>8} | {held:>30,} | {held / max(r['held'] for r in base):>10.2f} | {str(exact):>16} |"
              f" {step:>15.3f} | {step / statistics.median(r['step'] for r in base):>10.2f}")


if __name__ == "__main__":
    main()
