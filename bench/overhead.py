"""What staticpipe adds on top of Paddle per step and per action, on a model too small to hide it.

A tiny MLP (width 64, batch 64 by default) makes the ops themselves cost almost nothing, so the time
measured is the machinery: splitting batches, handing actions to stage workers, scopes, messages,
fetches. Side by side in one run, each configuration's median step:

- plain ``paddle.static.Executor.run`` of the unsplit program (the reference);
- staticpipe with p=1 stage and m=1 micro-batch (same work as the reference plus our step machinery);
- staticpipe p=2/m=8, p=4/m=16 and p=4/m=256 (1F1B; the batch grows to one row per micro-batch where
  m exceeds it), where most of the cost is per action: with the default ``worker_threads="auto"``
  (the first steps try each thread layout and keep the best: "threads" tells the one kept), on a
  thread per stage ("per stage": ``worker_threads=None``) and on one thread ("1 thread":
  ``worker_threads=1``, the stages take turns where one would wait: no hand-off between threads at
  all, and no overlap either).

The floor runs the very programs staticpipe's workers run (the plan's compute runs, through the same
prepared-context executor, one micro-batch scope at a time) back to back on one thread with no
machinery at all: "µs/action" = (staticpipe step - floor step) / the step's F, B, W and OPT actions is
what the machinery adds per action (target: <= 30 µs), on the wall clock and in CPU time
(all threads: work that a second core hides on the wall clock still counts there). "p=1 m=1 over
plain" targets <= 1.03.

    python bench/overhead.py [--rounds 200] [--width 64] [--batch 64] [--depth 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from staticpipe.capabilities import cpu_model  # noqa: E402
from staticpipe.plan import BACKWARD, FORWARD, OPTIMIZE  # noqa: E402
from staticpipe.schedule import Kind  # noqa: E402
from models import build_mlp  # noqa: E402

import numpy as np  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)
from paddle.base import core  # noqa: E402

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


class Config(NamedTuple):
    step: Callable[[], None]
    actions: int  # F, B, W and OPT actions of a step (0: not a pipeline)
    threads: Callable[[], int] = lambda: 1  # the threads its steps run on now


def plain(args, batch) -> Config:
    net = build(args, None, 1)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(net.startup, scope=scope)
    return Config(lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss], scope=scope), 0)


def actions_of(plan) -> int:
    return sum(1 for acts in plan.actions.values() for a in acts if a.kind in COMPUTE)


def pipelined(args, batch, stages: int, microbatches: int, threads: int | str | None = "auto"
              ) -> Config:
    net = build(args, stages, microbatches)
    exe = staticpipe.Executor(worker_threads=threads)
    exe.run(net.startup)
    return Config(lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss]),
                  actions_of(staticpipe.plan_of(net.main)), lambda: len(exe.lanes(net.main)))


def floor(args, batch, stages: int, microbatches: int) -> Config:
    """The plan's compute runs with nothing around them: one thread, one root scope holding every stage's
    state, a child scope per micro-batch (cut variables need no message: they are already there), the
    loss fetched from the last forward."""
    net = build(args, stages, microbatches)
    plan = staticpipe.plan_of(net.main)
    place = core.CPUPlace()
    exe, root = core.Executor(staticpipe.placement.generic_place(place)), core.Scope()
    paddle.static.Executor(place).run(net.startup, scope=root)
    for stage in plan.stages:
        exe.run_prepared_ctx(exe.prepare(stage.sections["init"].run.program.desc, 0, [], False), root, False, True, True)
    last = plan.stages[-1].index
    cut = [v.name for r in plan.routes for v in r.vars]

    def ctx(run, extra=()):
        return exe.prepare(run.program.desc, 0, list(run.keep) + list(extra) + cut, False)

    fwd = [(st.index, ctx(st.sections[FORWARD].run, [net.loss.name] if st.index == last else [])) for st in plan.stages]
    bwd = [ctx(st.sections[BACKWARD].run) for st in reversed(plan.stages)]
    opt = [ctx(run) for st in plan.stages for run in st.sections[OPTIMIZE].runs if run.program is not None]
    rows = len(next(iter(batch.values()))) // microbatches
    micro = [{n: v[k * rows:(k + 1) * rows] for n, v in batch.items()} for k in range(microbatches)]
    scopes = [root.new_scope() for _ in range(microbatches)]

    def step() -> None:
        losses = []
        for mb, scope in zip(micro, scopes):
            for name, value in mb.items():
                scope.var(name).get_tensor().set(value, place)
            for s, c in fwd:
                exe.run_prepared_ctx(c, scope, False, True, True)
            losses.append(np.array(scope.find_var(net.loss.name).get_tensor()))
            for c in bwd:
                exe.run_prepared_ctx(c, scope, False, True, True)
        for c in opt:
            exe.run_prepared_ctx(c, root, False, True, True)
        np.mean(losses)
    return Config(step, actions_of(plan))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds (one step of every configuration each)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()
    paddle.enable_static()
    unguarded = build_mlp(num_stages=1, guarded=False, in_dim=args.width, hidden=args.width, depth=args.depth)
    batch = unguarded.random_batch(args.batch)
    shapes = ((1, 1), (2, 8), (4, 16), (4, 256))
    configs = {"plain paddle Executor.run": plain(args, batch)}
    for p, m in shapes:
        rows = unguarded.random_batch(max(args.batch, m))  # at least one row per micro-batch
        configs[f"floor p={p} m={m}"] = floor(args, rows, p, m)
        configs[f"staticpipe p={p} m={m}"] = pipelined(args, rows, p, m)
        if p > 1:
            configs[f"per stage p={p} m={m}"] = pipelined(args, rows, p, m, threads=None)
            configs[f"1 thread p={p} m={m}"] = pipelined(args, rows, p, m, threads=1)
    wall: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    for step, *_ in configs.values():
        for _ in range(14):  # warm-up: prepared programs, scopes, allocator; the "auto" trial (7 steps at most)
            step()
    # interleaved rounds: a slow spell of the machine hits every configuration alike
    for _ in range(args.rounds):
        for name, (step, *_) in configs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    med = {name: statistics.median(t) for name, t in wall.items()}
    med_cpu = {name: statistics.mean(t) for name, t in cpu.items()}  # process_time ticks coarsely: mean
    plain_s = med["plain paddle Executor.run"]
    print(f"{cpu_model()}; MLP {args.depth} x {args.width}, batch {args.batch}, SGD, 1F1B, {os.cpu_count()} CPU cores, "
          f"{args.rounds} interleaved rounds (wall: median, CPU: mean)")
    print(f"{'configuration':<26} {'threads':>7} {'ms/step':>8} {'CPU ms':>7} {'over plain':>10} {'actions':>7} "
          f"{'µs/action wall':>14} {'µs/action CPU':>13}")
    for name, (_, actions, threads) in configs.items():
        added = cpu_added = "-"
        if not name.startswith(("plain", "floor")):
            base = "floor " + name[name.index("p="):]
            added = f"{(med[name] - med[base]) / actions * 1e6:.1f}"
            cpu_added = f"{(med_cpu[name] - med_cpu[base]) / actions * 1e6:.1f}"
        print(f"{name:<26} {threads():>7} {med[name] * 1e3:8.3f} {med_cpu[name] * 1e3:7.3f} {med[name] / plain_s:9.2f}x "
              f"{actions or '-':>7} {added:>14} {cpu_added:>13}")
    print("targets: <= 30 µs added per action (staticpipe over its floor); staticpipe p=1 m=1 within 1.03x of plain;"
          " 'staticpipe': the default worker_threads='auto' ('threads': the layout it kept), 'per stage': "
          "worker_threads=None, '1 thread': worker_threads=1")


if __name__ == "__main__":
    main()
