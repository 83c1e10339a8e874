"""Interleaved 1F1B (Megatron-LM): each rank holds ``v`` model chunks, stage ``s`` on rank ``s % p``.

A micro-batch then crosses every rank ``v`` times with 1/v of the work each time, so the fill and drain
of the pipeline cost 1/v of 1F1B's: the bubble shrinks about ``v``-fold for ``v`` times the messages.

Rank ``r`` works through ``m * v`` virtual forwards in groups of ``p`` micro-batches per chunk: virtual
forward ``k`` is chunk ``(k // p) % v`` of micro-batch ``(k // (p v)) p + k % p``; virtual backward
``k`` the same with the chunks reversed. It runs ``(p - r - 1) * 2 + (v - 1) * p`` warm-up forwards
(Megatron's count: a rank's first backward comes back only after the round trip through the ranks
behind it, ``2 (p - r - 1)`` steps, plus one full pass of every earlier chunk), then alternates one
forward and one backward, then drains the backwards. ``m`` must be a multiple of ``p``.

With ``v = 1`` the round trip is already covered by 1F1B's warm-up of ``p - r - 1`` forwards, and
Megatron runs its plain 1F1B; so does this function, so that one chunk per device is exactly 1F1B.
"""
from __future__ import annotations

from .actions import OPT, Action, B, F, Schedule


def interleaved(num_ranks: int, num_microbatches: int, num_chunks: int) -> Schedule:
    p, m, v = num_ranks, num_microbatches, num_chunks
    total = m * v

    def virtual(rank: int, k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        stage = (chunk if forward else v - 1 - chunk) * p + rank
        return stage, (k // (p * v)) * p + k % p

    schedule: Schedule = {}
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p if v > 1 else p - r - 1, total)
        acts: list[Action] = [F(*virtual(r, k, True)) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [F(*virtual(r, warmup + k, True)), B(*virtual(r, k, False))]
        acts += [B(*virtual(r, k, False)) for k in range(total - warmup, total)]
        schedule[r] = acts + [OPT(c * p + r) for c in range(v)]
    return schedule
