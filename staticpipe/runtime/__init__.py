"""The runtime: executes a Plan's action lists with one worker per device, joined by channels.

``devices`` (workers, threads, channels of this process) -> ``step`` (one pipelined step) and ``state``
(the stages' parameters and optimizer state); a ``worker`` runs a rank's actions, its ``optimize_phase``
the once-per-step exchanges; ``channel``/``distributed`` move the messages; ``watchdog`` stops a job
whose other process failed.
"""
from .channel import Channel, InProcessChannel
from .errors import NonFiniteError, PipelineAborted, StageError

__all__ = ["Channel", "InProcessChannel", "NonFiniteError", "PipelineAborted", "StageError"]
