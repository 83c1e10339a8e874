"""Every schedule on the same models, measured side by side: step time, bubble, activations held, and
runtime overhead.

For each schedule the runtime traces one step's actions; the simulator then replays the schedule with
each action costing exactly what it cost in that run. That replay is the schedule's own lower bound,
so bound / measured (the "efficiency") says how much the runtime adds: 1.00 = nothing. The bubble is
the Timeline's 1 - busy / (ranks x step), beside the simulator's for the same action times ("sim");
"busy max/mean" is the busiest rank's compute time over the mean: the stage imbalance, whose idle time
no schedule removes. "peak in flight" is, per stage, the most micro-batches the runtime held between
a forward and its last backward action (``Executor.memory_stats()``) / the simulator's count for the
schedule (``Simulation.peak_inflight``): the two must agree.

"ZB-H1 costed" is ZB-H1 planned with the per-stage F, B and W times measured in a traced ZB-H1 step
(``Timeline.stage_costs()`` -> ``PipelineOptimizer(schedule_costs=...)``); the bench prints those
times and what the simulator says each plan is worth under them.

    python bench/schedules.py [--model mlp|resnet|mlp-balanced|resnet-balanced|all] [--steps 3]
    python bench/schedules.py --plans      # no models: every family's plans on a grid of costs beside the
                                           # bound no order beats, and generation at p=64, m=512 (plan_grid.py)

mlp: 8 x 2048, global batch 2048, 8 micro-batches of 256, 2 devices (one thread each), layers split
     evenly by the model's guards. Stage 1 does 12 GEMMs per micro-batch against stage 0's 11 (the first
     layer needs no input gradient).
resnet: ResNet-50 (width 16, 32x32 images), global batch 64, 8 micro-batches, blocks split evenly by
     the model's guards (stage 0 is much heavier).
mlp-balanced: the mlp with 3072 input features, placed by ``auto_place(policy="time")`` from a profile
     at the micro-batch size: the first layer's F and W (1.5 GEMMs each, and no input gradient) then
     weigh as much as another layer's F, B and W, so whole layers can balance exactly: 12 GEMMs a side.
resnet-balanced: the resnet placed by ``auto_place(policy="time")``.
Interleaved, ZB-V, V-Min, V-Half and DualPipeV run the same layers as 4 chunks (gpu:0, gpu:1, gpu:0,
gpu:1 / gpu:0, gpu:1, gpu:1, gpu:0).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/plan_grid.py

import staticpipe  # noqa: E402
from staticpipe.capabilities import describe  # noqa: E402
from models import Network, build_mlp, build_resnet  # noqa: E402
import paddle  # noqa: E402  (after staticpipe, which settles Paddle's IR flag)
from paddle.base import core  # noqa: E402
from staticpipe.schedule import format_schedule, make_schedule, simulate  # noqa: E402
from staticpipe.schedule.simulate import stage_cost_function  # noqa: E402

MICROBATCHES = 8
TWO, ALTERNATE, V = ["gpu:0", "gpu:1"], ["gpu:0", "gpu:1", "gpu:0", "gpu:1"], ["gpu:0", "gpu:1", "gpu:1", "gpu:0"]
ROWS = {  # row -> (schedule, device of each stage)
    "F-then-B": ("F-then-B", TWO),
    "1F1B": ("1F1B", TWO),
    "interleaved": ("interleaved", ALTERNATE),
    "ZB-H1": ("ZB-H1", TWO),
    "ZB-H1 costed": ("ZB-H1", TWO),
    "ZB-V": ("ZB-V", V),
    "V-Min": ("V-Min", V),
    "V-Half": ("V-Half", V),
    "ZB-2P": ("ZB-2P", TWO),
    "Eager1F1B": ("Eager1F1B", TWO),
    "DualPipeV": ("DualPipeV", V),
}
COSTED = "ZB-H1 costed"


@dataclass(frozen=True)
class Config:
    build: Callable[[list[str] | None], Network]  # stage devices -> guarded network; None -> unguarded
    batch_size: int
    balanced: bool  # placed by measured time (auto_place) instead of the model's own guards


def _mlp(in_dim: int) -> Callable[[list[str] | None], Network]:
    return lambda devices: build_mlp(num_stages=len(devices or [0]), guarded=devices is not None, in_dim=in_dim,
                                     hidden=2048, depth=8, stage_devices=devices)


def _resnet(devices: list[str] | None) -> Network:
    return build_resnet(depth=50, num_stages=len(devices or [0]), guarded=devices is not None, width=16,
                        image_size=32, stage_devices=devices)


CONFIGS = {
    "mlp": Config(_mlp(2048), 2048, balanced=False),
    "resnet": Config(_resnet, 64, balanced=False),
    "mlp-balanced": Config(_mlp(3072), 2048, balanced=True),
    "resnet-balanced": Config(_resnet, 64, balanced=True),
}


def profile_of(config: Config):
    """The per-layer profile a balanced config is placed by: one micro-batch, one intra-op thread (what
    a stage worker has); None for configs placed by their guards."""
    if not config.balanced:
        return None
    net = config.build(None)
    core.set_num_threads(1)
    profile = staticpipe.profile(net.main, net.random_batch(config.batch_size // MICROBATCHES), startup=net.startup)
    placement = place(net, TWO, "1F1B", profile)
    print(f"placed by time on 2 devices: layers {placement.bounds} of {len(placement.layers)}, profiled "
          f"slowest / mean stage {placement.imbalance():.3f}")
    return profile


def place(net: Network, devices: list[str], schedule: str, profile):
    return staticpipe.auto_place(net.main, devices=devices, policy="time", profile=profile, schedule=schedule,
                                 num_microbatches=MICROBATCHES)


def prepare(config: Config, row: str, profile, costs: dict | None = None):
    """A traced executor ready to run one step of ``config`` as ``row``, after one warm-up step."""
    schedule, devices = ROWS[row]
    net = config.build(devices if profile is None else None)
    if profile is not None:
        place(net, devices, schedule, profile)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9), num_microbatches=MICROBATCHES,
                                     schedule=schedule, schedule_costs=costs).minimize(net.loss)
    exe = staticpipe.Executor(trace=True)
    exe.run(net.startup)
    batch = net.random_batch(config.batch_size)
    exe.run(net.main, feed=batch)  # warm-up
    return exe, net, batch


def measured_costs(prepared: tuple) -> dict[str, list[float]]:
    """Per-stage mean F, B, W seconds of one more traced ZB-H1 step (after its warm-up)."""
    exe, net, batch = prepared
    exe.run(net.main, feed=batch)
    return exe.timeline(net.main).stage_costs()


def report_costs(costs: dict[str, list[float]]) -> None:
    """The measured times; what each ZB-H1 plan is worth under them (the simulator's step); and the
    bubble ratio a runtime adding nothing would show: ZB-H1 against 1F1B running B and W as one backward."""
    ms = "; ".join(f"{k} " + " / ".join(f"{t * 1e3:.1f}" for t in v) for k, v in costs.items())
    print(f"ZB-H1 costs measured (ms, stage 0 / stage 1): {ms}")
    price = stage_cost_function(costs, len(TWO))
    unit_plan = make_schedule("ZB-H1", len(TWO), MICROBATCHES)
    planned = make_schedule("ZB-H1", len(TWO), MICROBATCHES, costs=costs)
    unit = simulate(unit_plan, price)
    same = "the same order as" if planned == unit_plan else "a different order from"
    print(f"costed plan ({same} the unit-cost one): simulated {simulate(planned, price).total:.3f} s/step, "
          f"unit-cost plan {unit.total:.3f} s/step")
    whole = stage_cost_function({"F": costs["F"], "B": [b + w for b, w in zip(costs["B"], costs["W"])]}, len(TWO))
    one = simulate(make_schedule("1F1B", len(TWO), MICROBATCHES), whole)
    print(f"simulated bubble under these costs: ZB-H1 {unit.bubble:.3f}, 1F1B {one.bubble:.3f}, "
          f"ratio {unit.bubble / one.bubble:.2f}")
    if planned != unit_plan:
        print(format_schedule(planned))


def measure(model: str, steps: int) -> dict[str, dict]:
    """Interleaved rounds (one step of every schedule each), so that the machine's drifts in speed hit
    all schedules alike; the median round of each is reported."""
    config = CONFIGS[model]
    profile = profile_of(config)
    prepared = {row: prepare(config, row, profile) for row in ROWS if row != COSTED}
    costs = measured_costs(prepared["ZB-H1"])
    report_costs(costs)
    prepared[COSTED] = prepare(config, COSTED, profile, costs)
    runs: dict[str, list[tuple]] = {row: [] for row in ROWS}
    for _ in range(steps):
        for row in ROWS:
            exe, net, batch = prepared[row]
            start = time.perf_counter()
            exe.run(net.main, feed=batch)
            wall = time.perf_counter() - start
            timeline = exe.timeline(net.main)
            busy = list(timeline.busy().values())
            predicted = timeline.predicted()
            runs[row].append((wall, timeline.bubble(), predicted.bubble, predicted.total / timeline.total,
                              max(busy) / statistics.mean(busy)))
    results = {}
    for row in ROWS:
        exe, net, _ = prepared[row]
        measured = {s: m["peak_inflight_microbatches"] for s, m in sorted(exe.memory_stats().items())}
        simulated = simulate(staticpipe.plan_of(net.main).actions).peak_inflight
        exe.close()
        wall, bubble, sim_bubble, efficiency, imbalance = (statistics.median(x) for x in zip(*runs[row]))
        results[row] = {"step": wall, "bubble": bubble, "sim bubble": sim_bubble, "efficiency": efficiency,
                        "imbalance": imbalance, "samples/s": config.batch_size / wall,
                        "peak": " ".join(f"{measured.get(s, 0)}/{n}" for s, n in simulated.items())}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all", choices=[*CONFIGS, "all"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plans", action="store_true", help="only the plans on the grid of costs, beside the bound")
    args = ap.parse_args()
    print(describe())
    if args.plans:
        import plan_grid
        plan_grid.main()
        return
    for model in (list(CONFIGS) if args.model == "all" else [args.model]):
        print(f"\n{model}: median of {args.steps} interleaved rounds")
        results = measure(model, args.steps)
        base = results["1F1B"]
        print(f"{'schedule':<13} {'s/step':>8} {'samples/s':>10} {'vs 1F1B':>8} {'bubble':>7} {'sim':>6} "
              f"{'bubble vs 1F1B':>15} {'bound/measured':>15} {'busy max/mean':>14}  peak in flight per stage "
              "(measured/simulated)")
        for name, r in results.items():
            print(f"{name:<13} {r['step']:8.3f} {r['samples/s']:10.1f} {base['step'] / r['step']:7.2f}x "
                  f"{r['bubble']:7.3f} {r['sim bubble']:6.3f} {r['bubble'] / base['bubble']:14.2f}x "
                  f"{r['efficiency']:15.3f} {r['imbalance']:14.3f}  {r['peak']}")
        print("targets: bound/measured >= 0.95 for every schedule; ZB-H1 bubble <= 0.4 x 1F1B's")


if __name__ == "__main__":
    main()
