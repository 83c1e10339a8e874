"""Where a stage's worker runs: a Paddle place for a device string.

"gpu:k" is CUDAPlace(k) when Paddle is built with CUDA and device k exists; without CUDA every stage
becomes a CPU "device": its own worker thread, scope and intra-op thread budget on CPUPlace.
"""
from __future__ import annotations

import logging

from .._paddle import core
from ..placement import parse_device

log = logging.getLogger("staticpipe")
_warned = False


def cuda_device_count() -> int:
    return core.get_cuda_device_count() if core.is_compiled_with_cuda() else 0


def place_of(device: str) -> core.Place:
    """The Paddle place of ``device``; raises ``ValueError`` for a gpu index CUDA does not have."""
    global _warned
    dev = parse_device(device)
    if dev.kind == "cpu":
        return core.CPUPlace()
    count = cuda_device_count()
    if count == 0:
        if not _warned:
            log.warning("staticpipe: CUDA is not available; every gpu:k stage runs as a CPU device "
                        "(its own worker thread and thread budget on CPUPlace)")
            _warned = True
        return core.CPUPlace()
    if dev.index >= count:
        raise ValueError(f"device {device!r} does not exist: CUDA reports {count} GPU(s) (gpu:0..gpu:{count - 1})")
    return core.CUDAPlace(dev.index)


def generic_place(place: core.Place) -> core.Place:
    """``core.Place`` wrapper that the C++ executor and tensor copies take."""
    p = core.Place()
    p.set_place(place)
    return p
