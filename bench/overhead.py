"""What staticpipe adds on top of Paddle per step and per action, on a model too small to hide it.

A tiny MLP (width 64, batch 64 by default) makes the ops themselves cost almost nothing, so the time
measured is the machinery: splitting batches, handing actions to stage workers, scopes, messages,
fetches. Side by side in one run, each configuration's median step:

- plain ``paddle.static.Executor.run`` of the unsplit program (the reference);
- staticpipe with p=1 stage and m=1 micro-batch (same work as the reference plus our step machinery);
- staticpipe p=2/m=8 and p=4/m=16 (1F1B), where most of the cost is per action.

"µs per action" is (staticpipe step - plain step) / number of F, B and OPT actions of the step, the
figure issue #11 targets (<= 30 µs); "p=1 over plain" targets <= 1.03.

    python bench/overhead.py [--rounds 200] [--width 64] [--batch 64] [--depth 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from staticpipe.schedule import Kind  # noqa: E402
from models import build_mlp  # noqa: E402

import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)

COMPUTE = (Kind.F, Kind.B, Kind.W, Kind.OPT)


def build(args, stages: int | None, microbatches: int):
    net = build_mlp(num_stages=stages or 1, guarded=stages is not None, in_dim=args.width, hidden=args.width,
                    depth=args.depth)
    with paddle.static.program_guard(net.main, net.startup):
        opt = paddle.optimizer.SGD(0.01)
        if stages is not None:
            opt = staticpipe.PipelineOptimizer(opt, num_microbatches=microbatches)
        opt.minimize(net.loss)
    return net


def plain(args, batch) -> tuple[Callable[[], None], int]:
    net = build(args, None, 1)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(net.startup, scope=scope)
    return (lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss], scope=scope)), 0


def pipelined(args, batch, stages: int, microbatches: int) -> tuple[Callable[[], None], int]:
    net = build(args, stages, microbatches)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    plan = staticpipe.plan_of(net.main)
    actions = sum(1 for acts in plan.actions.values() for a in acts if a.kind in COMPUTE)
    return (lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss])), actions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds (one step of every configuration each)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()
    paddle.enable_static()
    batch = build_mlp(num_stages=1, guarded=False, in_dim=args.width, hidden=args.width,
                      depth=args.depth).random_batch(args.batch)
    configs = {
        "plain paddle Executor.run": plain(args, batch),
        "staticpipe p=1 m=1": pipelined(args, batch, 1, 1),
        "staticpipe p=2 m=8 (1F1B)": pipelined(args, batch, 2, 8),
        "staticpipe p=4 m=16 (1F1B)": pipelined(args, batch, 4, 16),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for step, _ in configs.values():
        for _ in range(10):  # warm-up: prepared programs, scopes, allocator
            step()
    # interleaved rounds: a slow spell of the machine hits every configuration alike
    for _ in range(args.rounds):
        for name, (step, _) in configs.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med["plain paddle Executor.run"]
    print(f"MLP {args.depth} x {args.width}, batch {args.batch}, SGD, {os.cpu_count()} CPU cores, "
          f"{args.rounds} interleaved rounds (median)")
    print(f"{'configuration':<30} {'ms/step':>9} {'over plain':>11} {'actions':>8} {'µs added/action':>16}")
    for name, (_, actions) in configs.items():
        added = f"{(med[name] - base) / actions * 1e6:16.1f}" if actions else f"{'-':>16}"
        print(f"{name:<30} {med[name] * 1e3:9.3f} {med[name] / base:10.2f}x {actions or '-':>8} {added}")
    print("targets: <= 30 µs added per action; p=1 m=1 within 1.03x of plain")


if __name__ == "__main__":
    main()
