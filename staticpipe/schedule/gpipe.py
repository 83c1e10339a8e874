"""F-then-B (GPipe): every stage runs all forwards, then all backwards, then the update.

Simple and robust; keeps all ``m`` micro-batches' activations alive on every stage.
"""
from __future__ import annotations

from .actions import OPT, B, F, Schedule


def f_then_b(num_stages: int, num_microbatches: int) -> Schedule:
    return {s: [F(s, i) for i in range(num_microbatches)]
            + [B(s, i) for i in range(num_microbatches)] + [OPT(s)]
            for s in range(num_stages)}
