"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): ZB-H1 and ZB-V.

Splitting the backward into B (activation gradients, which the previous stage waits for) and W
(weight gradients, which nobody waits for) lets a rank defer its W's into the idle time 1F1B has
while the pipeline fills and drains. Both schedules come from one deterministic greedy list scheduler
over unit costs (F = B = W = 1, one time step each): whenever a rank is free it runs, in priority,

1. the next F of one of its stages (the later stage first), if its input is there and
   a. the stage holds fewer than ``S - s`` micro-batches between F and B (1F1B's warm-up rule), and
   b. the rank holds fewer than ``p x chunks`` (stage, micro-batch) pairs between F and W -- 1F1B's
      peak, the first stage's ``p`` micro-batches of a whole rank's layers, since W needs the
      activations too;
2. else a ready B (the later stage first, then the lowest micro-batch);
3. else a pending W (the lowest micro-batch, then the later stage);
4. else it waits. Each stage's OPT comes after everything.

Why F before B: with B first a rank answers each returning gradient at once and starves the ranks
after it of forwards; with F first the W's fill exactly the fill-and-drain gaps. Measured at unit
costs, ZB-H1 takes ``3m + p - 1`` steps for every ``m >= p`` (p <= 8), the paper's ZB-H1: a third of
1F1B's idle time (B + W priced 2) at 1F1B's peak memory. Why 1b: without it the W's wait until the
forwards run out and a rank holds all ``m`` micro-batches, like F-then-B.

ZB-H1 places stage s on rank s. ZB-V gives rank r the stages r and 2p-1-r: a micro-batch goes down
the ranks and back up, so the last stage, whose B starts every backward, shares rank 0 with the
first; with each chunk half a stage it idles about ``(p - 1) / 2`` steps, a sixth of 1F1B's.
"""
from __future__ import annotations

from .actions import OPT, Action, B, F, Kind, Schedule, W


def zb_v_layout(num_ranks: int) -> list[int]:
    """Rank of each of the ``2 p`` stages: 0, 1, ..., p-1, p-1, ..., 1, 0."""
    return list(range(num_ranks)) + list(reversed(range(num_ranks)))


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    return greedy_split_backward(list(range(num_ranks)), num_microbatches)


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    return greedy_split_backward(zb_v_layout(num_ranks), num_microbatches)


def greedy_split_backward(stage_ranks: list[int], num_microbatches: int) -> Schedule:
    """The list scheduler above for a placement ``stage_ranks`` (stage -> rank) with the same number
    of stages on every rank."""
    num_stages, m = len(stage_ranks), num_microbatches
    stages_of = {r: sorted((s for s, q in enumerate(stage_ranks) if q == r), reverse=True)
                 for r in sorted(set(stage_ranks))}
    cap = num_stages  # p ranks x S/p chunks: 1F1B's first-stage peak, in (stage, micro-batch) pairs
    done: set[Action] = set()
    next_f = [0] * num_stages
    before_b: list[set[int]] = [set() for _ in range(num_stages)]  # F done, B not
    before_w: list[set[int]] = [set() for _ in range(num_stages)]  # B done, W not

    def pick(r: int) -> Action | None:
        held = sum(len(before_b[s]) + len(before_w[s]) for s in stages_of[r])
        for s in stages_of[r]:
            mb = next_f[s]
            if (mb < m and (s == 0 or F(s - 1, mb) in done) and len(before_b[s]) < num_stages - s
                    and held < cap):
                return F(s, mb)
        for s in stages_of[r]:
            ready = [mb for mb in before_b[s] if s == num_stages - 1 or B(s + 1, mb) in done]
            if ready:
                return B(s, min(ready))
        waiting = [(mb, -s) for s in stages_of[r] for mb in before_w[s]]
        return W(-min(waiting)[1], min(waiting)[0]) if waiting else None

    schedule: Schedule = {r: [] for r in stages_of}
    while len(done) < 3 * m * num_stages:
        step = {r: a for r in stages_of if (a := pick(r)) is not None}
        if not step:
            raise RuntimeError(f"greedy scheduler stuck for stage placement {stage_ranks}, m={m}")
        for r, a in step.items():
            schedule[r].append(a)
            done.add(a)
            if a.kind is Kind.F:
                next_f[a.stage] += 1
                before_b[a.stage].add(a.microbatch)
            elif a.kind is Kind.B:
                before_b[a.stage].discard(a.microbatch)
                before_w[a.stage].add(a.microbatch)
            else:
                before_w[a.stage].discard(a.microbatch)
    for r, stages in stages_of.items():
        schedule[r] += [OPT(s) for s in sorted(stages)]
    return schedule
