"""The files of a saved plan, and how ``load_plan`` knows they are the ones ``save_plan`` wrote.

``save_plan`` writes plan.json last, with a manifest of everything else: ``files``, the size and sha256 of
every other file (as a checkpoint's ``meta.json`` records its files), and ``fields``, the sha256 of each of
plan.json's own fields (``field_digests``; the plan's and the PIR record's one level down, so that
``plan.num_microbatches`` is a field of its own).

Why: a saved plan is run by processes that never saw the model code, so nothing but its files says what they
train, and a file damaged or edited by hand trained a different computation without a word (plan.json's
``num_microbatches`` 4 -> 8, a stage's ``tanh`` made a ``sigmoid``) or failed deep in Paddle, naming no file.
So before any program is built, ``read_description`` reads plan.json (an unreadable one is named), its format
and manifest, and each field against its digest (a hand edit that keeps valid JSON is named by its field);
``check_plan`` checks the fields against each other (the stages in order on their ranks' devices, the action
lists a valid schedule of ``num_microbatches`` micro-batches through them, the files those of exactly these
stages); ``verified_files`` checks every file this process reads (``needed_files``) against its size and sha256
(``checkpoint.check_digest``: a missing, unlisted, truncated, edited or swapped file is named); and once a
legacy section program is read, ``check_comm_ops`` checks its send, recv and all-reduce ops against the plan's
routes and exchanges. An edit that also rewrites the digests is the user's own choice, not guarded against.
Plans of format 2 have no manifest and are refused (save them again).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Callable

from .._paddle import PADDLE_MAJOR, framework, paddle
from ..checkpoint import check_digest, read_json
from ..pickled_arrays import digest
from ..pir_ir import pir_mode
from ..plan import COLLECTIVE_OP_TYPES, COMM_OP_TYPES, FORWARD_ONLY, SUM, WEIGHT, Plan, Section
from ..saved_pir import MAIN_FILE as PIR_MAIN_FILE, STARTUP_FILE as PIR_STARTUP_FILE
from ..schedule import validate

FORMAT_VERSION = 3  # 2: exchanges of the optimize sections; 3: the manifest (every file's and field's sha256)
PIR_FORMAT = f"pir-{FORMAT_VERSION}"  # the same plan of PIR programs
LEGACY_FORMATS, PIR_FORMATS = (1, 2, FORMAT_VERSION), ("pir-2", PIR_FORMAT)  # 1, 2 and pir-2 have no manifest
PLAN_FILE, MAIN_FILE, STARTUP_FILE, SCHEDULER_FILE = "plan.json", "main.pdmodel", "startup.pdmodel", "lr_scheduler.pkl"
HOLDS = {MAIN_FILE: "the main program", PIR_MAIN_FILE: "the main program", STARTUP_FILE: "the startup program",
         PIR_STARTUP_FILE: "the startup program", SCHEDULER_FILE: "the learning-rate scheduler"}
STAGE_FILE = re.compile(r"stage-(\d+)/(\w+?)(?:\.run-(\d+))?\.(?:pdmodel|json)")  # section_file, saved_pir.run_file
MANIFEST = ("files", "fields")


def section_file(stage: int, kind: str) -> str:
    """Where a legacy section program lies, relative to the saved plan directory (as the manifest names it)."""
    return f"stage-{stage}/{kind}.pdmodel"


# --- save -------------------------------------------------------------------------------------------
def add_manifest(description: dict[str, Any], directory: str) -> None:
    """Put the manifest of the files written to ``directory`` (all but plan.json, written last) and of
    ``description``'s fields into ``description``."""
    written = sorted(os.path.relpath(os.path.join(d, f), directory) for d, _, names in os.walk(directory)
                     for f in names)
    description["files"] = {name.replace(os.sep, "/"): digest(os.path.join(directory, name)) for name in written}
    description["fields"] = field_digests(json.loads(json.dumps(description)))  # as load_plan reads them back


def field_digests(description: dict[str, Any]) -> dict[str, str]:
    """The sha256 of each field of plan.json ``description`` (as JSON, keys sorted), but its format and
    manifest: what a hand edit is found and named by."""
    return {name: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
            for name, value in _field_values(description).items()}


