"""Print a schedule and what the simulator says of it, without Paddle or devices.

    python -m staticpipe.schedule --schedule 1F1B --stages 4 --microbatches 8 [--chunks 2]
        [--costs F=1,B=2] [--comm 0.5] [--png out.png] [--json]

``--stages`` is the number of ranks (devices), ``--chunks`` the stages per device. ``--json`` prints
the action lists as JSON (``schedule_from_json`` reads it back) instead of text. ``--costs`` prices the
simulation and, for the schedules that plan by costs (ZB-H1, ZB-V, ZB-2P, V-Min, V-Half), the plan itself: the simulated
total of the unit-cost plan under the same costs is printed beside it. ``--comm`` is the latency of a
message between two devices (in flight, occupying neither): the simulation waits for it and the schedules
that plan by costs plan with it. ``span bubble`` is the bubble with no barrier between steps (each rank's
idle time between its own first and last action): the zero-bubble papers' measure, 0 for ZB-2P. ``bound``
is the shortest step any order could have on the layout (``bound.py``).
"""
from __future__ import annotations

import argparse

from .actions import format_schedule, schedule_to_json
from .bound import step_bound
from .latency import link_latency
from .registry import get_kind, make_schedule
from .simulate import PLANNED_KINDS, cost_function, simulate
from .validate import validate


def _costs(text: str) -> dict[str, float]:
    try:
        return {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"costs must look like F=1,B=2; got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m staticpipe.schedule", description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--stages", type=int, required=True, help="number of ranks (devices)")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=None, help="stages per device (default: the schedule's)")
    parser.add_argument("--costs", type=_costs, default=None, help="time per action kind, e.g. F=1,B=2 "
                        "(default: F = B = W = 1/chunks, so a device's work is the same for any chunking; "
                        "without W actions B is the whole backward)")
    parser.add_argument("--comm", type=float, default=0.0, help="latency of a message between two devices, in the "
                        "costs' unit (default 0: messages are free)")
    parser.add_argument("--png", help="draw the simulated Gantt chart here")
    parser.add_argument("--json", action="store_true", help="print the action lists as JSON")
    args = parser.parse_args(argv)
    for flag in ("stages", "microbatches", "chunks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be >= 1, got {value}")
    try:
        kind = get_kind(args.schedule)
        chunks = args.chunks if args.chunks is not None else (kind.chunks or 1)
        planned = {k: v for k, v in (args.costs or {}).items() if k in PLANNED_KINDS} if kind.cost_aware else {}
        link_latency(args.comm, "--comm")
        comm = args.comm if kind.cost_aware else None
        schedule = make_schedule(kind.name, args.stages, args.microbatches, chunks, planned or None, comm)
        validate(schedule, args.stages * chunks, args.microbatches, kind.layout(args.stages, chunks),
                 kind.split_backward)
        costs = args.costs if args.costs is not None else {k: 1 / chunks for k in "FBW"}
        sim = simulate(schedule, costs, args.stages * chunks, comm=args.comm)
        unit = simulate(make_schedule(kind.name, args.stages, args.microbatches, chunks), costs,
                        args.stages * chunks, comm=args.comm) if planned or link_latency(comm) else None
        bound = step_bound(kind.layout(args.stages, chunks), args.microbatches, cost_function(costs),
                           link_latency(args.comm), kind.split_backward)
    except ValueError as e:
        parser.error(str(e))
    print(schedule_to_json(schedule) if args.json else format_schedule(schedule))
    print(f"simulated total: {sim.total:g}")
    print(f"bubble: {sim.bubble:.4f}")
    print(f"span bubble: {sim.span_bubble:.4f}")
    print(f"bound: {bound:g} (the shortest step any order could have: the plan is {sim.total / bound:.3f}x it)")
    print("peak in flight: " + ", ".join(f"stage {s}: {n}" for s, n in sim.peak_inflight.items()))
    if unit is not None:
        print(f"unit-cost plan under these costs: simulated total {unit.total:g}, bubble {unit.bubble:.4f}")
    if args.png:
        from .gantt import draw_gantt
        draw_gantt({f"{kind.name}, {args.stages} devices x {chunks} chunks, {args.microbatches} micro-batches "
                    "(simulated)": sim}, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
