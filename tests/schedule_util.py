"""Shared by the schedule tests: schedules as text, test routes to lower them with, and a rank's activation peak."""
from __future__ import annotations

from staticpipe.plan import BACKWARD, FORWARD, CutVar, Route, SectionRef
from staticpipe.schedule import Kind

# every (name, ranks, micro-batches, chunks) the schedule sweeps run; Eager1F1B and DualPipeV from the
# fewest micro-batches they take (2p - 1, 2p)
ONE_CHUNK = ("F-then-B", "1F1B", "ZB-H1", "ZB-2P")
CASES = ([(n, p, m, 1) for n in ONE_CHUNK for p in range(1, 5) for m in range(1, 2 * p + 3)]
         + [("interleaved", p, m, v) for p in range(1, 5) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)]
         + [(n, p, m, 2) for n in ("ZB-V", "V-Min", "V-Half") for p in range(1, 5) for m in range(1, 2 * p + 3)]
         + [("Eager1F1B", p, m, 1) for p in range(1, 5) for m in range(2 * p - 1, 3 * p + 1)]
         + [("DualPipeV", p, m, 2) for p in range(1, 5) for m in range(2 * p, 3 * p + 1)])

# stage 1 of 3 has a backward twice as long as the others', and W's are cheap
HEAVY_MIDDLE = {"F": 1, "B": [1, 2, 1], "W": 0.5}


def as_strings(schedule):
    """Each rank's actions as one line of text, e.g. {0: "0F0 0B0 0OPT"}."""
    return {r: " ".join(map(str, acts)) for r, acts in schedule.items()}


def cut(name):
    """The cut variables of a test route: one float32 variable ``name`` of shape (-1, 8)."""
    return (CutVar(name, (-1, 8), "float32", True),)


def route(index, src_stage, src_kind, dst_stage, dst_kind, name):
    """Route ``index`` from section (src_stage, src_kind) to (dst_stage, dst_kind), carrying ``name``."""
    return Route(index, SectionRef(src_stage, src_kind), SectionRef(dst_stage, dst_kind), cut(name))


def chain_routes(num_stages):
    """A chain's routes in the plan's order: h<s> from stage s to s + 1, then h<s>@GRAD back, last stage first."""
    routes = [route(s, s, FORWARD, s + 1, FORWARD, f"h{s}") for s in range(num_stages - 1)]
    return routes + [route(num_stages - 1 + k, s + 1, BACKWARD, s, BACKWARD, f"h{s}@GRAD")
                     for k, s in enumerate(reversed(range(num_stages - 1)))]


def all_pairs_routes(num_stages, plan_order=True):
    """Routes for every s < t (forward s -> t, forward s -> backward t, backward t -> s), in the plan's order."""
    # plan_order=False numbers them pair by pair, forward pairs first: lowering must not rely on the plan's order
    pairs = [(SectionRef(s, a), SectionRef(t, b)) for s in range(num_stages) for t in range(s + 1, num_stages)
             for a, b in ((FORWARD, FORWARD), (FORWARD, BACKWARD))]
    pairs += [(SectionRef(t, BACKWARD), SectionRef(s, BACKWARD)) for s in range(num_stages)
              for t in range(s + 1, num_stages)]
    if plan_order:
        pairs.sort(key=lambda sd: (sd[0].order(num_stages), sd[1].order(num_stages)))
    return [Route(k, src, dst, cut(f"v{k}")) for k, (src, dst) in enumerate(pairs)]


def rank_peak(actions):
    """Most (stage, micro-batch) pairs one rank's actions hold at once between F and W (activations kept):
    its peak activations in chunks (stages) of one micro-batch. An FB counts as its F, then its B."""
    live, peak = set(), 0
    for a in (h for b in actions for h in b.halves()):
        if a.kind is Kind.F:
            live.add((a.stage, a.microbatch))
        elif a.kind is Kind.W:
            live.discard((a.stage, a.microbatch))
        peak = max(peak, len(live))
    return peak
