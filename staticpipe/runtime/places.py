"""Where a stage's worker runs: a Paddle place for a device string.

"gpu:k" is CUDAPlace(k) when Paddle is built with CUDA and device k exists; without CUDA every stage
becomes a CPU "device": its own worker thread, scope and intra-op thread budget on CPUPlace.
"""
from __future__ import annotations

import logging
import os

from .._paddle import core
from ..placement import parse_device

log = logging.getLogger("staticpipe")
_warned = False


def cuda_device_count() -> int:
    return core.get_cuda_device_count() if core.is_compiled_with_cuda() else 0


def process_gpu() -> int | None:
    """The GPU a launcher gave this process (``FLAGS_selected_gpus``, set by ``paddle.distributed.launch``
    and ``staticpipe.launch`` on a CUDA machine), or None."""
    selected = os.environ.get("FLAGS_selected_gpus", "")
    return int(selected.split(",")[0]) if selected else None


def place_of(device: str, launched: bool = False) -> core.Place:
    """The Paddle place of ``device``; raises ``ValueError`` for a gpu index CUDA does not have.

    ``launched``: this process is one rank of a job of several. Its "gpu:k" then names a pipeline
    device, and the process runs it on the GPU its launcher selected (on another machine "gpu:1" may be
    that machine's only GPU, 0)."""
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
    if launched and process_gpu() is not None:
        return core.CUDAPlace(process_gpu())
    if dev.index >= count:
        raise ValueError(f"device {device!r} does not exist: CUDA reports {count} GPU(s) (gpu:0..gpu:{count - 1})")
    return core.CUDAPlace(dev.index)


def generic_place(place: core.Place) -> core.Place:
    """``core.Place`` wrapper that the C++ executor and tensor copies take."""
    p = core.Place()
    p.set_place(place)
    return p
