"""Partitioning policies: where to cut a sequence of layers into contiguous stages. Pure numpy.

Why contiguous: stages must see the forward data flow in order (an op may only read what earlier stages
or its own stage produced), and the layer order is a valid op order, so contiguous runs of layers are
always valid stages, and they are few enough to search exactly.

Every policy is the same two-pass dynamic program over the layer order (O(stages x layers^2)):
1. the smallest achievable *slowest stage* (min over splits of the max stage cost: PipeDream's
   objective, since a pipeline's step time is set by its slowest stage);
2. among the splits whose every stage is within ``tolerance`` of that optimum (costs that *tie*), the
   one sending the fewest bytes across its cuts.
Costs of a run of layers are looked up in a ``(layers + 1) x (layers + 1)`` matrix ``M[i, j]`` (layers
``i .. j-1``), so costs that are not sums of per-layer values (a parameter read by two layers counts
once per stage) fit too; ``segment_matrix`` builds it from per-layer values.

A split is returned as ``bounds``: ``num_stages + 1`` layer indices from 0 to the number of layers;
stage k holds layers ``bounds[k]`` to ``bounds[k + 1] - 1``, and none is empty.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .table import human_bytes

EPS = 1e-9  # relative slack when comparing float costs for equality


@dataclass(frozen=True)
class Constraints:
    """What a split must honour besides its objective."""

    allowed: np.ndarray | None = None  # [num_stages, num_layers] bool: layer j may run on stage k (guards)
    required: tuple[int, ...] = ()  # layers that must start a stage (split points)
    cut_bytes: np.ndarray | None = None  # [num_layers + 1]: bytes crossing a cut placed before layer j


def segment_matrix(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """``M[i, j] = sum(values[i:j])`` for per-layer ``values``; a square matrix is returned unchanged."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 2:
        return values
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[None, :] - prefix[:, None]


def stage_memory(param_bytes: np.ndarray | float, saved_bytes: np.ndarray | float, inflight: np.ndarray | int,
                 optimizer_state_factor: float) -> np.ndarray | float:
    """Bytes a stage holds: its parameters with their optimizer state (``optimizer_state_factor`` x the
    parameter bytes: 2 for momentum = parameter + velocity, 3 for Adam = parameter + two moments), the
    gradient accumulation buffer (1 x), and the activations its backward needs for every micro-batch the
    schedule keeps in flight on it."""
    return param_bytes * (optimizer_state_factor + 1) + inflight * saved_bytes


def uniform(num_layers: int, num_stages: int, constraints: Constraints | None = None) -> list[int]:
    """Equal numbers of layers per stage (sizes differ by at most one where the constraints allow)."""
    count = segment_matrix(np.ones(num_layers))
    return _split(count, num_stages, constraints, spread=count ** 2)


def params(param_bytes: Sequence[float] | np.ndarray, num_stages: int,
           constraints: Constraints | None = None) -> list[int]:
    """Balanced parameter bytes (ColossalAI's "balanced"): the smallest largest stage."""
    return _split(segment_matrix(param_bytes), num_stages, constraints)


def time(costs: Sequence[float] | np.ndarray, num_stages: int, constraints: Constraints | None = None,
         tolerance: float = 0.01) -> list[int]:
    """Balanced time: the smallest slowest stage for per-layer ``costs`` (forward + backward seconds);
    splits within ``tolerance`` of it count as tied and the one with the smallest cuts wins."""
    return _split(segment_matrix(costs), num_stages, constraints, tolerance)


def memory(costs: Sequence[float] | np.ndarray, param_bytes: Sequence[float] | np.ndarray,
           saved_bytes: Sequence[float] | np.ndarray, num_stages: int, memory_limit: float,
           inflight: Sequence[int], optimizer_state_factor: float = 2,
           constraints: Constraints | None = None, tolerance: float = 0.01) -> list[int]:
    """Like ``time``, but every stage's ``stage_memory`` must be at most ``memory_limit`` bytes.

    ``inflight[k]``: micro-batches whose activations stage k holds at once (1F1B: ``num_stages - k``;
    F-then-B: all of them). ``ValueError`` naming the limit and the smallest achievable peak when no
    split fits.
    """
    if len(inflight) != num_stages:
        raise ValueError(f"inflight has {len(inflight)} entries for num_stages={num_stages}")
    p_seg, s_seg = segment_matrix(param_bytes), segment_matrix(saved_bytes)
    n = p_seg.shape[0] - 1
    held = stage_memory(p_seg[None], s_seg[None], np.asarray(inflight, np.float64)[:, None, None],
                        optimizer_state_factor)
    floor = _min_max(held, _feasible(n, num_stages, constraints))
    if floor > memory_limit:
        raise ValueError(
            f"memory_limit {memory_limit:.0f} bytes ({human_bytes(memory_limit)}) is too small: no split of the "
            f"{n} layers into {num_stages} stages fits; the smallest achievable per-device peak is {floor:.0f} "
            f"bytes ({human_bytes(floor)}) (parameters x (optimizer_state_factor + 1) + in-flight micro-batches "
            "x saved activations)")
    return _split(segment_matrix(costs), num_stages, constraints, tolerance, fits=held <= memory_limit)


