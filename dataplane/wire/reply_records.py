"""The last stage's answer (pure): the best (token, logit) of each answered position, or the
k best (token, log-probability), packed as a top-1 / top-k reply's payload
(dataplane.wire.frames.TOPK_DTYPE), or the logits themselves (``reply_payload``: the
payload a step's reply mode asks for)."""

from __future__ import annotations

import numpy as np

from dataplane.wire.frames import TOP1, TOPK_DTYPE, ReplyMode
from zctl.engine.payloads import as_float16, top_logprobs


def top1_record(logits: np.ndarray) -> bytes:
    """The packed (token, logit) record of the best token of one row of logits [..., vocab]
    (the per-token path: no array is made)."""
    token = int(logits.argmax())
    return TOP1.pack(token, logits.item(token))


def top1_records(logits: np.ndarray) -> np.ndarray:
    """The best (token, logit) record [rows, 1] of each row of logits [..., vocab]."""
    if logits.size == logits.shape[-1]:  # one row: the per-token hot path
        return np.ndarray((1, 1), TOPK_DTYPE, top1_record(logits))
    rows = logits.reshape(-1, logits.shape[-1])
    out = np.empty((rows.shape[0], 1), dtype=TOPK_DTYPE)
    ids = rows.argmax(axis=-1)
    out["token"][:, 0] = ids
    out["logit"][:, 0] = rows[np.arange(rows.shape[0]), ids]
    return out


def top_k_records(logits: np.ndarray, k: int) -> np.ndarray:
    """Top-k (token, log-probability) records [rows, k], best first, of logits [..., vocab]
    (zctl.engine.payloads.top_logprobs)."""
    tokens, logprobs = top_logprobs(logits, k)
    out = np.empty(tokens.shape, dtype=TOPK_DTYPE)
    out["token"], out["logit"] = tokens, logprobs
    return out


def reply_payload(logits: np.ndarray, mode: ReplyMode, top_k: int) -> np.ndarray:
    """The last stage's answer for logits [1, P, V]: records [P, k] or logits [P, V]."""
    if mode == ReplyMode.LOGITS:
        return logits.reshape(-1, logits.shape[-1])
    if mode == ReplyMode.LOGITS16:
        return as_float16(logits.reshape(-1, logits.shape[-1]))
    if mode == ReplyMode.TOP1:
        return top1_records(logits)
    return top_k_records(logits, max(1, top_k))
