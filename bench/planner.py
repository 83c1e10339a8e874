"""``staticpipe.auto_plan`` against measurement: does its choice fit, is it the fastest, are its predictions right?

For each model (models' GPT on 4 stages, ResNet-50 on 2 and 4), the planner profiles once, times the plans
it builds (``--steps`` steps each, twice) and prices its search space (the schedules below x its partitions
x recompute of none or every stage, so that every configuration it enumerates can also be measured here),
once unlimited and once under each cap. Then every configuration enumerated, and each capped choice, is
built and trained ``--steps`` steps, one configuration after the other and again in reverse order (the
machine's drift falls on all alike), and measured: step time (median) and per device the bytes held at
the peak
(parameters, optimizer state and gradient buffers as the device's scope holds them after a step, plus the
activation peak the runtime counts, ``Executor.device_memory_stats``). For three memory caps -- (a)
unlimited, (b) between V-Min's and 1F1B's predicted peak, (c) low enough that recompute is needed (below
every plan without recompute, memory-capped cuts included: lowered while one still fits) --
it prints the planner's choice, its predicted and measured peak per device and step time, the fastest
measured configuration that fits, and the targets of issue 19: measured peak <= cap on every device, the
choice within 5 % of the fastest measured that fits, predicted peak and step time within 10 % of measured.

    python bench/planner.py [--model gpt|resnet2|resnet4|all] [--steps 5]

Timings on this machine's CPU devices (every stage a worker thread on 2 cores) are noisy; the memory
figures are exact counts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import staticpipe  # noqa: E402
from staticpipe._paddle import paddle  # noqa: E402
from staticpipe.ir import tensor_bytes  # noqa: E402
from staticpipe.memory_model import human_bytes  # noqa: E402
from models import build_gpt, build_resnet  # noqa: E402

SCHEDULES = ["1F1B", "F-then-B", "ZB-H1", "ZB-V", "V-Min", "V-Half"]
MODELS = {  # name -> (builder of the unguarded network, devices, micro-batches, micro-batch size)
    "gpt": (lambda: build_gpt(num_stages=4, guarded=False, vocab=256, seq_len=32, d_model=64, n_layers=8),
            [f"gpu:{k}" for k in range(4)], 8, 4),
    "resnet2": (lambda: build_resnet(50, num_stages=2, guarded=False, image_size=32, width=16), ["gpu:0", "gpu:1"], 4, 4),
    "resnet4": (lambda: build_resnet(50, num_stages=4, guarded=False, image_size=32, width=16),
                [f"gpu:{k}" for k in range(4)], 8, 2),
}


def momentum():
    return paddle.optimizer.Momentum(0.01, momentum=0.9)


def build_config(build, candidate, profile, m: int, mbs: int, cap):
    """``candidate`` (a ``staticpipe.partition.Candidate``) built: (network, plan)."""
    net = build()
    staticpipe.auto_place(net.main, devices=list(candidate.devices), policy=candidate.policy, profile=profile,
                          schedule=candidate.schedule, num_microbatches=m, memory_limit=cap)
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(momentum(), num_microbatches=m, schedule=candidate.schedule,
                                           recompute=list(candidate.recompute), micro_batch_size=mbs)
        opt.minimize(net.loss)
    return net, opt.plan


def train(net, plan, m: int, mbs: int, steps: int, times: list) -> dict[str, int]:
    """A fresh executor: startup, one untimed step, ``steps`` timed ones (appended to ``times``); the
    bytes each device held at its peak."""
    exe = staticpipe.Executor(paddle.CPUPlace())
    try:
        exe.run(net.startup)
        for k in range(steps + 1):
            batch = net.random_batch(m * mbs, seed=k)
            start = time.perf_counter()
            exe.run(net.main, feed=batch, fetch_list=[net.loss])
            if k:
                times.append(time.perf_counter() - start)
        peaks = exe.device_memory_stats()
        held = {}
        for stage in plan.stages:
            scope = exe.scope_of(stage.device)
            names = set(stage.persistables) | set(stage.step_values) | {g[:-len("@MERGED")] for g in stage.grad_buffers}
            held[stage.device] = held.get(stage.device, 0) + sum(tensor_bytes(scope, n) for n in names)
        return {d: held[d] + peaks[d]["peak_activation_bytes"] for d in held}
    finally:
        exe.close()


def measure_all(build, configs: dict, profile, m: int, mbs: int, steps: int) -> dict:
    """Every configuration trained as a user runs it (one at a time, consecutive steps), in two passes, the
    second in reverse order, so that the machine's drift weighs on all alike: key -> (median step s,
    per-device peak bytes)."""
    built = {k: build_config(build, c, profile, m, mbs, cap) for k, (c, cap) in configs.items()}
    times = {k: [] for k in built}
    peaks = {}
    for order in (list(built), list(reversed(built))):
        for k in order:
            peaks[k] = train(*built[k], m, mbs, steps, times[k])
    return {k: (statistics.median(times[k]), peaks[k]) for k in built}


def key(c) -> tuple:
    return c.schedule, c.policy, c.bounds, c.recompute


def caps_for(report) -> dict[str, float | None]:
    """(b) between V-Min's and 1F1B's predicted peak; (c) a first try below every plan without recompute
    (``run`` lowers it further while a memory-capped cut still fits without recompute)."""
    best = {}
    for c in report.candidates:
        if not c.recompute:
            best[c.schedule] = min(best.get(c.schedule, peak(c)), peak(c))
    vmin, one = best.get("V-Min"), best.get("1F1B")
    caps = {}
    if vmin is not None and one is not None and vmin < one:
        caps["(b) V-Min < cap < 1F1B"] = (vmin + one) / 2
    caps["(c) recompute required"] = min(best.values()) * 0.97
    return caps


def peak(c) -> int:
    return max(d.total for d in c.memory)


def run(name: str, steps: int) -> None:
    build, devices, m, mbs = MODELS[name]
    net = build()
    profile = staticpipe.profile(net.main, net.random_batch(mbs), startup=net.startup, loss=net.loss)
    batch = net.random_batch(mbs)  # the micro-batch every built plan is timed on

    def plan(cap):
        net = build()
        report = staticpipe.auto_plan(net.main, net.loss, momentum, devices, m, memory_limit=cap, feed=batch,
                                      profile=profile, startup=net.startup, schedules=SCHEDULES, recompute="whole",
                                      time_steps=steps)
        print(f"\n{report}")
        return report

    report = plan(None)
    chosen = {"(a) unlimited": (None, report.chosen)}
    floor = min(peak(c) for c in report.candidates if c.recompute)  # the least any recomputing plan holds
    for label, cap in caps_for(report).items():
        while True:
            try:
                choice = plan(cap).chosen
            except ValueError as exc:
                chosen[label] = (cap, str(exc))
                break
            chosen[label] = (cap, choice)
            if label.startswith("(b)") or choice.recompute or cap <= floor:
                break
            cap = max(floor, peak(choice) * 0.97)  # a memory-capped cut fitted without recompute: go below it
    configs = {key(c): (c, None) for c in report.candidates}
    configs.update({key(c): (c, cap) for cap, c in chosen.values() if not isinstance(c, str) and key(c) not in configs})
    measured = measure_all(build, configs, profile, m, mbs, steps)
    print(f"\n== {name}: {len(devices)} devices, {m} micro-batches of {mbs}, Momentum; "
          f"{len(configs)} configurations (the unlimited search space and the capped choices), each measured")
    print(f"{'schedule':<10} {'cut':<6} {'recompute':<9} {'pred ms':>8} {'meas ms':>8} "
          + " ".join(f"{d + ' pred/meas':>24}" for d in devices))
    for k in sorted(configs, key=lambda k: measured[k][0]):
        c, (t, held) = configs[k][0], measured[k]
        cells = " ".join(f"{human_bytes(d.total) + ' / ' + human_bytes(held[d.device]):>24}" for d in c.memory)
        print(f"{c.schedule:<10} {c.policy:<6} {','.join(map(str, c.recompute)) or '-':<9} {c.step_s * 1e3:>8.1f} "
              f"{t * 1e3:>8.1f} {cells}")
    for label, (cap, c) in chosen.items():
        if isinstance(c, str):
            print(f"\n{label}: {c}")
            continue
        t, held = measured[key(c)]
        fitting = [k for k, (_, m_held) in measured.items() if cap is None or all(v <= cap for v in m_held.values())]
        fastest = min(fitting, key=lambda k: measured[k][0])
        worst_mem = max(abs(d.total / held[d.device] - 1) for d in c.memory)
        print(f"\n{label}{'' if cap is None else f' = {human_bytes(cap)}'}: chosen {c.schedule}, "
              f"{c.policy} cut, recompute {','.join(map(str, c.recompute)) or 'none'}")
        print("  peak per device, predicted / measured: "
              + ", ".join(f"{d.device} {human_bytes(d.total)} / {human_bytes(held[d.device])}" for d in c.memory))
        print(f"  step: predicted {c.step_s * 1e3:.1f} ms, measured {t * 1e3:.1f} ms; fastest measured that "
              f"fits: {fastest[0]} {fastest[1]} recompute {','.join(map(str, fastest[3])) or '-'} "
              f"{measured[fastest][0] * 1e3:.1f} ms")
        print(f"  targets: measured peak <= cap {'yes' if cap is None or max(held.values()) <= cap else 'NO'}; "
              f"choice / fastest {t / measured[fastest][0]:.3f} (<= 1.05); predicted peak off by "
              f"{worst_mem:.1%} (<= 10 %); predicted step off by {abs(c.step_s / t - 1):.1%} (<= 10 %)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS) + ["all"], default="all")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    paddle.enable_static()
    for name in MODELS if args.model == "all" else [args.model]:
        run(name, args.steps)


if __name__ == "__main__":
    main()
