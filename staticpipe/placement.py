"""Where things run: device strings, the guard that tags ops with them, and the Paddle place of each.

A device string names where a stage runs: "cpu", "gpu" (the same as "gpu:0") or "gpu:k". Paddle's own
``device_guard`` writes the string into each op's ``op_device`` attribute; staticpipe's guard checks and
normalises the string first, so that the rewrite never meets a spelling it does not understand.

"gpu:k" is ``CUDAPlace(k)`` when Paddle is built with CUDA and device k exists; without CUDA every stage
becomes a CPU "device": its own worker thread, scope and intra-op thread budget on ``CPUPlace``. In a job
of several processes (``launched_world``) a process runs its "gpu:k" stages on the GPU its launcher
selected.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Iterator

from ._paddle import OP_DEVICE, core, framework, paddle
from .pir_ir import SPLIT_POINTS as PIR_SPLIT_POINTS
from .pir_ir import guarded, is_pir_program, pir_mode

log = logging.getLogger("staticpipe")
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


ALL_DEVICES = "gpu:all"  # Paddle's guard for ops every stage that needs their output may run


def op_device(op: framework.Operator) -> str | None:
    """The normalised device an op's ``op_device`` tag names (a legacy op, or a PIR operation, which
    ``device_guard`` tags itself), or None for an untagged op and for one tagged ``"gpu:all"``: both are
    stage-free, and go where their inputs and readers put them."""
    if not op.has_attr(OP_DEVICE):
        return None
    dev = op.str_attr(OP_DEVICE) if hasattr(op, "str_attr") else op.attr(OP_DEVICE)  # a PIR operation, or legacy
    return str(parse_device(dev)) if dev and dev.strip().lower() != ALL_DEVICES else None


@contextlib.contextmanager
def device_guard(device: str) -> Iterator[Device | None]:
    """Tag every op created inside the block with ``device``; the innermost guard wins.

    >>> with staticpipe.device_guard("gpu:1"):
    ...     logits = paddle.static.nn.fc(h, 10)

    ``"gpu:all"`` is Paddle's: ops every stage that reads their output may run (a scaled learning rate, a
    constant). They are stage-free, as unguarded ops are: a forward op runs on the first stage that
    needs its value (after its inputs' stages) and the value is sent to later readers with the
    micro-batch; an optimizer-phase op runs on every stage that needs it. The guard yields None.
    """
    if isinstance(device, str) and device.strip().lower() == ALL_DEVICES:
        with paddle.static.device_guard(ALL_DEVICES):
            if pir_mode():
                with guarded(paddle.static.default_main_program().global_block(), ALL_DEVICES):
                    yield None
            else:
                yield None
        return
    parsed = parse_device(device)
    with paddle.static.device_guard(str(parsed)):
        if pir_mode():  # Paddle's guard records nothing on PIR ops: staticpipe tags them itself
            with guarded(paddle.static.default_main_program().global_block(), str(parsed)):
                yield parsed
        else:
            yield parsed


SPLIT_POINTS = PIR_SPLIT_POINTS  # Program attribute: op indices where a new stage starts (PIR: the ops before)


def split_point(program: "paddle.static.Program | None" = None) -> None:
    """Start a new stage here even if the device stays the same.

    Schedules with several chunks per device (interleaved, ZB-V) cut the program into a new stage at
    every change of device; a V layout puts two consecutive stages on one device (gpu:0, gpu:1, gpu:1,
    gpu:0), which only a split point can separate. Schedules with one stage per device ignore it.
    """
    program = program if program is not None else paddle.static.default_main_program()
    if is_pir_program(program):  # an index would shift (parameter ops go to the block's start): the last op
        ops = program.global_block().ops
        anchors = getattr(program, SPLIT_POINTS, [])
        anchors.append(ops[-1] if ops else None)
        setattr(program, SPLIT_POINTS, anchors)
        return
    if not isinstance(program, framework.Program):
        raise ValueError(f"split_point(program) takes a paddle.static.Program (or None: the default main "
                         f"program), got {type(program).__name__}: {program!r}")
    points = getattr(program, SPLIT_POINTS, set())
    points.add(len(program.global_block().ops))
    setattr(program, SPLIT_POINTS, points)


def clone_with_split_points(program: "paddle.static.Program", for_test: bool = False) -> "paddle.static.Program":
    """``program.clone(for_test)`` (legacy IR) keeping its split points, which Paddle's clone does not copy
    (they are an attribute of the Python object); the forward op indices they name are kept by a clone."""
    twin = program.clone(for_test=for_test)
    setattr(twin, SPLIT_POINTS, set(getattr(program, SPLIT_POINTS, ())))
    return twin


@contextlib.contextmanager
def split_points_kept(program: "paddle.static.Program") -> Iterator[None]:
    """Keep ``program``'s split points where they were while a pass inserts ops into it.

    A split point is an op index, and a pass such as AMP's (casts in front of the ops that read a
    parameter or an input) shifts the indices after each insertion; the point is kept just after the op
    it followed, so what the pass inserted there starts the new stage with the op it was inserted for."""
    points = getattr(program, SPLIT_POINTS, None)
    if not points:
        yield
        return
    ops = list(program.global_block().ops)
    anchors = [ops[i - 1] if 0 < i <= len(ops) else i for i in points]  # an index for the ends
    yield
    position = {id(op): k for k, op in enumerate(program.global_block().ops)}
    setattr(program, SPLIT_POINTS, {a if isinstance(a, int) else position[id(a)] + 1 for a in anchors})


# --- places -----------------------------------------------------------------------------------------
_warned = False


def cuda_device_count() -> int:
    return core.get_cuda_device_count() if core.is_compiled_with_cuda() else 0


def process_gpu() -> int | None:
    """The GPU a launcher gave this process (``FLAGS_selected_gpus``, set by ``paddle.distributed.launch``
    and ``staticpipe.launch`` on a CUDA machine), or None."""
    selected = os.environ.get("FLAGS_selected_gpus", "")
    return int(selected.split(",")[0]) if selected else None


def launched_world() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by a launcher with more than one process."""
    size = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    return (int(os.environ.get("PADDLE_TRAINER_ID", "0")), size) if size > 1 else None


