"""Heterogeneous placement: a DLRM-style click model with its embedding tables on a "cpu" stage and the
MLPs on "gpu:0" and "gpu:1". Without CUDA the gpu stages are CPU devices and the example still runs.

    python examples/train_dlrm.py [--stages 3] [--steps 30] [--sparse]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from models import build_dlrm  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--sparse", action="store_true", help="sparse (SelectedRows) embedding gradients")
    args = ap.parse_args()

    net = build_dlrm(num_stages=args.stages, vocab_size=args.vocab, embed_dim=16, is_sparse=args.sparse)
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.05), num_microbatches=args.microbatches)
        opt.minimize(net.loss)
    print(opt.plan)
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=8, iterable=True)
    # a loader batch is one micro-batch (Paddle's pipeline convention): --batch is the global batch
    loader.set_sample_generator(net.sample_reader(args.batch * args.steps), batch_size=args.batch // args.microbatches)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    history = exe.train_from_dataset(net.main, loader, fetch_list=[net.loss], print_period=10)
    print(f"devices {opt.plan.devices}; loss {float(history[0][0]):.4f} -> {float(history[-1][0]):.4f}")
    exe.close()


if __name__ == "__main__":
    main()
