"""Devices and the guard that tags ops with them.

A device string names where a stage runs: "cpu", "gpu" (the same as "gpu:0") or "gpu:k". Paddle's own
``device_guard`` writes the string into each op's ``op_device`` attribute; staticpipe's guard checks and
normalises the string first, so that the rewrite never meets a spelling it does not understand.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

from ._paddle import paddle

_DEVICE_RE = re.compile(r"^(cpu|gpu)(?::([0-9]+))?$")
ACCEPTED_FORMS = '"cpu", "gpu", "gpu:k" (k = 0, 1, ...)'


@dataclass(frozen=True, order=True)
class Device:
    """A parsed device string: ``kind`` is "cpu" or "gpu"; ``index`` is the gpu ordinal (0 for cpu)."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"gpu:{self.index}"


def parse_device(device: str) -> Device:
    """Parse ``device``; raise ``ValueError`` naming it and the accepted forms when it is not one."""
    if not isinstance(device, str):
        raise ValueError(f"device must be a string such as {ACCEPTED_FORMS}, got {device!r}")
    m = _DEVICE_RE.match(device.strip().lower())
    if m is None or (m.group(1) == "cpu" and m.group(2) not in (None, "0")):
        raise ValueError(f"invalid device {device!r}: accepted forms are {ACCEPTED_FORMS}")
    kind, index = m.group(1), int(m.group(2) or 0)
    return Device(kind, 0 if kind == "cpu" else index)


@contextlib.contextmanager
def device_guard(device: str) -> Iterator[Device]:
    """Tag every op created inside the block with ``device``; the innermost guard wins.

    >>> with staticpipe.device_guard("gpu:1"):
    ...     logits = paddle.static.nn.fc(h, 10)
    """
    parsed = parse_device(device)
    with paddle.static.device_guard(str(parsed)):
        yield parsed


SPLIT_POINTS = "_staticpipe_split_points"  # Program attribute: op indices where a new stage starts


def split_point(program: "paddle.static.Program | None" = None) -> None:
    """Start a new stage here even if the device stays the same.

    Schedules with several chunks per device (interleaved, ZB-V) cut the program into a new stage at
    every change of device; a V layout puts two consecutive stages on one device (gpu:0, gpu:1, gpu:1,
    gpu:0), which only a split point can separate. Schedules with one stage per device ignore it.
    """
    program = program if program is not None else paddle.static.default_main_program()
    points = getattr(program, SPLIT_POINTS, set())
    points.add(len(program.global_block().ops))
    setattr(program, SPLIT_POINTS, points)
