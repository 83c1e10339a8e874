"""Checkpoints of pipelined programs in Paddle's own formats: replaced atomically, verified before they
are applied, loaded without running code.

A checkpoint is a directory:
- ``model.pdparams``: the parameters, ``{name: ndarray}`` pickled (protocol 4) as ``paddle.static.save``
  writes them, so ``paddle.static.load(program, "<dir>/model")`` loads it into the single-device program;
- ``model.pdopt``: the optimizer state (accumulators, the learning-rate variable) in the same form;
- ``meta.json``: ``format`` (2), ``step`` (the global step), ``lr_scheduler`` (the scheduler's
  ``state_dict``, or null) and ``files``: each of the two files above as ``{"sha256": hex, "bytes": size}``
  (a ``files`` without ``model.pdopt`` would mean a checkpoint without optimizer state); where
  ``train_from_dataset`` wrote it, also ``data``: where each process's data stood, in rank order
  (``train/resume.py``), and ``job``: the id of the launch that wrote it (null outside one).
A directory without ``meta.json``, as ``paddle.static.save(program, "<dir>/model")`` writes it, loads too:
as step 0, both files required, without checksums to verify.

Why this shape: a save replaces the directory through ``atomic.atomic_directory``, so a crash at any moment
leaves the previous checkpoint or the new one whole, and nothing it did not create is touched. A load is
all or nothing: it reads and checks every file (present, of the size and sha256 ``meta.json`` recorded,
nothing but arrays inside, unpickled without running code; see ``pickled_arrays``), ``meta.json`` field
by field, and every variable (each parameter and optimizer state of the program present, none unknown,
shapes and dtypes as the program declares) before it changes any state.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import warnings
from dataclasses import asdict
from typing import Any, Protocol

from . import pickled_arrays
from ._paddle import framework, np, paddle
from .atomic import atomic_directory, recover_directory
from .io.position import Position
from .ir import np_dtype, program_view
from .placement import launched_world
from .plan import plan_of
from .runtime.paddle_io import stale
from .restarts import META



class StateHolder(Protocol):
    """What saving and loading a checkpoint use of an executor (``staticpipe.Executor`` is one): the step
    count, every stage's state gathered in one place, and state given back to the stages."""

    global_step: int

    def gathered_state_dict(self, program: framework.Program) -> dict[str, np.ndarray] | None: ...

    def gathered_positions(self, program: framework.Program, mine: dict | None) -> list[dict | None] | None: ...

    def set_state_dict(self, program: framework.Program, values: dict[str, Any], strict: bool = True) -> None: ...

PARAMS, OPT = "model.pdparams", "model.pdopt"  # META: restarts' (the launcher reads it without Paddle)
FORMAT = 2  # 2: sha256 and size of every file in meta.json
WHAT = "a checkpoint"


