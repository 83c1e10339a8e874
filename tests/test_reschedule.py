"""``rewrite.reschedule``: a plan's sections run by another schedule of the same layout are exactly the plan
``plan_with`` builds for that schedule (actions, memory model), and a schedule that cannot run them is
refused by name."""
from __future__ import annotations

import re

import pytest

import staticpipe
from models import build_gpt, build_mlp
from staticpipe._paddle import paddle
from staticpipe.rewrite import reschedule


def planned(schedule: str, stage_devices=None):
    net = (build_mlp(num_stages=4, depth=4, stage_devices=stage_devices) if stage_devices
           else build_gpt(num_stages=2, n_layers=2))
    with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard():
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.Adam(1e-3), num_microbatches=6, schedule=schedule)
        opt.minimize(net.loss)
    return opt.plan


V = ["gpu:0", "gpu:1", "gpu:1", "gpu:0"]
INTERLEAVED = ["gpu:0", "gpu:1", "gpu:0", "gpu:1"]


@pytest.mark.parametrize("source, target, devices", [
    ("1F1B", "F-then-B", None), ("F-then-B", "Eager1F1B", None), ("ZB-H1", "ZB-2P", None),
    ("ZB-V", "V-Half", V), ("V-Min", "DualPipeV", V), ("interleaved", "interleaved", INTERLEAVED)])
def test_the_same_plan_as_built_for_the_schedule(source, target, devices):
    built, moved = planned(target, devices), reschedule(planned(source, devices), target)
    assert moved.schedule == built.schedule == target
    assert moved.actions == built.actions
    assert moved.memory == built.memory
    assert stages_text(moved) == stages_text(built)


def stages_text(plan) -> list[str]:
    """Each stage's sections as text, name scopes without the counter Paddle keeps process-wide."""
    return [re.sub(r"(op_namescope = /\w+?)_\d+/", r"\1/", str(s)) for s in plan.stages]


@pytest.mark.parametrize("source, target, devices, needs, has", [
    ("1F1B", "ZB-H1", None, "stages on ranks [0, 1] with the backward split",
     "the plan has them on [0, 1] with the backward whole"),
    ("ZB-V", "interleaved", V, "stages on ranks [0, 1, 0, 1] with the backward whole",
     "the plan has them on [0, 1, 1, 0] with the backward split")])
def test_a_schedule_that_cannot_run_the_sections_is_named(source, target, devices, needs, has):
    with pytest.raises(ValueError) as err:
        reschedule(planned(source, devices), target)
    assert str(err.value) == f"schedule {target} cannot run the sections of this {source} plan: it needs {needs}, {has}"
