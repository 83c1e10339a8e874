"""The memory model of a plan: the bytes each device holds at its peak, predicted before anything runs.

Why it is part of the plan: a schedule, a partition and per-stage recompute are one decision under a
device's memory cap (``partition``'s planner searches them together), and the plan is where all three meet.
The rewrite measures each stage from its programs (``rewrite/memory.py``); what is left is arithmetic on
plain numbers, kept here so that ``print(plan)``, saved plans and the planner read the same figures.

Per stage, at micro-batch size ``b``:

- parameters, optimizer state (what the stage's optimize section keeps: moments, beta powers, the learning
  rate), and gradients: the per-step ``@MERGED`` accumulator and the per-micro-batch gradient buffer the
  sections keep and reuse (both the parameters' size);
- activations: what a forward keeps for its backward (the section's keep list: the values its backward
  reads, the data and received cut values among them; with recompute only the stage's inputs), ``b`` per
  batched dimension, times the micro-batches in flight at once under the schedule -- exactly what the
  runtime counts (``Executor.memory_stats()``'s ``peak_activation_bytes``).

A device's activation peak is not the sum of its stages' peaks when it holds several (interleaved, V
layouts): their peaks need not coincide. So for each device the model keeps every distinct vector of
in-flight counts (one per stage of the device) its action list passes through, and the peak is the
largest of those vectors weighted by the stages' bytes per micro-batch.
"""
from __future__ import annotations

import numbers
import re

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one stage; activations per micro-batch as ``per_sample * b + fixed``."""

    stage: int
    parameter_bytes: int
    state_bytes: int
    gradient_bytes: int
    kept_per_sample: int
    kept_fixed: int
    peak_inflight: int  # micro-batches whose activations the stage holds at once under the schedule
    # ZeRO-1: the optimizer state bytes each member of a sharding group holds of ``state_bytes`` (the whole)
    shard_state_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_state_bytes", tuple(self.shard_state_bytes))  # a saved plan's JSON list

    def held_state_bytes(self, shard: int | None = None) -> int:
        """Optimizer state that member ``shard`` of a sharding group holds (None: the largest member's)."""
        if not self.shard_state_bytes:
            return self.state_bytes
        unsharded = self.state_bytes - sum(self.shard_state_bytes)
        return unsharded + (max(self.shard_state_bytes) if shard is None else self.shard_state_bytes[shard])

    @property
    def static_bytes(self) -> int:
        """What the stage holds whatever the micro-batch size: parameters, optimizer state (sharded: the
        largest member's), gradients."""
        return self.parameter_bytes + self.held_state_bytes() + self.gradient_bytes

    def kept_bytes(self, micro_batch_size: int) -> int:
        """Activations one micro-batch's forward keeps for its backward."""
        return self.kept_per_sample * micro_batch_size + self.kept_fixed

    def activation_peak(self, micro_batch_size: int) -> int:
        return self.kept_bytes(micro_batch_size) * self.peak_inflight


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted peak of one device (rank): its stages' static bytes and its activation peak."""

    rank: int
    device: str
    static_bytes: int
    activation_bytes: int

    @property
    def total(self) -> int:
        return self.static_bytes + self.activation_bytes


@dataclass(frozen=True)
class MemoryModel:
    stages: tuple[StageMemory, ...]
    ranks: tuple[str, ...]  # rank -> device
    stage_ranks: tuple[int, ...]  # stage -> rank
    inflight: Mapping[int, tuple[tuple[int, ...], ...]]  # rank -> in-flight count vectors (its stages, in order)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_ranks) if r == rank]

    def devices(self, micro_batch_size: int) -> list[DeviceMemory]:
        """Each device's predicted peak at ``micro_batch_size``."""
        out = []
        for rank, device in enumerate(self.ranks):
            stages = [self.stages[s] for s in self.stages_of(rank)]
            per_mb = [st.kept_bytes(micro_batch_size) for st in stages]
            peak = max((sum(n * b for n, b in zip(counts, per_mb)) for counts in self.inflight.get(rank, ())),
                       default=0)
            out.append(DeviceMemory(rank, device, sum(st.static_bytes for st in stages), peak))
        return out

    def describe(self, micro_batch_size: int | None) -> list[str]:
        """Lines for ``print(plan)``: per stage, then per device (the activations need the micro-batch size)."""
        lines = ["  predicted memory (parameters + optimizer state + gradients, activations kept F -> B x in flight):"]
        for st in self.stages:
            kept = (f"{human_bytes(st.kept_bytes(micro_batch_size))}/micro-batch x {st.peak_inflight} = "
                    f"{human_bytes(st.activation_peak(micro_batch_size))}" if micro_batch_size else
                    f"{st.kept_per_sample} B/sample (+{st.kept_fixed} B) x {st.peak_inflight}")
            lines.append(f"    stage {st.stage}: {human_bytes(st.parameter_bytes)} + {human_bytes(st.held_state_bytes())} + "
                         f"{human_bytes(st.gradient_bytes)}, activations {kept}")
            if st.shard_state_bytes:
                lines.append(f"      optimizer state per rank of a sharding group: "
                             f"{', '.join(human_bytes(st.held_state_bytes(j)) for j in range(len(st.shard_state_bytes)))}"
                             f" (unsharded {human_bytes(st.state_bytes)})")
        if micro_batch_size:
            lines += [f"    device {d.device}: {human_bytes(d.total)} at peak ({human_bytes(d.static_bytes)} + {human_bytes(d.activation_bytes)} "
                      "activations)" for d in self.devices(micro_batch_size)]
        return lines


def human_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    k = 0
    while abs(n) >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} B" if k == 0 else f"{n:.1f} {units[k]}"


_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(value: object, what: str) -> int | float:
    """A memory cap in bytes: a positive finite number, or a size such as "8GB", "512 MiB" (KB/MB/GB: 10^3
    steps, KiB/MiB/GiB: 2^10). ``ValueError`` naming ``what`` for anything else: NaN is no cap (every
    comparison with it is false), a string is not a list of caps, a bool is no size."""
    given = value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what}={value!r} is not a size: give bytes (a number) or a size such as '8GB' or "
                             "'512MiB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        value = float(m.group(1)) * _UNITS[unit]
        value = int(value) if value.is_integer() else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be bytes (a number) or a size such as '8GB', got {type(value).__name__}: "
                         f"{value!r}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{what}={given!r}{' is negative' if value < 0 else ''}: a memory cap must be a positive, "
                         "finite number of bytes (None for no cap)")
    return value  # as given: an int stays an int (reports print whole bytes)
