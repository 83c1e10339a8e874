"""Checkpoints of pipelined programs in Paddle's own formats, written atomically.

A checkpoint is a directory:
- ``model.pdparams``: the parameters, ``{name: ndarray}`` pickled as ``paddle.static.save`` writes them,
  so ``paddle.static.load(program, "<dir>/model")`` loads it into the single-device program too;
- ``model.pdopt``: the optimizer state (accumulators, the learning-rate variable) in the same form;
- ``meta.json``: the global step and the learning-rate scheduler's state.

Why a directory replaced in one rename: a save writes ``<dir>.tmp`` completely, moves the old
checkpoint aside, renames the new one into place, then deletes the old one. A crash at any point
leaves either the old or the new checkpoint whole, and ``load`` recovers the moved-aside one.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import warnings
from typing import TYPE_CHECKING, Any, Iterator

from ._paddle import framework, np

if TYPE_CHECKING:
    from .executor import Executor

PARAMS, OPT, META = "model.pdparams", "model.pdopt", "meta.json"


def _state_names(program: framework.Program) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(parameters, other persistable state) of ``program``, each name -> shape."""
    params = {p.name: tuple(p.shape) for p in program.global_block().all_parameters()}
    others = {v.name: tuple(v.shape) for v in program.list_vars()
              if v.persistable and v.name not in params and "@GRAD" not in v.name
              and v.type == framework.core.VarDesc.VarType.LOD_TENSOR}
    return params, others


def save(program: framework.Program, path: str, exe: "Executor", step: int | None = None) -> bool:
    """Write every parameter and optimizer state of ``program`` (gathered from all stages) to ``path``,
    with the global step (default: the executor's) and the learning-rate scheduler's state.

    In a job of several processes every process calls it: the ranks of the first replica send their
    stages' state to rank 0, which alone writes (``path`` must be where every rank can read it back).
    Returns whether this process wrote."""
    step = exe.global_step if step is None else step
    state = exe.gathered_state_dict(program)
    if state is None:
        return False  # rank 0 writes
    params, others = _state_names(program)
    with atomic_directory(path) as tmp:
        for name, names in ((PARAMS, params), (OPT, others)):
            with open(os.path.join(tmp, name), "wb") as f:
                pickle.dump({n: state[n] for n in names if n in state}, f, protocol=4)
        scheduler = getattr(program, "lr_scheduler", None)
        meta = {"step": step, "lr_scheduler": scheduler.state_dict() if scheduler is not None else None}
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, default=_jsonable)
    return True


def load(program: framework.Program, path: str, exe: "Executor") -> dict[str, Any]:
    """Load a checkpoint written by ``save`` (or by ``paddle.static.save`` into a directory layout) into
    every stage of ``program``; returns its meta data (``step``). A checkpoint of another program is
    refused with the list of missing, unexpected and mis-shaped variables."""
    recover_directory(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    state: dict[str, np.ndarray] = {}
    for name in (PARAMS, OPT):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file, "rb") as f:
                state.update(pickle.load(f))
    params, others = _state_names(program)
    expected = {**params, **others}
    missing = sorted(n for n in params if n not in state)
    unexpected = sorted(n for n in state if n not in expected)
    shapes = sorted(f"{n}: checkpoint {list(state[n].shape)}, program {list(expected[n])}"
                    for n in state if n in expected and not _fits(state[n].shape, expected[n]))
    if missing or unexpected or shapes:
        raise ValueError(f"checkpoint {path!r} does not match the program: missing {missing or 'none'}; "
                         f"unexpected {unexpected or 'none'}; wrong shapes {shapes or 'none'}")
    exe.set_state_dict(program, state, strict=False)
    meta = {"step": 0, "lr_scheduler": None}
    if os.path.exists(os.path.join(path, META)):
        with open(os.path.join(path, META)) as f:
            meta.update(json.load(f))
    scheduler = getattr(program, "lr_scheduler", None)
    if scheduler is not None and meta["lr_scheduler"] is not None:
        with warnings.catch_warnings():  # nested schedulers (LinearWarmup) warn about their own keys
            warnings.simplefilter("ignore")
            scheduler.set_state_dict(meta["lr_scheduler"])
    exe.global_step = meta["step"]
    return meta


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
    """Yield an empty ``<path>.tmp`` to write into; when the block ends, sync its files to disk and put
    it in the place of ``path``: the previous directory is moved aside first and deleted last, so a
    crash at any point leaves one of them whole (``recover_directory`` puts a moved-aside one back).
    If the block raises, ``path`` is left untouched."""
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    yield tmp
    for folder, _, files in os.walk(tmp):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def recover_directory(path: str) -> None:
    """Put back the previous directory if a save died after moving it aside (see ``atomic_directory``)."""
    if not os.path.exists(path) and os.path.exists(path + ".old"):
        os.rename(path + ".old", path)


def _fits(got: tuple, want: tuple) -> bool:
    if int(np.prod(got)) == 1 and all(w in (-1, 1) for w in want):
        return True  # a scalar stored as [1] (Paddle sets learning rates that way) fits shape []
    return len(got) == len(want) and all(w in (-1, g) for g, w in zip(got, want))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's meta data")
