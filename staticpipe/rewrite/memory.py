"""The plan's memory model (``memory_model.py``) measured from its section programs and its schedule.

Sizes come from the variables the section programs declare (shapes, dtypes; a ``-1`` dimension is the
batch, so a kept value costs ``per_sample * b`` bytes), the in-flight counts from the lowered action lists
(``schedule.simulate.inflight_counts``), so the model holds for any schedule, custom ones included.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from ..ir import declared, declared_var, num_bytes
from ..memory_model import MemoryModel, StageMemory
from ..plan import FORWARD, Stage
from ..schedule.simulate import inflight_counts, peak_inflight


def memory_model(stages: Sequence[Stage], actions: Mapping[int, Sequence], ranks: Sequence[str]) -> MemoryModel:
    """The model of a plan made of ``stages`` running ``actions`` on ``ranks``."""
    peaks = peak_inflight(actions)
    stage_ranks = tuple(st.rank for st in stages)
    return MemoryModel(tuple(_stage(st, peaks.get(st.index, 0)) for st in stages), tuple(ranks), stage_ranks,
                       inflight_vectors(actions, stage_ranks))


def inflight_vectors(actions: Mapping[int, Sequence], stage_ranks: Sequence[int]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Per rank, the distinct vectors of in-flight micro-batches (one count per stage of the rank, in stage
    order) its action list passes through (``MemoryModel.inflight``)."""
    mine = {rank: [s for s, r in enumerate(stage_ranks) if r == rank] for rank in set(stage_ranks)}
    return {rank: tuple(sorted({tuple(c.get(s, 0) for s in mine[rank]) for c in seen}))
            for rank, seen in inflight_counts(actions).items()}


def _stage(stage: Stage, peak_inflight: int) -> StageMemory:
    where = {name: p for sec in stage.sections.values() for p in sec.programs for name, _ in declared(p)}

    def size(names: Iterable[str]) -> tuple[int, int]:
        """(bytes per sample, fixed bytes) of the declared ``names``: a -1 dimension is the batch."""
        per_sample = fixed = 0
        for name in names:
            if name in where:
                shape, dtype = declared_var(where[name], name)
                count = num_bytes(shape, dtype)
                if any(d < 0 for d in shape):
                    per_sample += count
                else:
                    fixed += count
        return per_sample, fixed

    params, grads = size(stage.parameters)[1], size(stage.grad_buffers)[1]
    state = size(sorted(set(stage.persistables) - set(stage.parameters) - set(stage.grad_buffers)
                        | set(stage.step_values)))[1]
    kept = size(stage.sections[FORWARD].keep) if FORWARD in stage.sections else (0, 0)
    # gradients: the step's accumulator and the per-micro-batch buffer kept beside it (rewrite/programs.py)
    shards = tuple(size(n for n, j in stage.state_shards.items() if j == shard)[1]
                   for shard in range(len(stage.shard_optimize)))
    return StageMemory(stage.index, params, state, 2 * grads, kept[0], kept[1], peak_inflight, shards)
