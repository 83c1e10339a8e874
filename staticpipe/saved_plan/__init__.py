"""Exported stages (PipeDream's "model conversion"): a pipeline plan and its programs in a directory, from
which a process loads and runs its stages without the model code.

A saved plan directory holds:
- ``plan.json``: the format version, which names the programs' IR (``3``: legacy, ``"pir-3"``: PIR), and
  every field of the ``Plan`` (stages, devices, ranks, each section's feeds, keep list and routes, the cut
  variables with their shapes and dtypes, the schedule's name and action lists in text form, data variables
  and their specs, loss, shared parameters, notes, micro-batch size and count), the programs' random seeds
  and whether a scheduler file exists; of PIR programs, also what Paddle's format leaves out (``saved_pir.py``);
  and its manifest, the size and sha256 of every other file and of each of its own fields (``manifest.py``);
- ``stage-<s>/<kind>.pdmodel``: each section program as Paddle's serialized ``ProgramDesc`` (protobuf);
  PIR: ``stage-<s>/<kind>.json``, Paddle's PIR format (``saved_pir.py``);
- ``main.pdmodel``, ``startup.pdmodel`` (PIR: ``.json``): the whole single-device program (its data
  variables are the DataLoader's ``feed_list``; it is the reference ``verify`` trains) and the startup
  program that initialises every stage;
- ``lr_scheduler.pkl``: the learning-rate scheduler, when the optimizer has one.

Why one file per section: a rank reads only its own stages' files, so a machine needs only those
(and the main and startup programs), as PipeDream ships each worker its own stage. Why the IR in the format
version: a process builds and runs programs of one IR (Paddle 2.6 and Paddle 3's legacy-IR mode legacy ones,
Paddle 3 by default PIR ones), so a plan of the other IR is refused by name when its plan.json is read,
before any program is (and a staticpipe older than PIR plans refuses a ``"pir-2"`` as an unknown format).

Why the manifest: nothing is built from a file that is not as ``save_plan`` wrote it, and a refusal names
the file (and plan.json's field); ``manifest.py`` says what is checked, and why.
"""
from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import MISSING, fields
from typing import Any, Callable, Iterable, Mapping

from .._paddle import framework, paddle
from ..atomic import atomic_directory, recover_directory
from ..ir import is_pir_program
from ..memory_model import MemoryModel, StageMemory
from ..pickled_arrays import ALLOWED
from ..placement import launched_world
from ..plan import (OPTIMIZE, STARTUP_LINK, CutVar, Exchange, Plan, Route, Section, SectionRef, Stage, attach_plan,
                    plan_of, require_plan)
from ..rewrite import section_runs
from ..saved_pir import read_programs, section_reader, write_programs
from ..schedule import format_schedule, lower, parse_schedule
from ..schedule.actions import COMM_KINDS, Schedule
from .manifest import (FORMAT_VERSION, MAIN_FILE, PIR_FORMAT, PLAN_FILE, SCHEDULER_FILE, STARTUP_FILE, add_manifest,
                       check_comm_ops, check_plan, existing, needed_files, read_description, section_file,
                       verified_files)



