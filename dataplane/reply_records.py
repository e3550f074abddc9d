"""The last stage's answer records (pure): the best (token, logit) of each answered position,
or the k best (token, log-probability), packed as a top-1 / top-k reply's payload
(dataplane.frames.TOPK_DTYPE)."""

from __future__ import annotations

import numpy as np

from dataplane.frames import TOP1, TOPK_DTYPE
from engine.payloads import top_logprobs


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
    (engine.payloads.top_logprobs)."""
    tokens, logprobs = top_logprobs(logits, k)
    out = np.empty(tokens.shape, dtype=TOPK_DTYPE)
    out["token"], out["logit"] = tokens, logprobs
    return out