def _field_values(description: dict[str, Any]) -> dict[str, Any]:
    """plan.json's fields by name; those of the plan and of the PIR record one level down ("plan.loss")."""
    values = {}
    for key, value in description.items():
        if key != "format" and key not in MANIFEST:
            nested = key in ("plan", "pir") and isinstance(value, dict)
            values.update({f"{key}.{k}": v for k, v in value.items()} if nested else {key: value})
    return values


# --- load -------------------------------------------------------------------------------------------
def read_description(plan_file: str) -> dict[str, Any]:
    """plan.json: JSON, of a format this process reads (a plan of the other IR is refused by name, before any
    program is read), with its manifest, and every field as ``save_plan`` wrote it."""
    description = read_json(plan_file)
    version, pir = description.get("format"), pir_mode()
    if version in PIR_FORMATS and not pir:
        why = (f"Paddle {paddle.__version__} has no PIR; load it with Paddle 3" if PADDLE_MAJOR < 3 else
               "legacy-IR mode; load it in PIR mode: Paddle 3's default, without STATICPIPE_LEGACY_IR=1 or "
               "staticpipe.use_legacy_ir(), or inside paddle.pir_utils.IrGuard()")
        raise ValueError(f"{plan_file!r} holds a plan of PIR programs (format {version!r}, Paddle 3's default "
                         f"IR), but this process builds legacy-IR programs ({why})")
    if version in LEGACY_FORMATS and pir:
        raise ValueError(f"{plan_file!r} holds a plan of legacy-IR programs (format {version}), but this "
                         "process builds PIR programs (Paddle 3's default IR); load it in legacy-IR mode "
                         "(STATICPIPE_LEGACY_IR=1 or staticpipe.use_legacy_ir(), see README)")
    if version not in (FORMAT_VERSION, PIR_FORMAT):
        if version in LEGACY_FORMATS + PIR_FORMATS:
            raise ValueError(f"{plan_file!r} has plan format {version!r}, written by an older staticpipe without "
                             "the sizes and sha256 of its files, which load_plan checks before it builds "
                             "anything: save the plan again with this staticpipe")
        raise ValueError(f"{plan_file!r} has plan format {version!r}; this staticpipe reads format "
                         f"{PIR_FORMAT if pir else FORMAT_VERSION!r}")
    files, fields = (description.get(key) for key in MANIFEST)
    if not (isinstance(files, dict) and all(isinstance(r, dict) and isinstance(r.get("sha256"), str)
                                            and type(r.get("bytes")) is int for r in files.values())
            and isinstance(fields, dict) and all(isinstance(d, str) for d in fields.values())):
        raise ValueError(f"{plan_file!r} has no manifest of format {version!r}: 'files' must give each file's "
                         "sha256 and bytes, and 'fields' each field's sha256")
    _check_fields(description, plan_file)
    return description


def _check_fields(description: dict[str, Any], plan_file: str) -> None:
    """Every field of plan.json as ``save_plan`` wrote it (``fields``): a hand edit is named by its field."""
    recorded, values, found = description["fields"], _field_values(description), field_digests(description)
    edited = "the file was edited after it was saved (a saved plan is written whole: save it again)"
    for name in recorded:
        if name not in found:
            raise ValueError(f"{plan_file!r} lacks the field {name!r}, which save_plan wrote: {edited}")
        if found[name] != recorded[name]:
            now = json.dumps(values[name])
            raise ValueError(f"{plan_file!r}: its field {name!r}{f' ({now})' if len(now) <= 40 else ''} is not "
                             f"what save_plan wrote: {edited}")
    added = sorted(found.keys() - recorded.keys())
    if added:
        raise ValueError(f"{plan_file!r} has the field {added[0]!r}, which save_plan did not write: {edited}")