def _state_vars(program: framework.Program) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(parameters, other persistable state) of ``program``, each name -> (shape, numpy dtype name)."""
    program = program_view(program)
    params = {p.name: (tuple(p.shape), np_dtype(p)) for p in program.global_block().all_parameters()}
    others = {v.name: (tuple(v.shape), np_dtype(v)) for v in program.list_vars()
              if v.persistable and v.name not in params and "@GRAD" not in v.name
              and v.type == framework.core.VarDesc.VarType.LOD_TENSOR}
    return params, others


def save(program: framework.Program, path: str, exe: StateHolder, step: int | None = None, loader: Any = None,
         data: dict[str, Any] | None = None, job: str | None = None) -> bool:
    """Write every parameter and optimizer state of ``program`` (gathered from all stages) to the directory
    ``path``, with the global step (default: the executor's) and the learning-rate scheduler's state,
    replacing a checkpoint already there. An existing ``path`` that is a file, a symbolic link, or a
    non-empty directory without ``meta.json`` is refused before anything moves.

    In a job of several processes every process calls it: the ranks of the first replica send their
    stages' state to rank 0, which alone writes (``path`` must be where every rank can read it back).
    ``loader``: record where its data stands (``DataLoader.position()``), every process its own loader's;
    ``data`` (``train_from_dataset``'s): such a position as JSON values; ``job``: the launch writing it.
    Returns whether this process wrote."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"step must be an integer >= 0 (or None: the executor's global step), got {step!r}")
    step = exe.global_step if step is None else step
    if loader is not None:
        if data is not None:
            raise ValueError("save takes a loader or data (a position), not both")
        data = asdict(loader.position())
    state = exe.gathered_state_dict(program)
    positions = exe.gathered_positions(program, data)  # every process takes part, with a position or without
    if positions is not None and any(p is None for p in positions):
        if any(p is not None for p in positions):
            raise ValueError(f"save: processes {[r for r, p in enumerate(positions) if p is None]} gave no loader "
                             f"(or data) and {[r for r, p in enumerate(positions) if p is not None]} did: every "
                             "process gives its own loader, or none does")
        positions = None
    if state is None:
        return False  # rank 0 writes
    params, others = _state_vars(program)
    scheduler = getattr(program, "lr_scheduler", None)
    with atomic_directory(path, META, WHAT) as tmp:
        files = {name: pickled_arrays.write(os.path.join(tmp, name), {n: state[n] for n in names if n in state})
                 for name, names in ((PARAMS, params), (OPT, others))}
        meta = {"format": FORMAT, "step": step,
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None, "files": files,
                "data": positions, "job": job}
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, default=_jsonable, indent=1)
    return True


def load(program: framework.Program, path: str, exe: StateHolder, loader: Any = None,
         with_position: bool = False) -> dict[str, Any]:
    """Load a checkpoint written by ``save`` (or by ``paddle.static.save`` into a directory layout) into
    every stage of ``program``; returns its meta data (``step``, ``lr_scheduler``, ``files``, ``data``).
    ``loader``: it goes on where this process's data stood (``DataLoader.resume_from``), and the meta data's
    ``position`` is that ``Position`` (its ``epoch``: the epoch to go on with; ``ended``: the one after);
    ``with_position``: the meta data's ``position`` too (None if the checkpoint records none).

    Nothing changes unless everything fits: a missing, truncated or altered file, a corrupt ``meta.json``,
    a pickle naming anything but numpy's arrays, or a checkpoint of another program (the lists of missing,
    unexpected, mis-shaped and mis-typed variables) raises first. A ``meta.json`` that lists no
    ``model.pdopt`` means a checkpoint without optimizer state: the parameters load, the optimizer keeps
    its own."""
    recover_directory(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}" + (": it is a file, a checkpoint is a directory"
                                                                 if os.path.exists(path) else ""))
    meta = _read_meta(os.path.join(path, META))
    files = list(meta["files"]) if "files" in meta else [PARAMS, OPT]
    state: dict[str, np.ndarray] = {}
    for name in files:
        state.update(_read_verified(path, name, meta.get("files")))
    params, others = _state_vars(program)
    known = {**params, **others}
    _check_fits(path, state, known, known if OPT in files else params)
    position = own_position(meta, path) if loader is not None or with_position else None
    if loader is not None and position is None:
        raise ValueError(f"checkpoint {path!r} records no data position: it was saved without a loader")
    scheduler = getattr(program, "lr_scheduler", None)
    restore = scheduler is not None and meta["lr_scheduler"] is not None
    if restore:
        set_scheduler(copy.deepcopy(scheduler), meta["lr_scheduler"], os.path.join(path, META))  # a trial
    exe.set_state_dict(program, state, strict=False)
    if restore:
        set_scheduler(scheduler, meta["lr_scheduler"], os.path.join(path, META))
    exe.global_step = meta["step"]
    if loader is not None:
        loader.resume_from(position)
    if loader is not None or with_position:
        meta["position"] = position
    return meta


def own_position(meta: dict[str, Any], path: str) -> Position | None:
    """Where this process's data stood in the checkpoint at ``path`` with meta data ``meta`` (None if it
    records none); one written by another number of processes is refused."""
    positions = meta.get("data")
    if positions is None:
        return None
    rank, size = launched_world() or (0, 1)
    if len(positions) != size:
        raise ValueError(f"checkpoint {path!r} records where the data of {len(positions)} process(es) stood; this job "
                         f"has {size}: resume it with as many processes, or load it with staticpipe.load and "
                         "continue the data yourself")
    return Position.from_json(positions[rank], os.path.join(path, META))


def _read_meta(file: str) -> dict[str, Any]:
    """``meta.json`` checked field by field; ``{"step": 0, "lr_scheduler": None}`` where there is none."""
    if not os.path.exists(file):
        return {"step": 0, "lr_scheduler": None}
    meta = read_json(file)
    problem = _meta_problem(meta)
    if problem:
        raise ValueError(f"{file!r} is not the meta data of a staticpipe checkpoint of format {FORMAT}: {problem}")
    return meta


