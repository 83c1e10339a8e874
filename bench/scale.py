"""How plan building, scheduling, planning and running grow with the work, side by side in one run.

Tables, each row a size, each column seconds, and between consecutive rows the growth exponent
``log(t2 / t1) / log(n2 / n1)`` against the work measure (1: linear, 2: quadratic):

1. ``minimize`` of models' GPT (AdamW, global-norm clip, 1F1B) as layers, stages and micro-batches grow
   together: Paddle's own part (its backward and optimizer ops, inside staticpipe's minimize) and
   staticpipe's (stage assignment, sections, plan, schedule, memory model) apart, beside Paddle's minimize
   of the same program alone (what a single-device script pays); work = the differentiated program's ops.
   Then every schedule at the largest size (its stages laid out by ``auto_place``, V and interleaved
   layouts included).
2. every schedule's generation, validation and simulation (``python -m staticpipe.schedule``'s work)
   at p = 16, 32, 64 ranks with m = 8 p micro-batches, and p = 64 with m = 1024; work = the schedule's
   compute actions.
3. ``auto_place`` (time policy) and ``auto_plan`` (every schedule, recompute priced) of the GPT from one
   op profile, on 16 and 64 devices; work = devices.
4. the runtime: a step of a small MLP over 4 stages as the micro-batches grow (16, 64, 256), beside its
   floor (the same compute programs run back to back, ``bench/overhead.py``); work = actions, and the
   machinery's microseconds per action.

    python bench/scale.py [--quick]      # --quick: the smaller sizes only
    python bench/scale.py --large        # and table 1 at 384 and 960 layers (41k and 103k ops; minutes)
    python bench/scale.py --table schedules   # one table (minimize, schedules, planning, runtime)
The machine's CPU is printed first (compare ratios, not times, between machines). Each table runs in a
process of its own.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/overhead.py

import staticpipe  # noqa: E402
from staticpipe.capabilities import describe  # noqa: E402
from staticpipe.schedule.registry import KINDS, get_kind, make_schedule  # noqa: E402
from staticpipe.schedule.simulate import simulate  # noqa: E402
from staticpipe.schedule.validate import validate  # noqa: E402
from models import build_gpt, build_mlp  # noqa: E402

import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)


def exponent(rows: list[tuple[float, float]]) -> list[str]:
    """Growth exponent of each row's seconds against its work, from the row before."""
    out = ["-"]
    for (n1, t1), (n2, t2) in zip(rows, rows[1:]):
        out.append(f"{math.log(t2 / t1) / math.log(n2 / n1):.2f}" if t1 > 0 and t2 > 0 and n2 != n1 else "-")
    return out


def adamw():
    return paddle.optimizer.AdamW(1e-3, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))


def timed_minimize(net, schedule: str, m: int) -> tuple[float, float]:
    """(seconds of staticpipe's minimize of ``net``, of them Paddle's own inner minimize)."""
    opt = staticpipe.PipelineOptimizer(adamw(), num_microbatches=m, schedule=schedule)
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
        return time.perf_counter() - start, inner[0]
    finally:
        staticpipe.optimizer._inner_minimize = real


def paddle_alone(layers: int) -> float:
    """Seconds of Paddle's minimize of the same GPT with no pipeline: a single-device script's."""
    net = build_gpt(num_stages=1, guarded=False, n_layers=layers)
    start = time.perf_counter()
    with paddle.static.program_guard(net.main, net.startup):
        adamw().minimize(net.loss)
    return time.perf_counter() - start


def minimize_sizes(quick: bool, large: bool) -> None:
    sizes = [(8, 4, 16), (32, 8, 64), (96, 16, 128)][: 2 if quick else 3]
    sizes += [(384, 64, 256), (960, 64, 256)] if large else []
    print("\nminimize of the GPT (AdamW + global clip, 1F1B): layers / stages / micro-batches; targets: "
          "96 / 16 / 128 <= 5 s, 100k ops over 64 stages <= 60 s")
    print(f"{'layers':>6} {'stages':>6} {'m':>5} {'ops':>7} {'Paddle s':>9} {'staticpipe s':>13} {'total s':>8} "
          f"{'exp (ours)':>10} {'Paddle alone s':>14}")
    rows, lines = [], []
    for layers, stages, m in sizes:
        net = None
        gc.collect()  # the previous size's programs (Paddle's hold cycles): a user's minimize does not carry them
        net = build_gpt(num_stages=stages, n_layers=layers)
        total, theirs = timed_minimize(net, "1F1B", m)
        ops = len(net.main.global_block().ops)
        rows.append((ops, total - theirs))
        # Paddle alone grows quadratically (its per-parameter scans): minutes beyond 96 layers
        lines.append((layers, stages, m, ops, theirs, total - theirs, total,
                      f"{paddle_alone(layers):.2f}" if layers <= 96 else "-"))
    for (layers, stages, m, ops, theirs, ours, total, alone), exp in zip(lines, exponent(rows)):
        print(f"{layers:>6} {stages:>6} {m:>5} {ops:>7} {theirs:>9.2f} {ours:>13.2f} {total:>8.2f} {exp:>10} "
              f"{alone:>14}")
    if not quick:
        minimize_schedules(96, 16, 128)


