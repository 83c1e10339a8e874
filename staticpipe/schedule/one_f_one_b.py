"""1F1B (PipeDream-flush): warm up with forwards, then alternate one forward and one backward.

Stage ``s`` of ``p`` runs ``min(p - 1 - s, m)`` warm-up forwards, so at most ``p - s`` micro-batches are
in flight on it (GPipe keeps all ``m``); the bubble is the same as GPipe's, (p-1)/(m+p-1). With fewer
micro-batches than stages the early stages run all forwards first (like F-then-B) while the last
stages still alternate; it trains correctly with any m >= 1.
"""
from __future__ import annotations

from .actions import OPT, Action, B, F, Schedule


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    schedule: Schedule = {}
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_microbatches)
        acts: list[Action] = [F(s, i) for i in range(warmup)]
        next_b = 0
        for i in range(warmup, num_microbatches):
            acts += [F(s, i), B(s, next_b)]
            next_b += 1
        acts += [B(s, i) for i in range(next_b, num_microbatches)]
        schedule[s] = acts + [OPT(s)]
    return schedule
