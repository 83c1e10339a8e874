"""A GPT-style language model over 3 pipeline stages, checked against single-device training first.

Tied input/output embeddings (a parameter shared by the first and last stage), AdamW with linear
warm-up into cosine decay, global-norm clipping across all stages, 1F1B with 4 micro-batches.
`staticpipe.verify` trains the pipeline and its single-device twin for a few steps and reports the
drift before the real run starts. ``--amp fp16`` wraps the optimizer in Paddle's static AMP with dynamic
loss scaling (on a CPU Paddle casts nothing to fp16: the loss scaling runs, in float32), ``--amp bf16``
in ``decorate_bf16`` (bfloat16 kernels on CPU too).

    python examples/train_gpt.py [--stages 3] [--steps 20] [--recompute] [--amp fp16|bf16]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from models import build_gpt  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--amp", choices=["fp16", "bf16"], help="mixed precision (default: float32)")
    args = ap.parse_args()
    if args.amp:  # staticpipe pipelines AMP programs in the legacy IR: on Paddle 3 this run opts in (README "PIR programs")
        staticpipe.use_legacy_ir()
    net = build_gpt(num_stages=args.stages, n_layers=max(4, args.stages))
    lr = paddle.optimizer.lr
    schedule = lr.LinearWarmup(lr.CosineAnnealingDecay(3e-3, T_max=args.steps), 5, 0.0, 3e-3)
    inner = paddle.optimizer.AdamW(schedule, weight_decay=0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    if args.amp == "fp16":
        inner = paddle.static.amp.decorate(inner, init_loss_scaling=2.0 ** 15, use_dynamic_loss_scaling=True)
    elif args.amp == "bf16":
        inner = paddle.static.amp.bf16.decorate_bf16(inner)
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(inner, num_microbatches=args.microbatches, recompute=args.recompute)
        opt.minimize(net.loss)
    print(opt.plan)

    def loader(steps: int):
        """Micro-batches, as Paddle's pipeline takes a loader's batches: --batch is the global batch."""
        ld = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=8, iterable=True)
        return ld.set_sample_generator(net.sample_reader(args.batch * steps), batch_size=args.batch // args.microbatches)

    # bf16 rounds each micro-batch's sums (a bf16 matmul rounds once per batch it is given) where one
    # device rounds the whole batch's: they differ by bf16's 2^-8, not by float32 rounding
    tolerance = dict(rtol=2 ** -6, atol=2 ** -8) if args.amp == "bf16" else {}
    print(staticpipe.verify(net.main, loader(3), net.startup, steps=3, **tolerance))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    history = exe.train_from_dataset(net.main, loader(args.steps), fetch_list=[net.loss], print_period=5,
                                     lr_step="step")
    print(f"loss {float(history[0][0]):.4f} -> {float(history[-1][0]):.4f}; "
          f"activation memory per stage: {exe.memory_stats()}")
    exe.close()


if __name__ == "__main__":
    main()
