"""The last stage's answer records (pure): the best (token, logit) of each answered position,
or the k best, packed as a top-1 / top-k reply's payload (dataplane.frames.TOPK_DTYPE)."""

from __future__ import annotations

import numpy as np

from dataplane.frames import TOP1, TOPK_DTYPE


def top1_record(logits: np.ndarray) -> bytes:
    """The packed (token, logit) record of the best token of one row of logits [..., vocab]
    (the per-token path: no array is made)."""
    token = int(logits.argmax())
    return TOP1.pack(token, logits.item(token))


def top_k_records(logits: np.ndarray, k: int) -> np.ndarray:
    """Top-k (token, logit) records [rows, k], best first, of logits [..., vocab]."""
    if k == 1 and logits.size == logits.shape[-1]:  # one row: the per-token hot path
        return np.ndarray((1, 1), TOPK_DTYPE, top1_record(logits))
    rows = logits.reshape(-1, logits.shape[-1])
    out = np.empty((rows.shape[0], k), dtype=TOPK_DTYPE)
    if k == 1:
        ids = rows.argmax(axis=-1)
        out["token"][:, 0] = ids
        out["logit"][:, 0] = rows[np.arange(rows.shape[0]), ids]
        return out
    part = np.sort(np.argpartition(rows, -k, axis=-1)[:, -k:], axis=-1)
    values = np.take_along_axis(rows, part, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")  # ties: lowest id first, as argmax
    out["token"] = np.take_along_axis(part, order, axis=-1)
    out["logit"] = np.take_along_axis(values, order, axis=-1)
    return out
