"""Message latency: the time a message between two ranks is in flight, occupying neither.

Why it is its own input and not an action's cost: across nodes a send returns at once and the
receiver can use the tensor only ``comm`` later; during that time both ranks are free to compute.
Priced as an action (a lowered SEND/RECV) it would occupy a rank; left out it makes a schedule that
waits on every message look as fast as one that hides them. The simulator and the planners that search
or squeeze take it as a function of the link, (source rank, destination rank) -> seconds; a message
within a rank costs nothing.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Mapping

Latency = Callable[[int, int], float]  # (source rank, destination rank) -> seconds in flight
Comm = None | float | Mapping[tuple[int, int], float] | Latency


def link_latency(comm: Comm, name: str = "comm") -> Latency | None:
    """``comm`` as a Latency, or None where every message is free (None or 0): then nothing changes.

    A number is every link's latency; a mapping {(source rank, destination rank): seconds} gives some
    links theirs (the others 0); a callable of the two ranks is used as it is. Errors name ``name`` and
    the value at fault."""
    if comm is None or callable(comm):
        return comm
    if is_seconds(comm):
        if not comm:
            return None
        seconds = float(comm)
        return lambda src, dst: seconds if src != dst else 0.0
    if isinstance(comm, Mapping):
        links = {}
        for link, seconds in comm.items():
            if not (isinstance(link, tuple) and len(link) == 2 and all(isinstance(r, int) for r in link)):
                raise ValueError(f"{name} keys must be (source rank, destination rank) pairs, got {link!r}")
            if not is_seconds(seconds):
                raise ValueError(f"{name}[{link!r}] must be seconds >= 0, got {seconds!r}")
            links[link] = float(seconds)
        if not any(links.values()):
            return None
        return lambda src, dst: links.get((src, dst), 0.0) if src != dst else 0.0
    raise ValueError(f"{name} must be seconds >= 0, a mapping {{(source rank, destination rank): seconds}} or a "
                     f"function of the two ranks, got {comm!r}")


def stage_lags(stage_ranks: Mapping[int, int] | list[int], num_stages: int,
               latency: Latency | None) -> tuple[list[float], list[float]]:
    """Per stage, the latency of its forward input (from stage s - 1) and of its backward input (from
    stage s + 1): what an F and a B wait beyond their producer's end. Zeros without a latency or where
    the neighbour is on the same rank (or missing)."""
    f_lag, b_lag = [0.0] * num_stages, [0.0] * num_stages
    if latency is None:
        return f_lag, b_lag
    rank = dict(stage_ranks) if isinstance(stage_ranks, Mapping) else dict(enumerate(stage_ranks))
    for s in range(num_stages):
        if s in rank and s - 1 in rank:
            f_lag[s] = _checked(latency(rank[s - 1], rank[s]), rank[s - 1], rank[s])
        if s in rank and s + 1 in rank:
            b_lag[s] = _checked(latency(rank[s + 1], rank[s]), rank[s + 1], rank[s])
    return f_lag, b_lag


def _checked(seconds: object, src: int, dst: int) -> float:
    if not is_seconds(seconds):
        raise ValueError(f"comm gives the link from rank {src} to rank {dst} {seconds!r}; it must be seconds >= 0")
    return float(seconds) if src != dst else 0.0


def is_seconds(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
