"""DualPipeV (DeepSeek's DualPipe "cut in half", deepseek-ai/DualPipe): a V of two chunks per rank whose
steady state runs a forward of one micro-batch paired with a backward of another (one FB action).

Placement as ZB-V: rank r holds stage r (chunk 0, on the way down) and stage 2p-1-r (chunk 1, on the
way up). Why pair an F with a B: on a GPU the two overlap -- one computes while the other's messages
(and, in DeepSeek-V3, its expert all-to-all) are in flight -- so the steady state hides communication
behind compute. Here the pair is one action that the runtime runs back to back; its B is a full
backward (B then its W at once), as in DualPipe.

Rank r of p, with m >= 2p micro-batches, in DualPipe's eight steps (``F0``/``F1``: a forward of chunk
0/1; ``B``: a full backward; ``B*``: a B whose W waits in a first-in first-out queue; ``W``: the oldest
queued W):

1. 2 (p - r - 1) x F0                     fill the way down
2. (r + 1) x F0 F1                         first micro-batches turn at the bottom of the V
3. (p - r - 1) x B1* W F1                  first backwards of chunk 1, one W each
4. (m - 2p + r + 1) x F0&B1 F1&B0          the steady state: two pairs per micro-batch (the last rank
                                           runs its very first pair as F0, then B1: B1 needs that F0)
5. (p - r - 1) x B1 F1&B0                  chunk 0's forwards have run out
6. (r + 1) x B1 B0                         the second half of them with B* (zero bubble)
7. (p - r - 1) x W B0*                     the drain, filled with the queued W's
8. (r + 1) x W

DualPipe's README gives the bubble as (p - 1)(F&B + B - 3W) per rank for its 2p stages (chunk costs; B
a full backward): at unit chunk costs (F = B = W = 1, so F&B = 3 back to back) 2 (p - 1), a third of
1F1B's 6 (p - 1) in the same units; activations up to p + 1 micro-batches of a whole rank.
"""
from __future__ import annotations

from .actions import FB, OPT, Action, B, F, Schedule, W


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """Needs ``num_microbatches >= 2 * num_ranks`` (``registry.make_schedule`` says so by name)."""
    return {r: _Rank(num_ranks, r).actions(num_microbatches) for r in range(num_ranks)}


class _Rank:
    """One rank's list as it is written: the next micro-batch of each stage's F and B, and the queue of
    W's whose B ran without them."""

    def __init__(self, num_ranks: int, rank: int):
        self.p, self.r = num_ranks, rank
        self.down, self.up = rank, 2 * num_ranks - 1 - rank  # chunk 0's stage, chunk 1's stage
        self.next_f = {self.down: 0, self.up: 0}
        self.next_b = {self.down: 0, self.up: 0}
        self.queued: list[Action] = []
        self.acts: list[Action] = []

    def actions(self, m: int) -> list[Action]:
        p, r, down, up = self.p, self.r, self.down, self.up
        for _ in range(2 * (p - r - 1)):
            self.f(down)
        for _ in range(r + 1):
            self.f(down)
            self.f(up)
        for _ in range(p - r - 1):
            self.b(up, queue=True)
            self.w()
            self.f(up)
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                self.f(down)
                self.b(up)
            else:
                self.pair(down, up)
            self.pair(up, down)
        for _ in range(p - r - 1):
            self.b(up)
            self.pair(up, down)
        queue = False
        for i in range(r + 1):  # the queued W's start half-way, on one chunk first: rank parity picks which
            queue = queue or (i == (r + 1) // 2 and r % 2 == 1)
            self.b(up, queue)
            queue = queue or (i == (r + 1) // 2 and r % 2 == 0)
            self.b(down, queue)
        for _ in range(p - r - 1):
            self.w()
            self.b(down, queue=True)
        for _ in range(r + 1):
            self.w()
        return self.acts + [OPT(down), OPT(up)]

    def f(self, stage: int) -> None:
        self.acts.append(F(stage, self._next(self.next_f, stage)))

    def b(self, stage: int, queue: bool = False) -> None:
        mb = self._next(self.next_b, stage)
        self.acts.append(B(stage, mb))
        (self.queued if queue else self.acts).append(W(stage, mb))

    def w(self) -> None:
        self.acts.append(self.queued.pop(0))

    def pair(self, f_stage: int, b_stage: int) -> None:
        """An F of ``f_stage`` paired with a full backward of ``b_stage``: the FB, then the B's W."""
        mb = self._next(self.next_b, b_stage)
        self.acts += [FB(f_stage, self._next(self.next_f, f_stage), b_stage, mb), W(b_stage, mb)]

    @staticmethod
    def _next(counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1
