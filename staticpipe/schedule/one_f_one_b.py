"""1F1B (PipeDream-flush) and Paddle's Eager1F1B: warm up with forwards, then alternate one backward and
one forward, then drain the backwards.

1F1B: stage ``s`` of ``p`` runs ``min(p - s, m)`` forwards before its first backward, so at most ``p - s``
micro-batches are in flight on it (GPipe keeps all ``m``); the bubble is the same as GPipe's,
(p-1)/(m+p-1). With fewer micro-batches than stages the early stages run all forwards first (like
F-then-B) while the last stages still alternate; it trains correctly with any m >= 1.

Eager1F1B (Paddle's ``pipeline_scheduler_Eager1F1B`` pass): stage ``s`` runs ``2 (p - s) - 1`` warm-up
forwards, about twice 1F1B's. Why: in 1F1B a forward's output is needed by the next stage at once, so
its send is on the critical path; running ahead by one round trip's worth of forwards gives every send
a backward's time to arrive before it is waited for, so messages overlap compute, for up to
``2 (p - s) - 1`` micro-batches in flight instead of ``p - s``. Like Paddle's pass it needs
``m >= 2 p - 1`` (stage 0's warm-up); ``registry.make_schedule`` says so by name. At zero message cost
it takes exactly as long as 1F1B.
"""
from __future__ import annotations

from .actions import OPT, Action, B, F, Schedule


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    return {s: _warm_up_then_alternate(s, num_microbatches, min(num_stages - s, num_microbatches))
            for s in range(num_stages)}


def eager_one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    return {s: _warm_up_then_alternate(s, num_microbatches, 2 * (num_stages - s) - 1) for s in range(num_stages)}


def _warm_up_then_alternate(stage: int, num_microbatches: int, warmup: int) -> list[Action]:
    """``warmup`` forwards, then a backward and a forward until the forwards run out, then the backwards."""
    acts: list[Action] = [F(stage, i) for i in range(warmup)]
    for i in range(warmup, num_microbatches):
        acts += [B(stage, i - warmup), F(stage, i)]
    return acts + [B(stage, i) for i in range(num_microbatches - warmup, num_microbatches)] + [OPT(stage)]
