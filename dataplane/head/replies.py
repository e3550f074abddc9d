"""The last stage's answer as the head hands it to the engine (``ClusterReply``, read from a
REPLY frame by ``reply_from_frame``), and the reply a step asks for (``reply_mode``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dataplane.wire.frames import TOP1, HiddenStateFrame, ReplyMode
from dataplane.wire.reply_records import top_k_records
from dataplane.wire.timing import StepTiming, TimingStamps
from zctl.engine.executor import StepReply
from zctl.engine.payloads import Want, as_payload, logprob_rows


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