def _meta_problem(meta: dict[str, Any]) -> str | None:
    step, files = meta.get("step"), meta.get("files")
    if meta.get("format") != FORMAT:
        return f"its format is {meta.get('format')!r}"
    if type(step) is not int or step < 0:
        return f"its step {step!r} is not a count of steps"
    if "lr_scheduler" not in meta:
        return "it has no lr_scheduler"
    if not isinstance(meta["lr_scheduler"], (dict, type(None))):
        return f"its lr_scheduler {meta['lr_scheduler']!r} is neither a state dict nor null"
    if not isinstance(meta.get("data"), (list, type(None))) or not all(isinstance(d, dict) for d in meta.get("data") or ()):
        return "its data is neither a list of the ranks' data positions nor null"
    if not isinstance(files, dict) or PARAMS not in files or not set(files) <= {PARAMS, OPT} or not all(
            isinstance(f, dict) and isinstance(f.get("sha256"), str) and type(f.get("bytes")) is int
            for f in files.values()):
        return (f"its files {files!r} do not give {PARAMS} (and {OPT}, if the checkpoint has optimizer state) "
                "with their sha256 and bytes")
    return None


def _read_verified(path: str, name: str, files: dict[str, Any] | None) -> dict[str, np.ndarray]:
    """The arrays of the file ``name``, after checking it against ``meta.json``'s ``files`` (when there are)."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        listed = "meta.json lists it" if files is not None else "a checkpoint without meta.json has both files"
        raise FileNotFoundError(f"checkpoint {path!r} is incomplete: {file!r} is missing ({listed})")
    if files is not None:
        check_digest(file, name, files, META)
    return pickled_arrays.read(file)


def read_json(file: str) -> dict[str, Any]:
    """The JSON object ``file`` holds; ``ValueError`` naming it when it is truncated, corrupt or no object
    (shared with saved plans: ``meta.json`` and ``plan.json``)."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file!r} is corrupt: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file!r} is corrupt: it holds a JSON {type(data).__name__}, not an object")
    return data


def check_digest(file: str, name: str, files: dict[str, Any], manifest: str) -> None:
    """Refuse ``file`` unless it has the size and sha256 that ``manifest`` records for ``name`` in ``files``
    (``{name: {"sha256": hex, "bytes": size}}``, as checkpoints and saved plans record their files); a file
    with another listed file's size and sha256 is named as that one (moved or swapped)."""
    found = pickled_arrays.digest(file)
    recorded = {n: {"sha256": r["sha256"], "bytes": r["bytes"]} for n, r in files.items()}
    if found == recorded[name]:
        return
    twin = next((n for n, r in recorded.items() if r == found), None)
    if twin is not None:
        raise ValueError(f"{file!r} is not the file {manifest} records as {name}: it has the size and sha256 "
                         f"{manifest} records for {twin} (files moved or swapped)")
    raise ValueError(f"{file!r} is corrupt: it has {found['bytes']} bytes with sha256 {found['sha256']}, "
                     f"but {manifest} recorded {recorded[name]['bytes']} bytes with sha256 {recorded[name]['sha256']}")


def _check_fits(path: str, state: dict[str, np.ndarray], known: dict[str, tuple], required: dict[str, tuple]
               ) -> None:
    """Every ``required`` variable present, none that is not ``known``, each of its (shape, dtype)."""
    missing = sorted(n for n in required if n not in state)
    unexpected = sorted(n for n in state if n not in known)
    shapes = sorted(f"{n}: checkpoint {list(state[n].shape)}, program {list(known[n][0])}"
                    for n in state if n in known and not _fits(state[n].shape, known[n][0]))
    dtypes = sorted(f"{n}: checkpoint {state[n].dtype}, program {known[n][1]}"
                    for n in state if n in known and str(state[n].dtype) != known[n][1])
    if missing or unexpected or shapes or dtypes:
        raise ValueError(f"checkpoint {path!r} does not match the program: missing {missing or 'none'}; "
                         f"unexpected {unexpected or 'none'}; wrong shapes {shapes or 'none'}; "
                         f"wrong dtypes {dtypes or 'none'}")