def default_device(world: tuple[int, int] | None, selected: int | None) -> str:
    """The device an ``Executor`` without a place runs unsplit programs and gathers state on: in a launched
    job, the GPU the launcher selected for this rank (Paddle's launched executors run there too), so that
    ranks do not all crowd GPU 0; else "gpu:0" (the CPU without CUDA)."""
    return f"gpu:{selected}" if world is not None and selected is not None else "gpu:0"


def transfer_device(backend: str, selected: int | None) -> str:
    """Where a launched rank's messages travel from: under NCCL its own GPU (the launcher's selection),
    whatever its stages' devices -- NCCL moves device memory only, so a "cpu" stage's values go through
    the rank's GPU, as Paddle's GPU pipeline sends from the rank's device; under gloo host memory ("cpu")."""
    if str(backend).upper() != "NCCL":
        return "cpu"
    if selected is None:
        raise ValueError("an NCCL job's rank has no GPU of its own: its launcher sets FLAGS_selected_gpus "
                         "(paddle.distributed.launch, or staticpipe.launch on a CUDA machine)")
    return f"gpu:{selected}"


def connects_lazily(backend: str) -> bool:
    """Whether a new process group's communicator is only made at its first operation (NCCL; gloo connects
    in ``new_group``). Such groups are warmed up right after they are made, in the thread that made them
    and in the same order on every rank: made lazily, the first send from a sender thread would create it
    there, racing the other threads through Paddle's unlocked map of communicators."""
    return str(backend).upper() == "NCCL"


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
                        "(its own worker and thread budget on CPUPlace)")
            _warned = True
        return core.CPUPlace()
    if launched and process_gpu() is not None:
        return core.CUDAPlace(process_gpu())
    if dev.index >= count:
        raise ValueError(f"device {device!r} does not exist: CUDA reports {count} GPU(s) (gpu:0..gpu:{count - 1}); "
                         f"run it on another with Executor(device_map={{{device!r}: 'gpu:0'}}) or "
                         f"{DEVICE_MAP_ENV}={device}=gpu:0")
    return core.CUDAPlace(dev.index)


def executor_place(place: object) -> core.Place:
    """The place of a ``staticpipe.Executor``'s unsplit programs, from what ``paddle.static.Executor``
    accepts: a Paddle place, a device string or None (the process's default device)."""
    if place is None:
        return place_of(default_device(launched_world(), process_gpu()), launched=launched_world() is not None)
    if isinstance(place, str):
        return place_of(str(parse_device(place)))
    if isinstance(place, (core.Place, core.CPUPlace, core.CUDAPlace, core.CUDAPinnedPlace)):
        return place
    raise ValueError(f"place must be a Paddle place (paddle.CPUPlace(), paddle.CUDAPlace(k)), a device string "
                     f"('cpu', 'gpu', 'gpu:k') or None, got {type(place).__name__}: {place!r}")


DEVICE_MAP_ENV = "STATICPIPE_DEVICE_MAP"  # "gpu:1=gpu:0,gpu:3=gpu:1": run these pipeline devices elsewhere


def device_map(mapping: dict[str, str] | None = None) -> dict[str, str]:
    """Which device runs each pipeline device named in ``mapping`` (``{"gpu:1": "gpu:0"}``: the stages
    guarded "gpu:1" run on GPU 0, still on a worker of their own), or else in the environment variable
    ``STATICPIPE_DEVICE_MAP`` ("gpu:1=gpu:0,gpu:2=gpu:0"). Both sides are device strings, normalised;
    ``ValueError`` names the entry at fault."""
    source = "device_map"
    if mapping is None:
        text = os.environ.get(DEVICE_MAP_ENV, "").strip()
        if not text:
            return {}
        source, mapping = DEVICE_MAP_ENV, {}
        for entry in text.split(","):
            if entry.count("=") != 1:
                raise ValueError(f"{DEVICE_MAP_ENV}={text!r}: entry {entry!r} is not 'device=device' (e.g. gpu:1=gpu:0)")
            key, value = entry.split("=")
            mapping[key.strip()] = value.strip()
    if not isinstance(mapping, dict):
        raise ValueError(f"device_map must be a dict {{pipeline device: device}}, got {type(mapping).__name__}")
    parsed = {}
    for key, value in mapping.items():
        try:
            parsed[str(parse_device(key))] = str(parse_device(value))
        except ValueError as exc:
            raise ValueError(f"{source} entry {key!r}: {value!r}: {exc}") from None
    return parsed


def generic_place(place: core.Place) -> core.Place:
    """``core.Place`` wrapper that the C++ executor and tensor copies take."""
    p = core.Place()
    p.set_place(place)
    return p