def check_plan(plan: Plan, files: dict[str, Any], plan_file: str) -> None:
    """The plan's fields against each other: stage s is ``stages[s]``, on its rank's device, with its own
    sections; the action lists a valid schedule of ``num_microbatches`` micro-batches through these stages; the
    files listed (``files``) those of exactly these stages."""
    for i, st in enumerate(plan.stages):
        if not (st.index == i and 0 <= st.rank < len(plan.ranks) and plan.ranks[st.rank] == st.device and all(
                (sec.stage, sec.kind) == (i, kind) for kind, sec in st.sections.items())):
            raise ValueError(f"{plan_file!r}: its stages[{i}] (index {st.index} on {st.device}, rank {st.rank} of "
                             f"{list(plan.ranks)}, sections {[(sec.stage, k) for k, sec in st.sections.items()]}) "
                             f"is not stage {i} of its plan")
    if plan.schedule != FORWARD_ONLY:
        try:
            validate(plan.actions, plan.num_stages, plan.num_microbatches, [st.rank for st in plan.stages],
                     split_backward=any(WEIGHT in st.sections for st in plan.stages), collectives=True)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{plan_file!r}: its action lists are no schedule of its num_microbatches "
                             f"({plan.num_microbatches}) through its {plan.num_stages} stages: {exc}") from None
    listed = sorted({int(m.group(1)) for m in map(STAGE_FILE.fullmatch, files) if m})
    if listed != list(range(plan.num_stages)):
        raise ValueError(f"{plan_file!r} lists the files of stages {listed}, but its plan has stages "
                         f"0..{plan.num_stages - 1}")


def existing(directory: str, name: str, what: str) -> str:
    """The path of the file ``name`` of the saved plan ``directory``; an error naming it when it is missing."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist: it holds {what}")
    return path


def needed_files(plan: Plan, description: dict[str, Any], wanted: set[int]) -> list[str]:
    """The files ``load_plan`` reads for the ``wanted`` stages of ``plan`` (of plan.json ``description``), in the
    order it reads them: their sections, the main and startup programs, the scheduler."""
    if description["format"] == PIR_FORMAT:
        sections = description["pir"]["sections"]
        names = [run["file"] for s in sorted(wanted) for runs in sections[str(s)].values() for run in runs
                 if run["file"] is not None] + [PIR_MAIN_FILE, PIR_STARTUP_FILE]
    else:
        names = [section_file(s, kind) for s in sorted(wanted) for kind in plan.stages[s].sections]
        names += [MAIN_FILE, STARTUP_FILE]
    return list(dict.fromkeys(names + [SCHEDULER_FILE] * bool(description["lr_scheduler"])))


def verified_files(directory: str, files: dict[str, Any], needed: list[str], plan_file: str) -> Callable[[str], str]:
    """Check each file ``needed`` against its size and sha256 in the manifest ``files`` (refused when it lists
    none); returns ``file(name)``: the path of a file the manifest lists."""
    def file(name: str) -> str:
        if name not in files:
            raise ValueError(f"{plan_file!r} lists no size and sha256 for {name}, which holds {_holds(name)}")
        return existing(directory, name, _holds(name))

    for name in needed:
        check_digest(file(name), name, files, PLAN_FILE)
    return file


def _holds(name: str) -> str:
    """What the file ``name`` of a saved plan holds, in words."""
    stage = STAGE_FILE.fullmatch(name)
    if stage is None:
        return HOLDS.get(name, "a file of the saved plan")
    return f"the stage {stage.group(1)} {stage.group(2)} section" + (f"'s run {stage.group(3)}" if stage.group(3)
                                                                     else "")


def check_comm_ops(program: framework.Program, plan: Plan, section: Section, path: str) -> None:
    """A legacy section program's send, recv and all-reduce ops (its ``comm_ops``) are the plan's: one per cut
    variable of its routes, to or from the stage the route names, and one per exchange of an optimize section."""
    routes, ops = plan.routes, program.global_block().ops
    want = [("recv_v2", routes[r].src.stage) for r in section.recv_routes for _ in routes[r].vars]
    want += [("send_v2", routes[r].dst.stage) for r in section.send_routes for _ in routes[r].vars]
    want += [("all-reduce", None) if ex.kind == SUM else ("send_v2", ex.dst) if ex.src == section.stage
             else ("recv_v2", ex.src) for ex in (plan.exchanges[k] for k in section.exchanges)]
    found = [("no op", i) if not 0 <= i < len(ops) else (ops[i].type, ops[i].attr("peer"))
             if ops[i].type in COMM_OP_TYPES else ("all-reduce", None) if ops[i].type in COLLECTIVE_OP_TYPES
             else (ops[i].type, None) for i in section.comm_ops]
    if sorted(found, key=str) != sorted(want, key=str):
        raise ValueError(f"{path!r} is not the stage {section.stage} {section.kind} section of its plan: its "
                         f"communication ops (type, peer stage) are {found}, but plan.json's routes and exchanges "
                         f"make them {want}")
