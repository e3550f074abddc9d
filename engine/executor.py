"""The engine's contract with whatever runs the stages: an ``Executor``.

An executor takes a step (a chunk of token ids at explicit logical positions for a stream
or a row group) and answers with the last stage's ``StepReply``. ``LocalChain``
(dataplane.local_chain) runs every stage in this process; ``ClusterHead``
(dataplane.cluster) runs stage 0 here and the rest on nodes over ZeroMQ. The scheduler
drives both the same way, through this Protocol only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class StepReply:
    """What the last stage returns: greedy token per requested position, logits if asked."""

    tokens: np.ndarray
    logits: np.ndarray | None = None
    stage_ms: list[float] = field(default_factory=list)


def reply_from_logits(logits: np.ndarray, want_logits: bool = False) -> StepReply:
    """Top-1 per row of [1, K, V] (or [K, V]) logits; keep the logits only when asked."""
    rows = logits.reshape(-1, logits.shape[-1])
    return StepReply(tokens=rows.argmax(axis=-1), logits=rows.copy() if want_logits else None)


class Executor(Protocol):
    num_stages: int

    def open(self, stream_id: int) -> None: ...
    def reset(self, stream_id: int) -> None: ...
    def step(self, stream_id: int, token_ids: np.ndarray, positions: np.ndarray,
             logits_idx: np.ndarray | None = None, want_logits: bool = False) -> StepReply: ...


