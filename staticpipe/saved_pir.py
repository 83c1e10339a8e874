"""The PIR half of saved plans (``saved_plan/``): Paddle's own serialization of PIR programs, and what it
leaves out written beside it.

A PIR program is written by ``core.serialize_pir_program`` and read by ``core.deserialize_pir_program``,
Paddle 3's format for PIR programs (JSON; what ``paddle.static.save_inference_model`` and ``paddle.save``
write in PIR mode). It gives the program back op for op and value for value, in the same order (the same
printed program), but not what staticpipe holds beside a program in Python, all of which a loaded plan
needs. So ``write_program`` records it, by position (op index, result index: PIR values have no names of
their own), for plan.json, and ``read_program`` puts it back:

- the ops' devices (``op_device``): Paddle writes only the attributes an op's definition declares (it drops
  ``op_device``, and refuses it on ``builtin.parameter``), and a training program's forward twin
  (``infer_from_dataset``, ``evaluate``) is placed by them;
- a section program's names (``pir_ir.VALUES``, ``FEEDS``, ``HANDED_OVER``): how the runtime finds what
  it feeds, keeps and hands over, and the declared persistables (parameters, state, ``@MERGED`` buffers)
  a stage receives from the startup program;
- the main program's ``PirView``, which names its values for the plan, fetch lists, checkpoints and
  ``verify``: built again from what the rewrite built it from (the gradients Paddle's ``ir_backward``
  reported, the loss, the split points), so every value gets the name it had;
- ``lr_name``, the persistable that Paddle's executor and the runtime give the scheduler's learning rate.

Not kept: ``op_callstack`` (the Python stack that built each op). Each record holds a digest of the op
types, and a program read back with other ops (another Paddle's reader, or a file replaced together with its
size and sha256 in plan.json's manifest) is refused rather than trained.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

from ._paddle import OP_DEVICE, core, paddle
from .ir import clear_device_tags
from .pir_ir import FEEDS, HANDED_OVER, SPLIT_POINTS, VALUES, VIEW, Gradients
from .pir_view import PirView
from .plan import Plan, Run, Section

EXT = ".json"  # Paddle's own suffix for a serialized PIR program
MAIN_FILE, STARTUP_FILE = f"main{EXT}", f"startup{EXT}"


def write_programs(directory: str, plan: Plan, main: Any, startup: Any) -> dict[str, Any]:
    """Write every program of ``plan`` (of PIR programs) under ``directory``; returns plan.json's "pir"."""
    return {"sections": {str(st.index): {kind: write_section(directory, sec) for kind, sec in st.sections.items()}
                         for st in plan.stages},
            "main": write_program(main, os.path.join(directory, MAIN_FILE)),
            "startup": write_program(startup, os.path.join(directory, STARTUP_FILE))}


def section_reader(record: dict[str, Any], existing: Callable[[str], str],
                   wanted: set[int]) -> Callable[[int, str, dict], tuple]:
    """What ``saved_plan`` reads a section with: (program, runs) of the ``wanted`` stages, (None, ()) of others.
    ``existing(name)``: the path of a file of the saved plan, verified (``saved_plan.manifest.verified_files``)."""
    def read(stage: int, kind: str, fields_: dict) -> tuple:
        if stage not in wanted:
            return None, ()
        return read_section(record["sections"][str(stage)][kind], existing, stage, kind)
    return read


def read_programs(record: dict[str, Any], existing: Callable[[str], str]) -> tuple[Any, Any]:
    """The main and startup programs ``write_programs`` wrote."""
    return read_program(existing(MAIN_FILE), record["main"]), read_program(existing(STARTUP_FILE), record["startup"])


def run_file(stage: int, kind: str, run: int | None = None) -> str:
    """Where a PIR section program lies in a saved plan: ``<kind>.json`` the section's program, and
    ``<kind>.run-<k>.json`` run k's where it is another program (the runs of an optimize section)."""
    return f"stage-{stage}/{kind}{'' if run is None else f'.run-{run}'}{EXT}"  # as the manifest names it


def write_section(directory: str, section: Section) -> list[dict[str, Any]]:
    """Write the programs of ``section``'s runs under ``directory``; returns, per run, what plan.json keeps
    of it: its file (None: an empty run, two exchanges in a row), its keep list, its program's record."""
    runs: list[dict[str, Any]] = []
    for k, run in enumerate(section.runs):
        name = None if run.program is None else run_file(section.stage, section.kind,
                                                         None if run.program is section.program else k)
        written = name is None or name in [r["file"] for r in runs]
        runs.append({"file": name, "keep": list(run.keep),
                     "program": None if written else write_program(run.program, os.path.join(directory, name))})
    if section.program is not None and run_file(section.stage, section.kind) not in [r["file"] for r in runs]:
        raise ValueError(f"save_plan: the stage {section.stage} {section.kind} section's program is none of its runs'")
    return runs


