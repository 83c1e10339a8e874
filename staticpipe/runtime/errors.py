"""How a failure in one stage stops the whole pipeline: the error it raises, and what the others see."""
from __future__ import annotations


class StageError(RuntimeError):
    """A stage failed; names the stage, its device and the action. ``__cause__`` is the original error."""

    def __init__(self, stage: int, device: str, action: object, error: BaseException):
        self.stage, self.device, self.action = stage, device, action
        super().__init__(f"stage {stage} ({device}) failed in action {action}: "
                         f"{type(error).__name__}: {error}")


class PipelineAborted(RuntimeError):
    """Raised in a worker blocked on a channel when another stage failed."""
