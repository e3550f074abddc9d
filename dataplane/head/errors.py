"""What a ClusterHead raises: a step it could not complete (``DataPlaneError``), a stage
that did not answer in time (``StageTimeout``) or refused a step (``StageFailed``), a
next stage that takes no frames (``StageUnreachable``: the pipeline's fault)."""

from __future__ import annotations

from zctl.engine.executor import PipelineUnreachable, StepError


class DataPlaneError(StepError):
    """A pipelined step could not be completed."""


class StageTimeout(DataPlaneError):
    """No answer in time; ``stages`` are the remote stages that may have failed to answer."""

    def __init__(self, message: str, stream_id: int, request_id: int,
                 stages: tuple[int, ...]) -> None:
        super().__init__(message)
        self.stream_id, self.request_id, self.stages = stream_id, request_id, stages


class StageFailed(DataPlaneError):
    """A stage refused or failed a step and said so in an ERROR frame."""

    def __init__(self, message: str, stream_id: int, request_id: int, stage: int) -> None:
        super().__init__(message)
        self.stream_id, self.request_id, self.stage = stream_id, request_id, stage


class StageUnreachable(DataPlaneError, PipelineUnreachable):
    """Stage 1 took no frame within the send timeout (its node is gone, or the link is
    down): nothing of the step, or of the stream's reset, reached it."""