def _feasible(n: int, num_stages: int, c: Constraints | None) -> np.ndarray:
    """``F[k, i, j]``: stage k may hold layers i .. j-1 (non-empty, no required start strictly inside,
    every layer allowed on k)."""
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages must be between 1 and the number of layers ({n}), got {num_stages}")
    c = c or Constraints()
    i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    ok = np.broadcast_to(i < j, (num_stages, n + 1, n + 1)).copy()
    bad = [r for r in c.required if not 0 <= r < n]
    if bad:
        raise ValueError(f"required stage starts {bad} are not layers (0 .. {n - 1})")
    if c.required:
        starts = np.zeros(n + 2)
        starts[list(c.required)] = 1
        before = np.concatenate([[0.0], np.cumsum(starts)])  # before[x]: required starts < x
        inside = before[i + 1] < before[j]  # a required start in i+1 .. j-1
        ok &= ~inside
    if c.allowed is not None:
        allowed = np.asarray(c.allowed, bool)
        if allowed.shape != (num_stages, n):
            raise ValueError(f"allowed has shape {allowed.shape}, expected (num_stages, num_layers) = "
                             f"{(num_stages, n)}")
        banned = np.concatenate([np.zeros((num_stages, 1)), np.cumsum(~allowed, axis=1)], axis=1)
        ok &= (banned[:, None, :] - banned[:, :, None]) == 0
    return ok


def _min_max(cost: np.ndarray, feasible: np.ndarray) -> float:
    """The smallest achievable largest stage cost (inf when no split is feasible)."""
    cost = np.broadcast_to(cost, feasible.shape)
    n = feasible.shape[-1] - 1
    best = np.where(feasible[0, 0], cost[0, 0], np.inf)  # best[j]: first k + 1 stages end before layer j
    for k in range(1, feasible.shape[0]):
        best = np.where(feasible[k], np.maximum(best[:, None], cost[k]), np.inf).min(axis=0)
    return float(best[n])


def _split(cost: np.ndarray, num_stages: int, constraints: Constraints | None, tolerance: float = 0.0,
           spread: np.ndarray | None = None, fits: np.ndarray | None = None) -> list[int]:
    """Pass 1: the optimal largest stage cost. Pass 2: among splits within ``tolerance`` of it, the
    smallest sum of ``spread`` over stages (``uniform``'s squared sizes), then the smallest cut bytes."""
    n = cost.shape[-1] - 1
    feasible = _feasible(n, num_stages, constraints)
    if fits is not None:
        feasible &= fits
    peak = _min_max(cost, feasible)
    if not np.isfinite(peak):
        raise ValueError(f"no split of the {n} layers into {num_stages} stages satisfies the constraints "
                         "(guarded ops stay on their device's stage, split points start a stage, no stage "
                         "is empty)")
    within = feasible & (np.broadcast_to(cost, feasible.shape) <= peak * (1 + tolerance) + EPS * abs(peak))
    spread = np.zeros((n + 1, n + 1)) if spread is None else spread
    cut = np.zeros(n + 1) if constraints is None or constraints.cut_bytes is None else np.asarray(
        constraints.cut_bytes, np.float64)
    first = np.where(within[0, 0], spread[0], np.inf)  # lexicographic (spread, cut bytes) per end layer
    second = np.zeros(n + 1)
    choices = []
    for k in range(1, num_stages):
        a = np.where(within[k], first[:, None] + spread, np.inf)
        best_a = a.min(axis=0)
        b = np.where(within[k] & (a <= best_a + EPS * np.abs(best_a)), second[:, None] + cut[:, None], np.inf)
        choice = b.argmin(axis=0)
        first, second = best_a, b[choice, np.arange(n + 1)]
        choices.append(choice)
    bounds = [n]
    for choice in reversed(choices):
        bounds.append(int(choice[bounds[-1]]))
    return [0] + bounds[::-1]
