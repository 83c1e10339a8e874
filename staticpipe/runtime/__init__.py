"""The runtime: executes a Plan's action lists with one worker per device, joined by channels."""
from .channel import Channel, InProcessChannel, PipelineAborted
from .executor import Executor, plan_of
from .places import place_of
from .worker import StageError

__all__ = ["Channel", "InProcessChannel", "PipelineAborted", "Executor", "StageError", "plan_of", "place_of"]