# --- save -------------------------------------------------------------------------------------------
def save_plan(program: framework.Program, directory: str,
              startup_program: framework.Program | None = None) -> None:
    """Write the plan of ``program`` (rewritten by ``PipelineOptimizer.minimize``), its section programs,
    the main and startup programs and the learning-rate scheduler to ``directory``, replacing it
    atomically (as ``staticpipe.save`` does). ``startup_program``: the one given to ``minimize`` (default: the
    plan's own, which ``minimize`` and ``load_plan`` link to the main program).

    The scheduler (``program.lr_scheduler``) is pickled: its class, constructor arguments and progress
    all matter, and Paddle has no serialized form for it (its ``state_dict`` holds the progress only).
    Loading never runs code: the pickle may name only Paddle's scheduler classes (``paddle.optimizer.lr``)
    and numpy scalars, which ``save_plan`` checks before it writes anything.
    """
    plan = require_plan(program, "save_plan")
    startup = startup_program if startup_program is not None else getattr(program, STARTUP_LINK, None)
    startup = startup if startup is not None else paddle.static.default_startup_program()
    if plan_of(startup) is not plan:
        raise ValueError("startup_program is not the startup program of this plan: pass the startup program "
                         "given to minimize")
    if plan.sharding_degree > 1:
        raise ValueError(f"save_plan: this plan shards the optimizer state (sharding_degree {plan.sharding_degree}), "
                         "which a saved plan cannot record yet; save the checkpoint (staticpipe.save), or build the "
                         "plan again with sharding_degree=1 to save it")
    unloaded = [s.index for s in plan.stages if not s.loaded]
    if unloaded:
        raise ValueError(f"save_plan needs every stage's section programs, but stages {unloaded} were not loaded "
                         "in this process")
    scheduler = _pickled_scheduler(program)
    pir = is_pir_program(program)
    with atomic_directory(directory, PLAN_FILE, "a saved plan") as tmp:
        description = {"format": PIR_FORMAT if pir else FORMAT_VERSION, "plan": _encode_plan(plan),
                       "lr_scheduler": scheduler is not None,
                       "random_seeds": {"main": program.random_seed, "startup": startup.random_seed}}
        for stage in plan.stages:
            os.makedirs(os.path.join(tmp, f"stage-{stage.index}"))
        if pir:
            description["pir"] = write_programs(tmp, plan, program, startup)
        else:
            for stage in plan.stages:
                for kind, section in stage.sections.items():
                    _write(tmp, section_file(stage.index, kind), section.program.desc.serialize_to_string())
            _write(tmp, MAIN_FILE, program.desc.serialize_to_string())
            _write(tmp, STARTUP_FILE, startup.desc.serialize_to_string())
        if scheduler is not None:
            _write(tmp, SCHEDULER_FILE, scheduler)
        add_manifest(description, tmp)
        _write(tmp, PLAN_FILE, json.dumps(description, indent=1).encode())  # last: the manifest of the others


def _pickled_scheduler(program: framework.Program) -> bytes | None:
    scheduler = getattr(program, "lr_scheduler", None)
    if scheduler is None:
        return None
    try:
        data = pickle.dumps(scheduler, protocol=4)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(f"save_plan cannot pickle the learning-rate scheduler {type(scheduler).__name__}: "
                         f"{exc}; use a scheduler without lambdas or local functions") from exc
    _unpickled_scheduler(data, f"the learning-rate scheduler {type(scheduler).__name__}")
    return data


class _SchedulerUnpickler(pickle.Unpickler):
    """Resolves only Paddle's learning-rate schedulers and numpy scalars: a saved plan runs no code."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "paddle.optimizer.lr":
            found = getattr(paddle.optimizer.lr, name, None)
            if isinstance(found, type) and issubclass(found, paddle.optimizer.lr.LRScheduler):
                return found
        elif (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _unpickled_scheduler(data: bytes, what: str) -> Any:
    try:
        return _SchedulerUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{what} refers to the Python global {exc}, which is not one of Paddle's learning-rate "
                         "schedulers (paddle.optimizer.lr): saved plans hold only those, so that loading one "
                         "never runs code") from None


def _write(directory: str, name: str, data: bytes) -> None:
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's fields, read-only mappings as dicts (what JSON holds)."""
    return {f.name: dict(v) if isinstance(v := getattr(obj, f.name), Mapping) else v
            for f in fields(obj) if f.name not in skip}


def _encode_plan(plan: Plan) -> dict[str, Any]:
    """Every field of ``plan``: those JSON holds as they are (numbers, strings, lists, dicts of them)
    unchanged, so a field added to ``Plan`` later is saved too; the others in the forms ``_decode_plan``
    reads. Action lists are kept in their text form, which people read; see ``_decode_actions``."""
    data = _fields(plan)
    data.update(
        stages=[{**_fields(st, skip=("sections",)),
                 "sections": {kind: _fields(sec, skip=("program", "runs")) for kind, sec in st.sections.items()}}
                for st in plan.stages],
        exchanges=[{**_fields(ex, skip=("vars",)), "vars": [_fields(v) for v in ex.vars]} for ex in plan.exchanges],
        routes=[{"index": r.index, "src": _fields(r.src), "dst": _fields(r.dst), "vars": [_fields(v) for v in r.vars]}
                for r in plan.routes],
        actions=format_schedule(plan.actions).splitlines(),
        producers={name: _fields(ref) for name, ref in plan.producers.items()},
        memory=None if plan.memory is None else {**_fields(plan.memory, skip=("stages",)),
                                                 "stages": [_fields(st) for st in plan.memory.stages]},
    )
    return data


