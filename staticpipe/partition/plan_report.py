"""What ``auto_plan`` reports: each combination it priced (``Candidate``) and its choice among them, with the
runners-up and why each lost (``PlanReport``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..memory_model import DeviceMemory, human_bytes


@dataclass(frozen=True)
class Candidate:
    """One combination the planner priced."""

    schedule: str
    policy: str  # the partition: auto_place's "time" or "memory" cut
    devices: tuple[str, ...]  # the device of each stage
    bounds: tuple[int, ...]  # layer index where each stage starts (and the end)
    recompute: tuple[int, ...]  # stages whose activations are recomputed
    step_s: float  # predicted seconds per step
    memory: tuple[DeviceMemory, ...]  # predicted peak per device
    over: Mapping[str, int]  # device -> bytes above its cap (empty: fits)

    @property
    def fits(self) -> bool:
        return not self.over

    def describe(self) -> str:
        rc = ",".join(map(str, self.recompute)) or "-"
        peaks = ", ".join(f"{d.device} {human_bytes(d.total)}" for d in self.memory)
        return f"{self.schedule:<10} {self.policy:<6} recompute {rc:<8} {self.step_s * 1e3:9.2f} ms  peak {peaks}"


@dataclass(frozen=True)
class PlanReport:
    """What ``auto_plan`` chose (and applied), what it predicted, and why the others lost."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]  # every combination priced, fastest first
    skipped: Mapping[str, str]  # schedule -> why it could not run this program
    memory_limit: Mapping[str, float | None]
    micro_batch_size: int
    efficiency: float | None  # simulated / measured step of the timed plans (None: times from the op profile)
    timed_plans: int  # plans built and run to time their actions

    def why_not(self, candidate: Candidate) -> str:
        if candidate == self.chosen:
            return "chosen"
        if not candidate.fits:
            return "over the cap: " + ", ".join(f"{d} by {human_bytes(b)}" for d, b in candidate.over.items())
        slower = candidate.step_s / self.chosen.step_s - 1
        return f"{slower:+.1%} slower" if slower > 0 else "as fast; more recompute or later in the registry"

    def __str__(self) -> str:
        caps = ", ".join(f"{d} {'unlimited' if c is None else human_bytes(c)}" for d, c in self.memory_limit.items())
        best: dict[tuple[str, str], Candidate] = {}
        for c in self.candidates:  # fastest first: the first of each schedule and cut is its best
            best.setdefault((c.schedule, c.policy), c)
        timing = ("times from the op profile alone (no plan timed)" if self.efficiency is None else
                  f"times from {self.timed_plans} timed plans, simulated / measured step {self.efficiency:.2f}")
        lines = [f"auto_plan: micro-batch {self.micro_batch_size}, caps {caps}; {len(self.candidates)} plans priced; "
                 + timing,
                 f"  chosen: {self.chosen.describe()}", "  the best of each other schedule and cut:"]
        lines += [f"    {c.describe()}  -- {self.why_not(c)}" for c in best.values() if c != self.chosen]
        lines += [f"  not applicable: {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)
