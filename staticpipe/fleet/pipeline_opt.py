"""``main_program._pipeline_opt``: what Paddle's fleet pipeline leaves on the main program after
``minimize``, which scripts read (``str(main._pipeline_opt['section_program'])`` to save program
descriptions, its persistables for checkpoints, its stage and stage count).

Why a module of its own: it describes a finished plan in Paddle's terms and does nothing else. The keys are
those of Paddle 2.6 and 3.3 (``paddle/incubate/optimizer/pipeline.py``, ``PipelineOptimizer.minimize``) with
Paddle's meanings, plus ``section_programs``. Setting it changes nothing Paddle runs by default:
``Executor.run`` on Paddle 2.6 runs a program's ``_pipeline_opt`` as a ``PipelineTrainer`` only when
``FLAGS_new_executor_micro_batching`` is set false, Paddle 3.3 never; only Paddle's own
``train_from_dataset`` / ``infer_from_dataset`` always do (``staticpipe.Executor``'s are its own).
"""
from __future__ import annotations

from typing import Any

from .._paddle import core, framework
from ..ir import is_pir_program
from ..placement import cuda_device_count, launched_world, place_of
from ..plan import BACKWARD, FORWARD, OPTIMIZE, WEIGHT, Plan
from ..rewrite.programs import copy_ops

SECTION_KINDS = (FORWARD, BACKWARD, WEIGHT, OPTIMIZE)  # a training step's order, as Paddle's section holds them


def pipeline_opt(plan: Plan, schedule_mode: str, parameters: dict | None = None) -> dict[str, Any]:
    """Paddle's ``_pipeline_opt`` of this process for ``plan``.

    ``pipeline_stage``: this process's pipeline rank (0 in one process); ``num_pipeline_stages`` and
    ``inner_parallelism``: the pipeline's ranks (devices), as Paddle counts them -- an interleaved schedule
    has more stages than ranks. ``section_program``: one legacy-IR Program holding, in order, the forward,
    backward (and weight-gradient) and optimize sections of every stage this process runs (one stage per
    rank as in Paddle; several with an interleaved schedule; every stage in one process), with the send and
    recv ops the rewrite placed, its persistables (gradient buffers too) and, as Paddle's, the main program's
    ``parameters`` (name -> Parameter) it uses declared as Parameters. On PIR, whose programs are not
    merged, it is the first such stage's forward section. ``section_programs`` (staticpipe's): stage index
    -> {section kind -> program} of those stages. ``place`` / ``place_id``: the place (and GPU id, 0 on CPU)
    of this process's first stage."""
    world = launched_world()
    rank = plan.place_of_process(world[0])[1] if world else 0
    shard = plan.shard_of_process(world)
    local = [s for s in plan.stages if world is None or s.rank == rank]
    sections = {s.index: {kind: _section(s, kind, shard).program for kind in SECTION_KINDS if kind in s.sections}
                for s in local}
    place = core.CPUPlace() if cuda_device_count() == 0 else place_of(local[0].device, launched=world is not None)
    return {
        "trainer": "PipelineTrainer",
        "device_worker": "Section",
        "pipeline_stage": rank,
        "num_pipeline_stages": len(plan.ranks),
        "schedule_mode": schedule_mode,
        "inner_parallelism": len(plan.ranks),
        "section_program": _merged([p for kinds in sections.values() for p in kinds.values() if p is not None],
                                   parameters or {}),
        "place": place,
        "place_id": place.get_device_id() if isinstance(place, core.CUDAPlace) else 0,
        "sync_steps": -1,
        "num_microbatches": plan.num_microbatches,
        "start_cpu_core_id": 0,
        "section_programs": sections,
    }


def _section(stage: Any, kind: str, shard: int | None) -> Any:
    """The section of ``kind`` this process runs (ZeRO-1: its shard's optimize section)."""
    return stage.optimize_section(shard) if kind == OPTIMIZE else stage.sections[kind]


def _merged(programs: list, parameters: dict) -> Any:
    """One legacy Program of ``programs``' ops and variables in order, ``parameters`` among them declared as
    Paddle's ``_create_vars`` declares them; the first program itself where they cannot be merged (PIR, or a
    section with control flow: its sub-blocks)."""
    if not programs or any(is_pir_program(p) or p.num_blocks > 1 for p in programs):
        return programs[0] if programs else None
    merged = framework.Program()
    merged.random_seed = programs[0].random_seed
    target = merged.global_block()
    for program in programs:
        block = program.global_block()
        for name in block.vars:
            param = parameters.get(name)
            if param is not None and not target.has_var(name):
                target.create_parameter(name=name, shape=param.shape, dtype=param.dtype, type=param.type,
                                        lod_level=param.lod_level, stop_gradient=param.stop_gradient,
                                        trainable=param.trainable, optimize_attr=param.optimize_attr,
                                        regularizer=param.regularizer, error_clip=param.error_clip)
        copy_ops(target, block, range(len(block.ops)))
    return merged


def set_pipeline_opt(program: Any, plan: Plan, schedule_mode: str) -> None:
    """Set ``program._pipeline_opt`` as Paddle's fleet pipeline leaves it after ``minimize``."""
    parameters = {} if is_pir_program(program) else {p.name: p for p in program.global_block().all_parameters()}
    program._pipeline_opt = pipeline_opt(plan, schedule_mode, parameters)


__all__ = ["pipeline_opt", "set_pipeline_opt", "SECTION_KINDS"]
