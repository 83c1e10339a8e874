"""How plan building and scheduling grow with the work, side by side in one run, with growth exponents.

Two tables, each row a size, each column seconds, and between consecutive rows the growth exponent
``log(t2 / t1) / log(n2 / n1)`` against the work measure (1: linear, 2: quadratic):

1. ``minimize`` of models' GPT (AdamW, global-norm clip, 1F1B) as layers, stages and micro-batches grow
   together: Paddle's own part (its backward and optimizer ops, the same call a single-device script
   makes) and staticpipe's (stage assignment, sections, plan, schedule, memory model) apart; work = the
   differentiated program's ops.
2. every schedule's generation, validation and simulation (``python -m staticpipe.schedule``'s work)
   at p = 16, 32, 64 ranks with m = 8 p micro-batches, and p = 64 with m = 1024; work = the schedule's
   compute actions.

    python bench/scale.py [--quick]      # --quick: the smaller sizes only
The machine's CPU is printed first (compare ratios, not times, between machines).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from staticpipe.capabilities import describe  # noqa: E402
from staticpipe.schedule.registry import KINDS, get_kind, make_schedule  # noqa: E402
from staticpipe.schedule.simulate import simulate  # noqa: E402
from staticpipe.schedule.validate import validate  # noqa: E402
from models import build_gpt  # noqa: E402

import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)


def exponent(rows: list[tuple[float, float]]) -> list[str]:
    """Growth exponent of each row's seconds against its work, from the row before."""
    out = ["-"]
    for (n1, t1), (n2, t2) in zip(rows, rows[1:]):
        out.append(f"{math.log(t2 / t1) / math.log(n2 / n1):.2f}" if t1 > 0 and t2 > 0 and n2 != n1 else "-")
    return out


def minimize_sizes(quick: bool) -> None:
    sizes = [(8, 4, 16), (32, 8, 64), (96, 16, 128)][: 2 if quick else 3]
    print("\nminimize of the GPT (AdamW + global clip, 1F1B): layers / stages / micro-batches")
    print(f"{'layers':>6} {'stages':>6} {'m':>5} {'ops':>7} {'Paddle s':>9} {'staticpipe s':>13} {'total s':>8} "
          f"{'exp (ours)':>10}")
    rows, lines = [], []
    for layers, stages, m in sizes:
        net = build_gpt(num_stages=stages, n_layers=layers)
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.AdamW(1e-3, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0)),
                                           num_microbatches=m)
        inner = []
        real = staticpipe.optimizer._inner_minimize

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                inner.append(time.perf_counter() - start)
        staticpipe.optimizer._inner_minimize = timed
        try:
            start = time.perf_counter()
            with paddle.static.program_guard(net.main, net.startup):
                opt.minimize(net.loss)
            total = time.perf_counter() - start
        finally:
            staticpipe.optimizer._inner_minimize = real
        ops = len(net.main.global_block().ops)
        rows.append((ops, total - inner[0]))
        lines.append((layers, stages, m, ops, inner[0], total - inner[0], total))
    for (layers, stages, m, ops, theirs, ours, total), exp in zip(lines, exponent(rows)):
        print(f"{layers:>6} {stages:>6} {m:>5} {ops:>7} {theirs:>9.2f} {ours:>13.2f} {total:>8.2f} {exp:>10}")


def schedule_sizes(quick: bool) -> None:
    sizes = [(16, 128), (32, 256)] if quick else [(16, 128), (32, 256), (64, 512), (64, 1024)]
    print("\nschedules: generate / validate / simulate (seconds); issue #28's targets: p=64 m=512 <= 2 s, "
          "m=1024 <= 5 s")
    print(f"{'schedule':<12} {'p':>3} {'m':>5} {'actions':>8} {'generate':>9} {'validate':>9} {'simulate':>9} "
          f"{'total':>7} {'exp':>5}")
    for name in sorted(KINDS):
        kind = get_kind(name)
        chunks = kind.chunks or 1
        rows, lines = [], []
        for p, m in sizes:
            t0 = time.perf_counter()
            schedule = make_schedule(kind.name, p, m, chunks)
            t1 = time.perf_counter()
            validate(schedule, p * chunks, m, kind.layout(p, chunks), kind.split_backward)
            t2 = time.perf_counter()
            simulate(schedule, {k: 1 / chunks for k in "FBW"}, p * chunks)
            t3 = time.perf_counter()
            actions = sum(len(acts) for acts in schedule.values())
            rows.append((actions, t3 - t0))
            lines.append((p, m, actions, t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        for (p, m, actions, gen, val, sim, total), exp in zip(lines, exponent(rows)):
            print(f"{kind.name:<12} {p:>3} {m:>5} {actions:>8} {gen:>9.2f} {val:>9.2f} {sim:>9.2f} {total:>7.2f} "
                  f"{exp:>5}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the smaller sizes only")
    args = ap.parse_args()
    paddle.enable_static()
    print(describe())
    minimize_sizes(args.quick)
    schedule_sizes(args.quick)


if __name__ == "__main__":
    main()
