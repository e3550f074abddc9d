"""Row groups: several streams stepped as the rows of one batched inference (pure numpy).

A stage's KV state tensors are [batch, kv_heads, slots, head_dim]. Streams that decode
together can live as the rows of one InferRequest: one inference then steps every row
(cheaper than one inference per stream on the CPU plugin). Rows share the slot count, so
each row has its own slot table (``keep[row]``): a row shorter than the others is padded
with masked slots, exactly like a rewound slot. Attention does not care where a kept
slot sits (RoPE is applied before a key is cached), so merging rows may reorder and
compact slots freely.

This module holds the pure parts: gathering member rows into a new batch, the per-row
attention mask, and finding a stream's row. ``dataplane.runtime.stateful.StageRunner``
applies them to its requests (a paged stage's rows are sequences of their own: nothing to
gather).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dataplane.runtime.base import RowGroupKV
from dataplane.runtime.kv.masks import MASK_MIN

SLOT_AXIS = 2  # state tensors: [batch, kv_heads, slots, head_dim]


def find_row(groups: Mapping[int, RowGroupKV], stream_id: int) -> tuple[int, int] | None:
    """(group id, row) of the row group in ``groups`` whose rows include ``stream_id``, if
    any."""
    for group_id, group in groups.items():
        if stream_id in group.members:
            return group_id, group.members.index(stream_id)
    return None


@dataclass(frozen=True)
class RowSource:
    """Where a member row's KV comes from: ``states[name]`` is [rows, heads, slots, dim] and
    ``row`` picks the member's row; ``keep`` is its slot table (True: part of the sequence).
    A sliding layer's states (dataplane.runtime.kv.sliding_states) hold its slots from
    ``sliding_start`` on and lack the keys of its first ``sliding_gone`` tokens."""

    states: dict[str, np.ndarray]
    row: int
    keep: np.ndarray
    sliding_start: int = 0
    sliding_gone: int = 0


def merge_rows(sources: Sequence[RowSource]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Build the state tensors of a batch whose row i is ``sources[i]``'s kept slots.

    Returns (tensors by state name [B, heads, L, dim], keep [B, L]) where L is the longest
    member's kept length; shorter rows are zero-padded at the end with masked slots.
    """
    if not sources:
        raise ValueError("a row group needs at least one member")
    names = set(sources[0].states)
    for src in sources:
        if set(src.states) != names:
            raise ValueError("members come from requests with different state variables")
        if src.keep.ndim != 1:
            raise ValueError(f"a member's slot table must be 1-D, got {src.keep.shape}")
    kept = [np.flatnonzero(src.keep) for src in sources]
    length = max(k.size for k in kept)
    keep = np.zeros((len(sources), length), dtype=bool)
    for i, k in enumerate(kept):
        keep[i, :k.size] = True
    merged: dict[str, np.ndarray] = {}
    for name in sorted(names):
        first = sources[0].states[name]
        out = np.zeros((len(sources), first.shape[1], length, first.shape[3]), dtype=first.dtype)
        for i, (src, k) in enumerate(zip(sources, kept, strict=True)):
            data = src.states[name]
            if data.shape[SLOT_AXIS] != src.keep.size:
                raise ValueError(f"state {name} has {data.shape[SLOT_AXIS]} slots but the "
                                 f"member's slot table has {src.keep.size}")
            out[i, :, :k.size, :] = data[src.row][:, k, :]
        merged[name] = out
    return merged, keep


def rows_step_mask(keep: np.ndarray, tokens: int) -> np.ndarray:
    """Additive mask [B, 1, tokens, slots + tokens] for a step of every row of a group.

    Row b's token i sees row b's kept slots and the step's new slots 0..i.
    """
    keep = np.asarray(keep, dtype=bool)
    if keep.ndim != 2:
        raise ValueError(f"a group's slot table must be [rows, slots], got {keep.shape}")
    rows, past = keep.shape
    mask = np.full((rows, 1, tokens, past + tokens), MASK_MIN, dtype=np.float32)
    mask[:, 0, :, :past] = np.where(keep[:, None, :], np.float32(0.0), MASK_MIN)
    causal = np.tril(np.ones((tokens, tokens), dtype=bool))
    mask[:, 0, :, past:][:, causal] = 0.0
    return mask
