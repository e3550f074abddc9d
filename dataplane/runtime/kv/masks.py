"""Attention masks over physical KV slots (pure functions).

A stream's KV state holds ``physical`` slots; ``keep`` says which of them are still
part of the sequence (mask-based rewind zeroes rejected draft tokens instead of
trimming the state). A step appends ``tokens`` new slots; token i of the step may see
every kept old slot and new slots 0..i.
"""

from __future__ import annotations

import numpy as np

# Large negative but finite: a float32-minimum mask can overflow to NaN on CPU kernels.
MASK_MIN = np.float32(np.finfo(np.float16).min)


def step_mask(keep: np.ndarray, tokens: int) -> np.ndarray:
    """Additive mask [1, 1, tokens, len(keep) + tokens] float32 for one stream's step."""
    keep = np.asarray(keep, dtype=bool)
    past = keep.shape[0]
    mask = np.full((tokens, past + tokens), MASK_MIN, dtype=np.float32)
    mask[:, :past][:, keep] = 0.0
    mask[:, past:][np.tril_indices(tokens)] = 0.0
    return mask[None, None]


def one_token_mask(after: np.ndarray) -> np.ndarray:
    """The mask of a one-token step from the slot table(s) once it ran (``keep`` plus a
    kept new slot): ``step_mask(keep, 1)`` [1, 1, 1, slots] for a stream's [slots] table,
    ``rows_step_mask(keep, 1)`` [rows, 1, 1, slots] for a group's [rows, slots] tables;
    float32 in one numpy call (the decode step's hot path)."""
    mask = np.where(after, np.float32(0.0), MASK_MIN)
    return mask.reshape(-1, 1, 1, mask.shape[-1])


def batch_step_mask(keeps: list[np.ndarray], tokens: int) -> np.ndarray:
    """Masks for several streams stepped together; every stream's KV must have the same length."""
    lengths = {len(k) for k in keeps}
    if len(lengths) != 1:
        raise ValueError(f"streams batched together need equal KV lengths, got {sorted(lengths)}")
    return np.concatenate([step_mask(k, tokens) for k in keeps], axis=0)


def drop_kept_tail(keep: np.ndarray, count: int) -> np.ndarray:
    """The slot table with its last ``count`` kept slots masked (mask-based rewind): a new
    array, ``keep`` itself when ``count`` is 0; ValueError if fewer are kept."""
    kept = np.flatnonzero(keep)
    if count < 0 or count > kept.size:
        raise ValueError(f"cannot rewind {count} tokens of a {kept.size}-token stream")
    if not count:
        return keep
    keep = keep.copy()
    keep[kept[kept.size - count:]] = False
    return keep


def static_step_mask(keep: np.ndarray, tokens: int, padded: int, context: int,
                     out: np.ndarray | None = None) -> np.ndarray:
    """Additive mask [1, 1, padded, context + padded] float32 of a static step: ``tokens``
    real tokens padded to ``padded``, over a host KV of ``context`` slots whose first
    ``len(keep)`` are filled. Token i sees the kept filled slots and new slots 0..i; a
    padding row sees only itself (its outputs and KV are thrown away)."""
    filled = keep.shape[0]
    if filled > context or not 1 <= tokens <= padded:
        raise ValueError(f"a {tokens}-token step padded to {padded} over {filled} filled "
                         f"slots does not fit a {context}-slot static KV")
    mask = np.empty((1, 1, padded, context + padded), np.float32) if out is None else out
    mask.fill(MASK_MIN)
    rows = mask[0, 0]
    rows[:tokens, :filled][:, keep] = 0.0
    new = rows[:, context:]
    new[np.tril_indices(tokens)] = 0.0
    pad = np.arange(tokens, padded)
    new[pad, pad] = 0.0
    return mask
