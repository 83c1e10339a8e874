"""staticpipe: pipeline-parallel training of PaddlePaddle static-graph programs.

build (device_guard) -> rewrite (PipelineOptimizer, Plan) -> schedule (action lists) -> run (Executor).
"""
from . import io, schedule
from ._paddle import use_legacy_ir
from .optimizer import PipelineOptimizer
from .placement import Device, device_guard, parse_device, split_point
from .plan import Plan, plan_of
from .ir import variable
from .runtime import NonFiniteError, StageError
from .executor import Executor
from .checkpoint import load, save
from .saved_plan import load_plan, save_plan
from .export import export_inference
from .partition import auto_place, auto_plan, profile
from .verify import VerifyReport, verify
from . import fleet  # noqa: E402  (Paddle's fleet names, after the executor it builds on)

__all__ = ["Device", "device_guard", "parse_device", "split_point", "PipelineOptimizer", "Plan", "Executor", "StageError", "NonFiniteError",
           "plan_of", "io", "schedule", "verify", "VerifyReport", "save", "load", "export_inference",
           "auto_place", "auto_plan", "profile", "save_plan", "load_plan", "use_legacy_ir", "fleet",
           "variable"]