def minimize_schedules(layers: int, devices: int, m: int) -> None:
    print(f"\nminimize of the GPT, {layers} layers on {devices} devices, m={m}, every schedule (stages laid out by "
          "auto_place, policy params)")
    print(f"{'schedule':<12} {'stages':>6} {'Paddle s':>9} {'staticpipe s':>13} {'total s':>8}")
    for name in sorted(KINDS):
        kind = get_kind(name)
        chunks = kind.chunks or 1
        net = build_gpt(num_stages=1, guarded=False, n_layers=layers)
        staticpipe.auto_place(net.main, devices=[f"gpu:{r}" for r in kind.layout(devices, chunks)], policy="params",
                              schedule=kind.name, num_microbatches=m)
        total, theirs = timed_minimize(net, kind.name, m)
        print(f"{kind.name:<12} {devices * chunks:>6} {theirs:>9.2f} {total - theirs:>13.2f} {total:>8.2f}")


def schedule_sizes(quick: bool) -> None:
    sizes = [(16, 128), (32, 256)] if quick else [(16, 128), (32, 256), (64, 512), (64, 1024)]
    print("\nschedules: generate / validate / simulate (seconds); targets: p=64 m=512 <= 2 s, "
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


def planning_sizes(quick: bool) -> None:
    layers, m = (32, 32) if quick else (96, 128)
    sizes = [4, 8] if quick else [16, 64]
    net = build_gpt(num_stages=1, guarded=False, n_layers=layers)
    start = time.perf_counter()
    profile = staticpipe.profile(net.main, net.random_batch(2), startup=net.startup, loss=net.loss)
    print(f"\nplanning the GPT ({layers} layers, m={m}) from one op profile (taken in {time.perf_counter() - start:.1f} s); "
          "target: 16 and 64 devices <= 60 s")
    print(f"{'devices':>7} {'auto_place s':>12} {'auto_plan s':>11} {'plans priced':>12} {'chosen':<28} {'exp':>5}")
    rows, lines = [], []
    for devices in sizes:
        names = [f"gpu:{k}" for k in range(devices)]
        placed = build_gpt(num_stages=1, guarded=False, n_layers=layers)
        start = time.perf_counter()
        staticpipe.auto_place(placed.main, devices=names, policy="time", profile=profile)
        place_s = time.perf_counter() - start
        planned = build_gpt(num_stages=1, guarded=False, n_layers=layers)
        start = time.perf_counter()
        report = staticpipe.auto_plan(planned.main, planned.loss, adamw, names, m, profile=profile,
                                      startup=planned.startup)
        plan_s = time.perf_counter() - start
        rc = ",".join(map(str, report.chosen.recompute)) or "none"
        rows.append((devices, plan_s))
        lines.append((devices, place_s, plan_s, len(report.candidates), f"{report.chosen.schedule}, recompute {rc}"))
    for (devices, place_s, plan_s, priced, chosen), exp in zip(lines, exponent(rows)):
        print(f"{devices:>7} {place_s:>12.2f} {plan_s:>11.2f} {priced:>12} {chosen:<28} {exp:>5}")


def runtime_sizes(quick: bool) -> None:
    import overhead  # bench/overhead.py: the same step, floor and action count

    args = argparse.Namespace(width=64, depth=4, batch=64)
    sizes = [16, 64] if quick else [16, 64, 256]
    rounds = 5 if quick else 20
    print(f"\nruntime: a step of an MLP {args.depth} x {args.width} over 4 stages (1F1B, one row per micro-batch at "
          f"least), median of {rounds}; target: <= 30 µs/action")
    print(f"{'m':>5} {'actions':>8} {'step s':>8} {'floor s':>8} {'µs/action':>10} {'exp':>5}")
    unguarded = build_mlp(num_stages=1, guarded=False, in_dim=args.width, hidden=args.width, depth=args.depth)
    rows, lines = [], []
    for m in sizes:
        batch = unguarded.random_batch(max(args.batch, m))
        (step, actions, _), (floor, _, _) = overhead.pipelined(args, batch, 4, m), overhead.floor(args, batch, 4, m)
        times = {step: [], floor: []}
        for _ in range(3):
            step(), floor()
        for _ in range(rounds):
            for run in (step, floor):
                start = time.perf_counter()
                run()
                times[run].append(time.perf_counter() - start)
        step_s, floor_s = statistics.median(times[step]), statistics.median(times[floor])
        rows.append((actions, step_s))
        lines.append((m, actions, step_s, floor_s, (step_s - floor_s) / actions * 1e6))
    for (m, actions, step_s, floor_s, per_action), exp in zip(lines, exponent(rows)):
        print(f"{m:>5} {actions:>8} {step_s:>8.4f} {floor_s:>8.4f} {per_action:>10.1f} {exp:>5}")


TABLES = {"minimize": lambda args: minimize_sizes(args.quick, args.large),
          "schedules": lambda args: schedule_sizes(args.quick),
          "planning": lambda args: planning_sizes(args.quick),
          "runtime": lambda args: runtime_sizes(args.quick)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the smaller sizes only")
    ap.add_argument("--large", action="store_true", help="table 1 also at 384 and 960 layers (minutes)")
    ap.add_argument("--table", choices=list(TABLES), help="one table only, in this process")
    args = ap.parse_args()
    if args.table is not None:
        paddle.enable_static()
        TABLES[args.table](args)
        return
    print(describe())
    # each table in a process of its own, as a user's minimize, schedule command or planner runs: none
    # starts with the gigabytes of Paddle objects the minimize table leaves at 960 layers
    for table in TABLES:
        sys.stdout.flush()
        subprocess.run([sys.executable, os.path.abspath(__file__), "--table", table]
                       + ["--quick"] * args.quick + ["--large"] * args.large, check=True)


if __name__ == "__main__":
    main()