def read_section(records: list[dict[str, Any]], existing: Callable[[str], str], stage: int,
                 kind: str) -> tuple[Any, tuple[Run, ...]]:
    """(the section's program, its runs) as ``write_section`` wrote them."""
    programs: dict[str, Any] = {}
    runs = []
    for record in records:
        name = record["file"]
        if name is None:
            runs.append(Run(None, tuple(record["keep"])))
            continue
        if name not in programs:
            programs[name] = read_program(existing(name), record["program"])
        runs.append(Run(programs[name], tuple(record["keep"])))
    return programs.get(run_file(stage, kind)), tuple(runs)


def write_program(program: Any, path: str) -> dict[str, Any]:
    """Write PIR ``program`` to ``path`` in Paddle's format; returns what ``read_program`` puts back."""
    ops = list(program.global_block().ops)
    index = {op: i for i, op in enumerate(ops)}

    def at(value: Any) -> list[int]:
        return [index[value.get_defining_op()], value.index()]

    record: dict[str, Any] = {"ops": _digest(ops),
                              "devices": [[i, op.str_attr(OP_DEVICE)] for i, op in enumerate(ops)
                                          if op.has_attr(OP_DEVICE)]}
    if hasattr(program, VALUES):
        record.update(values={name: at(v) for name, v in getattr(program, VALUES).items()},
                      feeds=list(getattr(program, FEEDS)))
    if hasattr(program, HANDED_OVER):
        record["handed_over"] = dict(getattr(program, HANDED_OVER))
    anchors = getattr(program, SPLIT_POINTS, None)
    if anchors is not None and all(a is None or a in index for a in anchors):  # a section's are its source's
        record["split_points"] = [None if a is None else index[a] for a in anchors]
    view = getattr(program, VIEW, None)
    if view is not None:
        grads = view.gradients
        record["view"] = {"gradients": [[at(g), at(v)] for g, v in (grads.of or {}).items()],
                          "forward_of": [[index[b], index[f]] for b, f in grads.forward_of.items()],
                          "loss": at(view.var(view.loss).value) if view.loss else None}
    if hasattr(program, "lr_name"):
        record["lr_name"] = program.lr_name
    twin = clear_device_tags(program.clone())  # Paddle's writer refuses the devices on parameters (recorded above)
    core.serialize_pir_program(twin, path, True, False, True)  # overwrite, not readable, trainable
    return record


def read_program(path: str, record: dict[str, Any]) -> Any:
    """The PIR program ``write_program`` wrote to ``path``, with what ``record`` holds put back."""
    from paddle.autograd.backward_utils import ValueDict

    program = paddle.pir.Program()
    core.deserialize_pir_program(path, program, -1)
    ops = list(program.global_block().ops)
    if _digest(ops) != record["ops"]:
        raise ValueError(f"{path!r} holds other ops than plan.json records for it (Paddle {paddle.__version__} reads "
                         "it back otherwise than it was saved, or the file was replaced with its digest), so the "
                         "plan's names would point at other values; save the plan again with this Paddle")

    def at(position: list[int]) -> Any:
        return ops[position[0]].result(position[1])

    for i, device in record["devices"]:
        ops[i].set_str_attr(OP_DEVICE, device)
    if "values" in record:
        setattr(program, VALUES, {name: at(p) for name, p in record["values"].items()})
        setattr(program, FEEDS, tuple(record["feeds"]))
    if "handed_over" in record:
        setattr(program, HANDED_OVER, dict(record["handed_over"]))
    if "split_points" in record:
        setattr(program, SPLIT_POINTS, [None if i is None else ops[i] for i in record["split_points"]])
    if "lr_name" in record:
        program.lr_name = record["lr_name"]
        lr_var = program.get_parameter_value_by_name(program.lr_name)
        if lr_var.initialized():  # as Paddle's optimizer leaves it on the main program
            program.lr_var = lr_var
    if "view" in record:
        view = record["view"]
        grads = Gradients(of=ValueDict({at(g): at(v) for g, v in view["gradients"]}),
                          forward_of={ops[b]: ops[f] for b, f in view["forward_of"]})
        PirView(program, grads, None if view["loss"] is None else at(view["loss"])).attach()
    return program


def _digest(ops: list) -> list:
    """How many ops, and a digest of their types in order: a program read back must have exactly these."""
    return [len(ops), hashlib.sha256("\n".join(op.name() for op in ops).encode()).hexdigest()[:16]]