def _fits(got: tuple, want: tuple) -> bool:
    if int(np.prod(got)) == 1 and all(w in (-1, 1) for w in want):
        return True  # a scalar stored as [1] (Paddle sets learning rates that way) fits shape []
    return len(got) == len(want) and all(w in (-1, g) for g, w in zip(got, want))


def set_scheduler(scheduler: Any, state: dict[str, Any], meta_file: str) -> None:
    """``scheduler`` in ``state`` (a checkpoint's, from ``meta_file``); ``ValueError`` if it does not fit."""
    try:
        with warnings.catch_warnings():  # nested schedulers (LinearWarmup) warn about their own keys
            warnings.simplefilter("ignore")
            scheduler.set_state_dict(state)
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{meta_file!r}: its lr_scheduler state does not fit the program's "
                         f"{type(scheduler).__name__}: {exc}") from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's meta data")


# --- Paddle's own calls that read or write ``global_scope()`` without the executor ----------------------
SET_PROGRAM_STATE = ("paddle.static.set_program_state(program, state_dict) writes paddle.static.global_scope(), "
                     "which the stages of a pipelined program never read: it would change nothing. Use "
                     "exe.set_state_dict(program, state_dict) (the staticpipe.Executor), or staticpipe.load(program, "
                     "dir, exe) for a checkpoint directory")
LOAD = ("paddle.static.load(program, path[, executor]) loads into paddle.static.global_scope(), which the stages "
        "of a pipelined program never read, and takes Paddle's own executor only: use staticpipe.load(program, dir, "
        "exe) (dir holding model.pdparams and model.pdopt, as paddle.static.save(program, dir + '/model') writes "
        "them), or exe.set_state_dict(program, paddle.static.load_program_state(path))")
SAVE = ("paddle.static.save(program, {path!r}) writes what paddle.static.global_scope() holds, not the stages of a "
        "pipelined program, and {why}: call exe.flush() right before it (every rank; it returns True where the "
        "whole model then is), or use staticpipe.save(program, dir, exe)")


def _set_program_state(original: Any, program: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
    if plan_of(program) is not None:
        raise RuntimeError(SET_PROGRAM_STATE)
    return original(program, state_dict, *args, **kwargs)


def _load(original: Any, program: Any, model_path: Any, executor: Any = None, *args: Any, **kwargs: Any) -> Any:
    if plan_of(program) is not None:
        raise RuntimeError(LOAD)
    if not (executor is None or isinstance(executor, paddle.static.Executor)):  # Paddle asserts it, wordlessly
        raise TypeError(f"paddle.static.load(program, path, executor) takes Paddle's own executor "
                        f"(paddle.static.Executor), got {type(executor).__module__}.{type(executor).__name__}: for "
                        "a program a staticpipe.Executor pipelines, use staticpipe.load(program, dir, exe)")
    return original(program, model_path, executor, *args, **kwargs)


def _save(original: Any, program: Any, model_path: Any, *args: Any, **kwargs: Any) -> Any:
    if (plan := plan_of(program)) is not None and (why := stale(plan, paddle.static.global_scope())):
        raise RuntimeError(SAVE.format(path=model_path, why=why))
    return original(program, model_path, *args, **kwargs)


def _fronted(front: Any, original: Any) -> Any:
    @functools.wraps(original)
    def api(*args: Any, **kwargs: Any) -> Any:
        return front(original, *args, **kwargs)
    api.__staticpipe_front__ = original
    return api


def front_paddle_calls() -> None:
    """Front ``paddle.static.set_program_state``, ``load`` and ``save`` (wherever Paddle exports them) for
    pipelined programs: the first two are refused (they would write a ``global_scope()`` no stage reads),
    ``save`` unless ``global_scope()`` holds the current state (``exe.flush()``). Idempotent."""
    fronts = {"set_program_state": _set_program_state, "load": _load, "save": _save}
    modules = [getattr(paddle, "static", None), getattr(getattr(paddle, "static", None), "io", None),
               getattr(getattr(paddle, "base", None), "io", None)]
    for name, front in fronts.items():
        original = getattr(paddle.static, name)
        original = getattr(original, "__staticpipe_front__", original)
        api = _fronted(front, original)
        for module in modules:
            if module is not None and getattr(getattr(module, name, None), "__staticpipe_front__", getattr(
                    module, name, None)) is original:
                setattr(module, name, api)

