"""``staticpipe.auto_plan`` against measurement: does its choice fit, is it the fastest, are its predictions right?

For each model (models' GPT on 4 stages, ResNet-50 on 2 and 4), the planner profiles once and prices its
search space (the schedules below x its partitions x recompute of none or every stage, so that every
configuration it enumerates can also be measured here). Then every configuration is built, trained
``--steps`` steps and measured: step time (median) and per device the bytes held at the peak
(parameters, optimizer state and gradient buffers as the device's scope holds them after a step, plus the
activation peak the runtime counts, ``Executor.device_memory_stats``). For three memory caps -- (a)
unlimited, (b) between V-Min's and 1F1B's predicted peak, (c) below V-Min's so that recompute is needed --
it prints the planner's choice, its predicted and measured peak per device and step time, the fastest
measured configuration that fits, and the targets of issue 19: measured peak <= cap on every device, the
choice within 5 % of the fastest measured that fits, predicted peak and step time within 10 % of measured.

    python bench/planner.py [--model gpt|resnet2|resnet4|all] [--steps 3]

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
staticpipe.use_legacy_ir()  # on Paddle 3: profile and auto_place read legacy programs (README "PIR programs")
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


def measure(build, candidate, profile, m: int, mbs: int, cap, steps: int):
    """Train ``candidate`` (a ``staticpipe.partition.Candidate``): (median step seconds, per-device bytes)."""
    net = build()
    staticpipe.auto_place(net.main, devices=list(candidate.devices), policy=candidate.policy, profile=profile,
                          schedule=candidate.schedule, num_microbatches=m, memory_limit=cap)
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(momentum(), num_microbatches=m, schedule=candidate.schedule,
                                           recompute=list(candidate.recompute), micro_batch_size=mbs)
        opt.minimize(net.loss)
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(net.startup)
    times = []
    for k in range(steps + 1):
        batch = net.random_batch(m * mbs, seed=k)
        start = time.perf_counter()
        exe.run(net.main, feed=batch, fetch_list=[net.loss])
        times.append(time.perf_counter() - start)
    peaks = exe.device_memory_stats()
    held = {}
    for stage in opt.plan.stages:
        scope = exe.scope_of(stage.device)
        names = set(stage.persistables) | set(stage.step_values) | {g[:-len("@MERGED")] for g in stage.grad_buffers}
        held[stage.device] = held.get(stage.device, 0) + sum(tensor_bytes(scope, n) for n in names)
    exe.close()
    return statistics.median(times[1:]), {d: held[d] + peaks[d]["peak_activation_bytes"] for d in held}


def key(c) -> tuple:
    return c.schedule, c.policy, c.recompute


def caps_for(report) -> dict[str, float | None]:
    """(a) unlimited, (b) between V-Min's and 1F1B's predicted peak, (c) below V-Min's."""
    def peak(c):
        return max(d.total for d in c.memory)
    best = {}
    for c in report.candidates:
        if not c.recompute:
            best.setdefault(c.schedule, peak(c))
            best[c.schedule] = min(best[c.schedule], peak(c))
    vmin, one = best.get("V-Min"), best.get("1F1B")
    recomputing = min(peak(c) for c in report.candidates if c.recompute)
    caps = {"(a) unlimited": None}
    if vmin is not None and one is not None and vmin < one:
        caps["(b) V-Min < cap < 1F1B"] = (vmin + one) / 2
    low = min(best.values())
    caps["(c) below every plan without recompute"] = max(recomputing, low * 0.97) if recomputing < low else None
    return caps


def run(name: str, steps: int) -> None:
    build, devices, m, mbs = MODELS[name]
    net = build()
    profile = staticpipe.profile(net.main, net.random_batch(mbs), startup=net.startup, loss=net.loss)
    report = staticpipe.auto_plan(net.main, net.loss, momentum, devices, m, profile=profile, startup=net.startup,
                                  schedules=SCHEDULES, recompute="whole")
    measured = {key(c): measure(build, c, profile, m, mbs, None, steps) for c in report.candidates}
    print(f"\n== {name}: {len(devices)} devices, {m} micro-batches of {mbs}, Momentum; "
          f"{len(report.candidates)} configurations enumerated, each measured")
    print(f"{'schedule':<10} {'cut':<6} {'recompute':<9} {'pred ms':>8} {'meas ms':>8} "
          + " ".join(f"{d + ' pred/meas':>24}" for d in devices))
    for c in sorted(report.candidates, key=lambda c: measured[key(c)][0]):
        t, peak = measured[key(c)]
        cells = " ".join(f"{human_bytes(d.total) + ' / ' + human_bytes(peak[d.device]):>24}" for d in c.memory)
        print(f"{c.schedule:<10} {c.policy:<6} {','.join(map(str, c.recompute)) or '-':<9} {c.step_s * 1e3:>8.1f} "
              f"{t * 1e3:>8.1f} {cells}")
    for label, cap in caps_for(report).items():
        if cap is None and label.startswith("(c)"):
            print(f"\n{label}: no recomputing configuration is below every plan without recompute here")
            continue
        net = build()
        try:
            chosen = staticpipe.auto_plan(net.main, net.loss, momentum, devices, m, memory_limit=cap, profile=profile,
                                          startup=net.startup, schedules=SCHEDULES, recompute="whole").chosen
        except ValueError as exc:
            print(f"\n{label}: {exc}")
            continue
        if key(chosen) not in measured:  # a memory-capped cut: not in the unlimited search space
            measured[key(chosen)] = measure(build, chosen, profile, m, mbs, cap, steps)
        t, peak = measured[key(chosen)]
        fitting = [k for k, (_, held) in measured.items() if cap is None or all(v <= cap for v in held.values())]
        fastest = min(fitting, key=lambda k: measured[k][0])
        worst_mem = max(abs(d.total / peak[d.device] - 1) for d in chosen.memory)
        print(f"\n{label}{'' if cap is None else f' = {human_bytes(cap)}'}: chosen {chosen.schedule}, "
              f"{chosen.policy} cut, recompute {','.join(map(str, chosen.recompute)) or 'none'}")
        print(f"  peak per device, predicted / measured: "
              + ", ".join(f"{d.device} {human_bytes(d.total)} / {human_bytes(peak[d.device])}" for d in chosen.memory))
        print(f"  step: predicted {chosen.step_s * 1e3:.1f} ms, measured {t * 1e3:.1f} ms; fastest measured that "
              f"fits: {fastest[0]} {fastest[1]} recompute {','.join(map(str, fastest[2])) or '-'} "
              f"{measured[fastest][0] * 1e3:.1f} ms")
        print(f"  targets: measured peak <= cap {'yes' if cap is None or max(peak.values()) <= cap else 'NO'}; "
              f"choice / fastest {t / measured[fastest][0]:.3f} (<= 1.05); predicted peak off by "
              f"{worst_mem:.1%} (<= 10 %); predicted step off by {abs(chosen.step_s / t - 1):.1%} (<= 10 %)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS) + ["all"], default="all")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    paddle.enable_static()
    for name in MODELS if args.model == "all" else [args.model]:
        run(name, args.steps)


if __name__ == "__main__":
    main()
