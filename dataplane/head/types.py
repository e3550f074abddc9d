"""What the coordinator's end of the data plane returns and raises (no sockets here):
replies with their timing, counters, errors, and the small checks on a step's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from dataplane.wire.frames import EMPTY_INDEX, TOP1, HiddenStateFrame, ReplyMode
from dataplane.wire.reply_records import top_k_records
from dataplane.wire.timing import StepTiming, TimingStamps
from zctl.engine.executor import StepError, StepReply
from zctl.engine.payloads import Want, as_payload, logprob_rows

INT64 = np.dtype(np.int64)


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


@dataclass
class ClusterReply(StepReply):
    """A StepReply plus where it came from, top-k records and the timing breakdown."""

    stream_id: int = 0
    top: np.ndarray | None = None  # top-1 (token, logit) or top-k (token, log-probability)
    # records [positions, k], best first
    stamps: TimingStamps | None = None

    @cached_property
    def timing(self) -> StepTiming | None:
        """Compute, queueing, serialisation and network time of this step, per stage/hop."""
        return self.stamps.derive() if self.stamps is not None else None


@dataclass
class ClusterStats:
    submitted: int = 0
    replies: int = 0
    stale_replies: int = 0  # answers of an old epoch or of abandoned requests
    malformed: int = 0
    unexpected: int = 0
    errors: int = 0
    timeouts: int = 0
    cancelled: int = 0  # steps cancelled (pipelined speculation's wrong guesses), answered
    # or not


def reply_from_frame(header: HiddenStateFrame, payload: np.ndarray, top_k: int,
                     vocab: int = 0) -> ClusterReply:
    """The ClusterReply a REPLY frame carries (``top_k``: what its step asked for). A top-k
    reply to an engine's step (``vocab`` > 0) also gets the dense log-probability rows a
    session reads (zctl.engine.payloads.logprob_rows)."""
    if header.reply in (ReplyMode.LOGITS, ReplyMode.LOGITS16):
        logits = payload if header.reply == ReplyMode.LOGITS else payload.astype(np.float32)
        top = top_k_records(logits, top_k) if top_k > 1 else None
        return ClusterReply(tokens=logits.argmax(axis=-1), logits=logits,
                            request_id=header.request_id, stream_id=header.stream_id, top=top)
    if payload.size == 1:  # top-1 for one position: the per-token path
        tokens = np.array(TOP1.unpack(payload)[:1], dtype=np.int64)
    else:
        tokens = payload["token"][:, 0].astype(np.int64)
    reply = ClusterReply(tokens=tokens, request_id=header.request_id,
                         stream_id=header.stream_id, top=payload)
    if header.reply == ReplyMode.TOPK and vocab:
        reply.logits = logprob_rows(payload["token"], payload["logit"], vocab)
        reply.logprob_rows = True
    return reply


def reply_mode(want_logits: Want, top_k: int) -> tuple[ReplyMode, int]:
    """The reply mode and top-k of a step asking ``want_logits`` (zctl.engine.payloads) or,
    without logits, the ``top_k`` best tokens."""
    payload = as_payload(want_logits)
    if payload is None:
        return (ReplyMode.TOPK, top_k) if top_k > 1 else (ReplyMode.TOP1, 1)
    if payload.top:
        return ReplyMode.TOPK, payload.top
    return (ReplyMode.LOGITS16 if payload.fp16 else ReplyMode.LOGITS), max(1, top_k)


def as_int64_vector(values: Any) -> np.ndarray:
    """``values`` as a 1-D int64 array, without a copy (or a numpy call) when it is one."""
    if type(values) is np.ndarray and values.dtype is INT64 and values.ndim == 1:
        return values
    return np.asarray(values, dtype=np.int64).reshape(-1)


def check_logits_idx(logits_idx: np.ndarray | None, tokens: int) -> np.ndarray:
    """The logits indices to send (empty = the last token); ValueError if out of range."""
    if logits_idx is None:
        return EMPTY_INDEX
    idx = np.asarray(logits_idx, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= tokens):
        raise ValueError(f"logits_idx {idx.tolist()} out of range for {tokens} tokens")
    return idx