# --- load -------------------------------------------------------------------------------------------
def load_plan(directory: str, stages: Iterable[int] | None = None
              ) -> tuple[framework.Program, framework.Program]:
    """The main and startup programs saved by ``save_plan`` in ``directory``, with the plan attached:
    ``Executor.run(startup)``, ``Executor.run(main, feed=...)``, ``train_from_dataset``, ``state_dict``
    and ``staticpipe.save``/``load`` work on them as on the originals. Switches Paddle to static mode.

    ``stages``: the stages whose section programs to read; by default every stage, or in a job started
    by ``staticpipe.launch`` the stages of this process's rank. The other stages' files need not exist.
    Nothing is built unless plan.json and every file read are as saved (the module docstring says what is
    checked); a refusal names the file, and the field of plan.json.
    """
    paddle.enable_static()
    recover_directory(directory)  # a save_plan killed after moving the previous directory aside
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no saved plan at {directory!r}: the directory does not exist")
    plan_file = existing(directory, PLAN_FILE, "the plan written by staticpipe.save_plan")
    description = read_description(plan_file)
    # a plan is immutable: the stages to load are found on a plan without programs, then it is built whole
    pir = description["format"] == PIR_FORMAT
    skeleton = _decode_plan(description["plan"], plan_file, pir)
    check_plan(skeleton, description["files"], plan_file)
    wanted = set(_stages_to_load(skeleton, stages, plan_file))
    file = verified_files(directory, description["files"], needed_files(skeleton, description, wanted), plan_file)
    if pir:
        plan = _decode_plan(description["plan"], plan_file, True, section_reader(description["pir"], file, wanted))
        main, startup = read_programs(description["pir"], file)
    else:
        plan = _decode_plan(description["plan"], plan_file, False, _legacy_reader(skeleton, wanted, file))
        main, startup = _read_program(file(MAIN_FILE)), _read_program(file(STARTUP_FILE))
    main.random_seed = description["random_seeds"]["main"]
    startup.random_seed = description["random_seeds"]["startup"]
    if description["lr_scheduler"]:
        with open(path := file(SCHEDULER_FILE), "rb") as f:
            main.lr_scheduler = _unpickled_scheduler(f.read(), repr(path))
    attach_plan(plan, main, startup)
    setattr(main, STARTUP_LINK, startup)
    return main, startup


def _legacy_reader(skeleton: Plan, wanted: set[int], file: Callable[[str], str]) -> SectionReader:
    """(program, runs) of a section of the ``wanted`` stages of a plan of legacy programs, its communication ops
    checked against the plan (``skeleton``: the plan without programs); its runs made as the rewrite made them."""
    def read(s: int, kind: str, fields_: dict[str, Any]) -> tuple:
        if s not in wanted:
            return None, ()
        program = _read_program(path := file(section_file(s, kind)))
        check_comm_ops(program, skeleton, skeleton.stages[s].sections[kind], path)
        return program, section_runs(program, kind, fields_["keep"], fields_["comm_ops"])
    return read


def _read_program(path: str) -> framework.Program:
    with open(path, "rb") as f:
        return paddle.static.deserialize_program(f.read())


def _stages_to_load(plan: Plan, stages: Iterable[int] | None, plan_file: str) -> list[int]:
    """``stages``, checked against the plan and the launched job, or this process's stages."""
    world = launched_world()
    needed = [s.index for s in plan.stages] if world is None else _stages_of_rank(plan, world, plan_file)
    if stages is None:
        return needed
    stages = list(stages)
    unknown = [s for s in stages if not (isinstance(s, int) and 0 <= s < plan.num_stages)]
    if unknown:
        raise ValueError(f"load_plan: stages={stages} names {unknown}, but {plan_file!r} has stages "
                         f"0..{plan.num_stages - 1}")
    left_out = [s for s in needed if s not in stages]
    if world is not None and left_out:
        raise ValueError(f"load_plan: rank {world[0]} runs stages {needed}, but stages={stages} leaves out "
                         f"{left_out}")
    return sorted(set(stages))


def _stages_of_rank(plan: Plan, world: tuple[int, int], plan_file: str) -> list[int]:
    try:
        return [s.index for s in plan.stages_of_process(world)]
    except ValueError as exc:
        raise ValueError(f"{plan_file!r} does not fit this job: {exc}") from None


