"""Profiling and automatic partitioning: balanced stages without hand-placed guards.

``profile`` measures every forward op (forward and backward time, parameter and activation bytes,
FLOPs) on the real device; ``auto_place`` groups the ops into layers, cuts the layer sequence into
contiguous stages by a policy (uniform, params, time, memory) and writes each op's ``op_device``, so
``PipelineOptimizer.minimize`` splits the program as if the user had written the guards.

    layers.py      which ops form a layer (name scopes, parameter owners, ops that must stay together)
    profile.py     per-op measurements on the device -> Profile
    pir_profile.py the same for a PIR program: each op run alone as a section of one op
    costs.py       Profile: per-op and per-layer costs, tables, CSV, JSON
    policies.py    where to cut: one exact dynamic program, four objectives; pure numpy
    auto_place.py  constraints (guards, split points), the cut, the op tags and the per-stage report
    planner.py     auto_plan: partition x schedule x per-stage recompute under per-device memory caps
    plan_timing.py what the plans the planner builds cost when run (a few traced steps each)
"""
from .auto_place import POLICIES, Placement, StageReport, auto_place
from .layers import Layer, group_layers
from .policies import Constraints
from .costs import LayerRow, OpRow, Profile
from .profile import profile
from .plan_report import Candidate, PlanReport
from .planner import auto_plan

__all__ = ["auto_plan", "PlanReport", "Candidate", "auto_place", "Placement", "StageReport", "POLICIES", "profile", "Profile", "OpRow", "LayerRow",
           "Layer", "group_layers", "Constraints"]