def _tuples(data: dict[str, Any]) -> dict[str, Any]:
    """JSON reads tuples back as lists; the plan's dataclasses hold tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


SectionReader = Callable[[int, str, dict], tuple[Any, tuple]]


def _decode_plan(data: dict[str, Any], plan_file: str, pir: bool,
                 read: SectionReader = lambda stage, kind, fields_: (None, ())) -> Plan:
    """The plan ``_encode_plan`` wrote, of programs of PIR or not, with the section programs and runs
    ``read(stage, kind, fields)`` gives ((None, ()): another process runs that stage)."""
    try:
        routes = tuple(Route(r["index"], SectionRef(**r["src"]), SectionRef(**r["dst"]),
                             tuple(CutVar(**_tuples(v)) for v in r["vars"])) for r in data["routes"])
        decoded = dict(
            stages=tuple(_decode_stage(st, read, plan_file, pir) for st in data["stages"]),
            routes=routes,
            exchanges=tuple(Exchange(**_tuples({k: v for k, v in ex.items() if k != "vars"}),
                                     vars=tuple(CutVar(**_tuples(v)) for v in ex["vars"])) for ex in data["exchanges"]),
            ranks=tuple(data["ranks"]),
            notes=tuple(data["notes"]),
            actions=_decode_actions(data["actions"], routes, plan_file),
            producers={name: SectionRef(**ref) for name, ref in data["producers"].items()},
            data_vars={name: tuple(stages) for name, stages in data["data_vars"].items()},
            data_specs={name: (tuple(shape), dtype) for name, (shape, dtype) in data["data_specs"].items()},
            shared={name: tuple(stages) for name, stages in data["shared"].items()},
            replicated={int(op): why for op, why in data["replicated"].items()},
            memory=_decode_memory(data.get("memory")),  # absent from plans saved before the memory model
        )
        return Plan(**{f.name: data[f.name] for f in fields(Plan)  # a plan saved before a field with a default
                       if f.name not in decoded and (f.name in data or f.default is MISSING)}, **decoded)
    except KeyError as exc:
        raise ValueError(f"{plan_file!r} lacks the plan field {exc}") from None


def _decode_memory(data: dict[str, Any] | None) -> MemoryModel | None:
    if data is None:
        return None
    return MemoryModel(tuple(StageMemory(**st) for st in data["stages"]), tuple(data["ranks"]), tuple(data["stage_ranks"]),
                       {int(rank): tuple(tuple(v) for v in vectors) for rank, vectors in data["inflight"].items()})


def _decode_stage(data: dict[str, Any], read: SectionReader, plan_file: str, pir: bool) -> Stage:
    """A stage; a section's exchanges checked against its communication ops (legacy: exchange k is the k-th)
    or, once read, its runs (PIR programs hold no communication ops: exchange k comes after run k)."""
    sections = {}
    for kind, sec in data["sections"].items():
        fields_ = _tuples(sec)
        if not pir and len(fields_["exchanges"]) != (len(fields_["comm_ops"]) if kind == OPTIMIZE else 0):
            raise ValueError(f"{plan_file!r}: the stage {data['index']} {kind} section has "
                             f"{len(fields_['exchanges'])} exchanges but "
                             f"{len(fields_['comm_ops'])} communication ops")
        program, runs = read(data["index"], kind, fields_)
        if pir and runs and len(runs) != len(fields_["exchanges"]) + 1:
            raise ValueError(f"{plan_file!r}: the stage {data['index']} {kind} section has "
                             f"{len(fields_['exchanges'])} exchanges but {len(runs)} runs")
        sections[kind] = Section(program=program, runs=runs, **fields_)
    return Stage(**_tuples({k: v for k, v in data.items() if k != "sections"}), sections=sections)


def _decode_actions(lines: list[str], routes: list[Route], plan_file: str) -> Schedule:
    """The action lists from their text form. The text of a SEND/RECV leaves out its route; lowering the
    compute actions again with the plan's routes (as the rewrite did) puts the routes back, and must give
    exactly the saved text."""
    saved = parse_schedule("\n".join(lines))
    actions = lower({rank: [a for a in acts if a.kind not in COMM_KINDS] for rank, acts in saved.items()}, routes)
    if format_schedule(actions) != format_schedule(saved):
        raise ValueError(f"{plan_file!r}: the sends and receives of the action lists do not match the plan's routes")
    return actions
